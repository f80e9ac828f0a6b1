"""ONNX models through ONNX Runtime: the CANN execution provider on an NPU, the CPU elsewhere.

`parameters { key: "execution_provider" }` chooses, loudly:
  * `auto` (default): CANNExecutionProvider if it can be created here, else the CPU with a
    WARNING and `degraded: "true"` plus the reason in `info` (so in model metadata). With a build
    of onnxruntime that has no CANNExecutionProvider (the `cpu` extra) the CPU is what `auto`
    means: an INFO line, not degraded;
  * `cann`: CANNExecutionProvider or the model fails to load, with onnxruntime's reason;
  * `cpu`: the CPU; CANN is never tried.
Provider options are `parameters { key: "cann.<option>" }`, checked at load whatever the mode:
an unknown option or a value onnxruntime would refuse is a load error, never a silent fallback.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from ...errors import InvalidInput, ModelLoadError
from .. import compile_cache, memory_meter, npu_access
from .base import Runtime, TensorSpec, parameter
from .tiny_onnx import relu_model

try:
    import onnxruntime as ort
except ImportError as error:
    # onnxruntime is an extra: the CPU build and the CANN build own the same `onnxruntime`
    # package and cannot be installed together, so neither is a base dependency.
    raise ModelLoadError(
        f"onnxruntime is not installed ({error}): install kserve-ascend with the 'cpu' extra"
        " (pip install '.[cpu]', onnxruntime) or, on Ascend hosts, the 'ascend' extra"
        " (pip install '.[ascend]', onnxruntime-cann)"
    ) from None

log = logging.getLogger(__name__)

CANN = "CANNExecutionProvider"
CPU = "CPUExecutionProvider"
MODES = ("auto", "cann", "cpu")
#: Config parameters `cann.<option>` are options of the CANN execution provider.
PREFIX = "cann."


class _Values(NamedTuple):
    accepts: Callable[[str], bool]
    want: str


def _one_of(*names: str) -> _Values:
    return _Values(names.__contains__, "one of " + ", ".join(names))


_BYTES = _Values(lambda v: v.isascii() and v.isdigit() and int(v) < 2**64, "a number of bytes")
_BOOLEAN = _one_of("0", "1", "false", "true", "False", "True")
#: Any string: CANN itself checks it when it compiles the graph (warmup, before READY).
_STRING = _Values(lambda v: True, "")

#: The CANN execution provider's options as onnxruntime-cann 1.22.1 parses them, and the values
#: it accepts: CANNExecutionProviderInfo::FromProviderOptions in onnxruntime v1.22.1's
#: onnxruntime/core/providers/cann/cann_execution_provider_info.cc (an unknown key is
#: "Unknown provider option"), values parsed by core/common/parse_string.h (size_t: digits only;
#: bool: the six spellings above) and core/framework/provider_options_utils.h (enums by name).
#: tests/test_cann_ep.py holds this table to the installed wheel (its keys, its verdicts).
CANN_OPTIONS: dict[str, _Values] = {
    "npu_mem_limit": _BYTES,
    "arena_extend_strategy": _one_of("kNextPowerOfTwo", "kSameAsRequested"),
    "enable_cann_graph": _BOOLEAN,
    "dump_graphs": _BOOLEAN,
    # True by default: the provider saves each graph it compiles as an offline model (.om) in
    # the working directory, and loads it from there on a later run: core/execution/compile_cache.py.
    "dump_om_model": _BOOLEAN,
    "precision_mode": _STRING,
    "op_select_impl_mode": _STRING,
    "optypelist_for_implmode": _STRING,
}
#: Set from the instance's NPU (instance_group `gpus`, parameters `device_ids`), never by hand.
DEVICE_OPTION = "device_id"

#: The library onnxruntime-cann loads the provider from: when it cannot be loaded, onnxruntime
#: only logs why and raises "create CANN ExecutionProvider fail" (onnxruntime_pybind_state.cc).
_PROVIDER_LIBRARY = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cann.so"

_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def _spec(node: ort.NodeArg) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape)
    return TensorSpec(node.name, _DATATYPES.get(node.type, node.type), shape)


class _Session(ort.InferenceSession):
    """An InferenceSession without onnxruntime's silent fallback.

    ORT's Python wrapper catches a provider's failure, prints it and retries on the CPU, both
    when the session is created and when a run fails with EPFail
    (onnxruntime/python/onnxruntime_inference_collection.py, InferenceSession.__init__ and
    Session.run; 1.22 has no switch for it, later releases take `enable_fallback=0`).
    Here every such failure is raised: the runtime decides what falls back, and says so.
    """

    _enable_fallback = property(lambda self: False, lambda self, value: None)


class _CannUnavailable(Exception):
    """CANNExecutionProvider could not be created here; the message says why."""


class OnnxRuntime(Runtime):
    name = "onnx"

    def __init__(self, path, device_id, config):
        super().__init__(path, device_id, config)
        mode = parameter(config, "execution_provider", "auto")
        if mode not in MODES:
            raise ModelLoadError(f"parameter execution_provider must be one of {', '.join(MODES)}, got {mode!r}")
        cann_options = self._cann_options()
        if mode == "auto" and CANN not in ort.get_available_providers():
            log.info(
                "%s: %s runs on the CPU: onnxruntime %s is a build without %s (the 'ascend' extra, onnxruntime-cann, has it)",
                config.name, path.name, ort.__version__, CANN,
            )
            mode = "cpu"
        self.degraded_reason: str | None = None
        self.session = None
        #: Device bytes the session took on the NPU (the device's free memory before and after, through pyACL).
        self.memory_bytes: int | None = None
        before = _npu_memory(device_id) if mode != "cpu" else None
        if mode != "cpu":
            try:
                self.session = self._open([(CANN, cann_options), CPU])
            except _CannUnavailable as why:
                if mode == "cann":
                    raise ModelLoadError(f"execution_provider is 'cann' but {why}") from None
                self.degraded_reason = str(why)
        if self.session is None:
            self.session = self._open([CPU])
        if self.degraded_reason:
            log.warning(
                "%s: %s serves on the CPU, not on the NPU: %s (parameters execution_provider: 'cpu' chooses the"
                " CPU on purpose, 'cann' refuses to load without the NPU)",
                config.name, path.name, self.degraded_reason,
            )
        self.provider = self.session.get_providers()[0]
        if self.provider == CANN:
            after = _npu_memory(device_id)
            if before is not None and after is not None:
                self.memory_bytes = max(0, before[0] - after[0])
            else:
                self.memory_source = f"{memory_meter.RESIDENT} (pyACL is not importable: the NPU's memory is not seen)"
        self.inputs = [_spec(n) for n in self.session.get_inputs()]
        self.outputs = [_spec(n) for n in self.session.get_outputs()]
        self._batch_sizes = self._file_batch_sizes()
        self._text_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}
        self._text_outputs = {s.name for s in self.outputs if s.datatype == "BYTES"}
        if self._text_inputs:
            self.prepare_request = self._decode_text  # per request, so bad bytes fail only their request
        log.info("%s: %s on device %d with %s", config.name, path.name, device_id, self.provider)

    def _cann_options(self) -> dict[str, str]:
        """The config's `cann.*` parameters, checked as onnxruntime-cann would, plus the device."""
        options = {}
        for key, value in self.config.parameters.items():
            if key in CANN_OPTIONS:  # the name these options had before they took the prefix
                raise ModelLoadError(f"parameter {key!r} is not read: CANN execution provider options are named {PREFIX}{key}")
            if not key.startswith(PREFIX):
                continue
            option, value = key[len(PREFIX):], value.string_value
            if option == DEVICE_OPTION:
                raise ModelLoadError(
                    f"parameter {key!r} is not allowed: each instance runs on its own NPU"
                    " (instance_group gpus or parameters device_ids)"
                )
            if option not in CANN_OPTIONS:
                raise ModelLoadError(
                    f"parameter {key!r}: onnxruntime's CANN execution provider has no option {option!r}"
                    f" (it has {', '.join(sorted(CANN_OPTIONS))})"
                )
            values = CANN_OPTIONS[option]
            if not values.accepts(value):
                raise ModelLoadError(f"parameter {key!r}: onnxruntime's CANN execution provider refuses {value!r}, want {values.want}")
            options[option] = value
        return {DEVICE_OPTION: str(self.device_id), **options}

    def _open(self, providers: list) -> ort.InferenceSession:
        """A session on `providers`; `_CannUnavailable` when the CANN provider was asked for and not created."""
        options = ort.SessionOptions()
        threads = parameter(self.config, "intra_op_thread_count")
        if threads:
            try:
                options.intra_op_num_threads = int(threads)
            except ValueError:
                raise ModelLoadError(f"parameter intra_op_thread_count must be a whole number, got {threads!r}") from None
        wants_cann = providers[0] != CPU
        if wants_cann and CANN not in ort.get_available_providers():
            raise _CannUnavailable(
                f"the installed onnxruntime {ort.__version__} has no {CANN}"
                " (install kserve-ascend's 'ascend' extra, onnxruntime-cann, in place of the 'cpu' extra)"
            )
        unusable = []  # why this process cannot open the NPU, added to a failure's reason
        if wants_cann:
            unusable = npu_access.warn_once()
            try:  # the provider saves what it compiles in the working directory, which must be writable
                compile_cache.enter(self.path, f"onnxruntime-{ort.__version__}")
            except compile_cache.Unwritable as why:
                raise _CannUnavailable(str(why)) from None
        try:
            session = _Session(str(self.path), options, providers=providers)
        except Exception as error:  # ORT raises its own exception types
            if not wants_cann:
                raise ModelLoadError(f"onnxruntime cannot load {self.path.name}: {error}") from None
            if "provider option" in str(error):  # provider_options_utils.h: a value the provider refused
                raise ModelLoadError(f"onnxruntime's CANN execution provider refuses its options: {error}") from None
            raise _CannUnavailable(
                f"onnxruntime could not create {CANN} on device {self.device_id}: {error}{_library_error()}"
                + "".join(f"; {problem}" for problem in unusable)
            ) from None
        if wants_cann and session.get_providers()[0] != CANN:
            raise _CannUnavailable(f"onnxruntime created the session on {session.get_providers()} without {CANN}")
        return session

    def _file_batch_sizes(self) -> tuple[int, ...]:
        """(B,) when the model batches and every tensor's first dimension is the same number B."""
        if self.config.max_batch_size <= 0:
            return ()
        firsts = {spec.shape[0] if spec.shape else -1 for spec in (*self.inputs, *self.outputs)}
        return tuple(firsts) if len(firsts) == 1 and min(firsts) > 0 else ()

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self._batch_sizes

    @property
    def compiles_per_shape(self) -> bool:
        # The CANN provider builds an offline model per input shape on first sight of it.
        return self.provider == CANN

    @property
    def info(self) -> Mapping[str, str]:
        info = {**super().info, "execution_provider": self.provider}
        if self.degraded_reason:
            info.update(degraded="true", degraded_reason=self.degraded_reason)
        return info

    def _decode_text(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object]) -> Mapping[str, np.ndarray]:
        return {**inputs, **{n: _text(inputs[n], n) for n in self._text_inputs if n in inputs}}

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        # Strings decoded by prepare_request stay as they are; padding rows and warmup samples are decoded here.
        feed = {n: _text(a, n) if n in self._text_inputs else a for n, a in inputs.items()}
        outputs = dict(zip(output_names, self.session.run(list(output_names), feed)))
        for name in self._text_outputs.intersection(outputs):
            outputs[name] = _utf8(outputs[name])
        return outputs

    def close(self) -> None:
        self.session = None


def _text(array: np.ndarray, name: str) -> np.ndarray:
    """A BYTES tensor (numpy objects, `bytes`) as onnxruntime takes a tensor(string): `str` objects.

    onnxruntime's Python binding turns each element of an object array into text with
    PyObject_Str and stores that text as UTF-8 (CopyDataToTensor in
    onnxruntime/python/onnxruntime_pybind_mlvalue.cc), so `bytes` would reach the model as
    "b'...'". Bytes that are not UTF-8 have no text to stand for them: a client error, not corruption.
    """
    flat = array.ravel()
    text = np.empty(flat.shape, dtype=object)
    for index, value in enumerate(flat):
        if isinstance(value, str):
            text[index] = value
            continue
        try:
            text[index] = bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidInput(
                f"input '{name}' element {index} is not UTF-8 text ({error.reason} at byte {error.start}):"
                " the model takes it as a tensor(string), which holds UTF-8"
            ) from None
    return text.reshape(array.shape)


def _utf8(array: np.ndarray) -> np.ndarray:
    """A tensor(string) output (numpy objects, `str`) as a BYTES tensor: the UTF-8 of each string."""
    return np.array([value.encode("utf-8") for value in array.ravel()], dtype=object).reshape(array.shape)


def initialise_acl(device_id: int) -> None:
    """Lets the CANN execution provider initialise ACL, if this onnxruntime has one; before pyACL does.

    The provider calls `CANN_CALL_THROW(aclInit(nullptr))` in InitializeRegistry() when its
    library loads (onnxruntime/core/providers/cann/cann_execution_provider.cc; called from
    ProviderLibrary::Get in core/session/provider_bridge_ort.cc, which on that throw unloads the
    library through DeleteRegistry(), whose aclFinalize() tears ACL down for the whole process).
    So the provider works only where it is the first to call aclInit: a session made here on a
    one-Relu model loads the library now; pyACL's acl.init then answers
    ACL_ERROR_REPEAT_INITIALIZE, which the acl runtime tolerates, and ACL is the provider's to
    finalize. A failure here (no CANN, a device the host lacks) is the caller's own calls' to report.
    """
    if CANN not in ort.get_available_providers():
        return
    try:
        _Session(relu_model(), providers=[(CANN, {DEVICE_OPTION: str(device_id)})])
    except Exception as error:  # ORT raises its own exception types
        log.info("%s did not initialise ACL: %s%s", CANN, error, _library_error())


def _npu_memory(device_id: int) -> tuple[int, int] | None:
    """The NPU's (free, total) bytes through pyACL, where it is importable and this onnxruntime has the CANN
    provider, which initialises ACL first (`initialise_acl`, once); None otherwise."""
    acl = memory_meter.pyacl()
    if acl is None or CANN not in ort.get_available_providers():
        return None
    if device_id not in _PRIMED:
        _PRIMED.add(device_id)
        initialise_acl(device_id)
    try:
        return memory_meter.device_reading(acl, device_id)
    except Exception:  # ACL not usable here: the measurement falls back to resident memory
        return None


_PRIMED: set[int] = set()


def _library_error() -> str:
    """Why the CANN provider's library does not load (a missing or mismatched CANN), if it does not."""
    if not _PROVIDER_LIBRARY.exists():
        return ""
    try:
        ctypes.CDLL(str(_PROVIDER_LIBRARY))
    except OSError as error:
        return (
            f"; {_PROVIDER_LIBRARY.name} does not load: {error}"
            " (is the CANN toolkit installed and its set_env.sh sourced?)"
        )
    return ""

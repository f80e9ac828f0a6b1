"""A session of the `.om` runtime with pyACL, recorded as a JSON trace and replayed anywhere.

`record` runs AclRuntime through a `Recorder`, a proxy of the `acl` module that notes every call
with its arguments and its result (or the exception it raised) and every call the runtime looked
for and did not find: on an Ascend host, what CANN's pyACL really answers (`make check-ascend`
records one, `check` below). `replay` runs the same session through a `Replayer`, which
serves those answers to the runtime in place of `acl`, on any machine, and fails naming the call
when the runtime makes one the trace does not have next, or with other arguments: a change of
the runtime that real pyACL would see differently shows as a failed test
(tests/test_acl_trace.py replays every trace in tests/data/acl_traces/).

    python -m kserve_ascend.core.execution.runtimes.acl_trace record MODEL.om TRACE [--device N] [--config config.pbtxt]
        one session of any `.om` (each batch size it takes, once) through the `acl` on the path;
    python -m kserve_ascend.core.execution.runtimes.acl_trace check MODEL.onnx [TRACE] [--device N]
        `make check-ascend`'s check 7 (tools/check_ascend_host.py runs it in a process of its own):
        ATC compiles the host check's Relu model (x [-1, 4]) for this chip with dynamic batch gears
        1, 2, 4, the session runs through CANN's pyACL, Relu's answers are checked, and the trace is
        written (default: tests/data/acl_traces/<chip>-cann<version>.json in a clone, else the
        temporary directory). Prints one JSON line: what it found, or the error and its fix.

The trace holds what stays the same between two runs of the session. The model's path is
recorded as its file name, and pinned host memory (acl.rt.malloc_host) at stand-in addresses,
`(n + 1) << 40` for the n-th buffer: real addresses change with every run. Device addresses,
handles and model ids are recorded as pyACL gave them; the runtime only passes them back.
"""

from __future__ import annotations

import argparse
import builtins
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from ...datatypes import to_numpy
from .acl import DYNAMIC_BATCH_INPUT, AclRuntime
from .acl_process import PROCESS_ACL

FORMAT = "kserve-ascend-acl-trace/1"
#: pyACL's submodules (hicann/runtime python/pyACL/py_init_acl.cpp, PyInit_acl).
NAMESPACES = frozenset({"rt", "mdl", "media", "op", "blas", "util", "prof", "himpi", "fv"})
_PINNED = "acl.rt.malloc_host"
_VIEW = "acl.util.ptr_to_numpy"
_ALIGNMENT = 64  # what acl.rt.malloc_host gives, and acl.rt.memcpy_async wants


class ReplayMismatch(AssertionError):
    """The runtime did not make the call the trace has next."""


class _PinnedMemory:
    """Pinned host buffers of a session: where they are in this process, and in the trace."""

    def __init__(self):
        self._spans: list[tuple[int, int, int]] = []  # (address here, address in the trace, size)

    def add(self, here: int, size: int, traced: int | None = None) -> int:
        traced = (len(self._spans) + 1) << 40 if traced is None else traced
        self._spans.append((here, traced, size))
        return traced

    def traced(self, value: Any) -> Any:
        """An address inside a buffer moved to the trace's address of it; anything else as it is."""
        if isinstance(value, int) and not isinstance(value, bool):
            for here, traced, size in self._spans:
                if here <= value < here + size:
                    return traced + value - here
        return value


def _plain(value: Any) -> Any:
    """JSON for a pyACL argument or result: tuples as lists, an array or bytes as what they are."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        return {"ndarray": {"shape": list(value.shape), "dtype": value.dtype.str}}
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"object": type(value).__name__}  # never equal to what a plain value records


class _Namespace:
    """acl.rt, acl.mdl, ...: what is looked up in it, the session looks up."""

    def __init__(self, session: "Recorder | Replayer", prefix: str):
        self._session, self._prefix = session, prefix

    def __getattr__(self, name: str) -> Any:
        return self._session._lookup(f"{self._prefix}.{name}")


class _Session:
    """What a Recorder and a Replayer share: the `acl` they stand for, and the trace's view of values."""

    def __init__(self, model: Path):
        self._model = str(model)
        self._pinned = _PinnedMemory()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._lookup(f"acl.{name}")

    def _lookup(self, qualified: str) -> Any:
        raise NotImplementedError

    def _traced(self, value: Any) -> Any:
        """An argument or a result as the trace holds it."""
        if isinstance(value, str) and value == self._model:
            return Path(value).name
        if isinstance(value, (list, tuple)):
            return [self._traced(item) for item in value]
        return _plain(self._pinned.traced(value))


class Recorder(_Session):
    """The `acl` module, noting every call made through it, and every call looked for and absent."""

    def __init__(self, acl: Any, model: Path):
        super().__init__(model)
        self._acl = acl
        self.calls: list[dict] = []
        self.absent: set[str] = set()

    def _lookup(self, qualified: str) -> Any:
        value = self._acl
        for name in qualified.split(".")[1:]:
            try:
                value = getattr(value, name)
            except AttributeError:
                self.absent.add(qualified)
                raise
        if qualified.count(".") == 1 and qualified[4:] in NAMESPACES:
            return _Namespace(self, qualified)
        if not callable(value):
            return value
        return lambda *args: self._call(qualified, value, args)

    def _call(self, name: str, function, args: tuple) -> Any:
        entry = {"call": name, "args": self._traced(args)}
        self.calls.append(entry)
        try:
            result = function(*args)
        except Exception as error:
            entry["raises"] = [type(error).__name__, str(error)]
            raise
        if name == _PINNED and result[1] == 0:
            entry["result"] = [self._pinned.add(result[0], args[0]), result[1]]
        else:
            entry["result"] = self._traced(result)
        return result


class Replayer(_Session):
    """Stands in for `acl`, answering each call as the trace recorded it (see the module doc)."""

    def __init__(self, trace: dict, model: Path):
        super().__init__(model)
        self._calls, self._absent = trace["calls"], set(trace.get("absent", ()))
        self._buffers: list[bytearray] = []  # the replay's pinned memory, kept alive
        self.served = 0
        self.mismatch: ReplayMismatch | None = None

    def _lookup(self, qualified: str) -> Any:
        if qualified in self._absent:
            raise AttributeError(f"the traced pyACL has no {qualified}")
        if qualified.count(".") == 1 and qualified[4:] in NAMESPACES:
            return _Namespace(self, qualified)
        return lambda *args: self._serve(qualified, args)

    def _serve(self, name: str, args: tuple) -> Any:
        given = self._traced(args)
        if self.served == len(self._calls):
            self._fail(f"{name}({_show(given)}) after the last of the trace's {len(self._calls)} calls")
        recorded = self._calls[self.served]
        if recorded["call"] != name or _json(recorded["args"]) != _json(given):
            self._fail(
                f"call {self.served + 1}: the runtime called {name}({_show(given)}), "
                f"the trace has {recorded['call']}({_show(recorded['args'])})"
            )
        self.served += 1
        if "raises" in recorded:
            kind, message = recorded["raises"]
            error = getattr(builtins, kind, None)
            raise (error if isinstance(error, type) and issubclass(error, Exception) else RuntimeError)(message)
        return self._answer(name, args, recorded["result"])

    def _answer(self, name: str, args: tuple, result: Any) -> Any:
        if name == _PINNED and result[1] == 0:  # real memory of its own, at the trace's address
            size = args[0]
            buffer = bytearray(size + _ALIGNMENT)
            start = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % _ALIGNMENT
            here = ctypes.addressof(ctypes.c_char.from_buffer(buffer, start))
            self._buffers.append(buffer)
            self._pinned.add(here, size, traced=result[0])
            return here, 0
        if name == _VIEW:  # a view of that memory
            described = result["ndarray"]
            dtype = np.dtype(described["dtype"])
            size = int(np.prod(described["shape"], dtype=np.int64)) * dtype.itemsize
            memory = (ctypes.c_char * size).from_address(args[0])
            return np.frombuffer(memory, dtype).reshape(described["shape"])
        return tuple(result) if isinstance(result, list) else result  # several values: a tuple

    def _fail(self, message: str) -> None:
        mismatch = ReplayMismatch(message)
        self.mismatch = self.mismatch or mismatch  # the first: the runtime may swallow what follows
        raise mismatch

    def finish(self) -> None:
        """Raises the first mismatch, or what the trace has that the runtime did not call."""
        if self.mismatch is not None:
            raise self.mismatch
        if self.served < len(self._calls):
            left = self._calls[self.served]
            raise ReplayMismatch(
                f"the runtime made {self.served} of the trace's {len(self._calls)} calls; "
                f"next was {left['call']}({_show(left['args'])})"
            )


def _json(value: Any) -> str:
    """One text for equal recordings: 1, 1.0 and true differ, as they do to PyArg_ParseTuple."""
    return json.dumps(value, sort_keys=True)


def _show(args: Sequence) -> str:
    return ", ".join(json.dumps(arg) for arg in args)


# ---- the session -------------------------------------------------------------------------------


def sample_inputs(runtime: AclRuntime, rows: int | None) -> dict[str, np.ndarray]:
    """Inputs of `rows` batch rows (the exact shapes when not batched): -3..3 repeating."""
    inputs = {}
    for spec in runtime.inputs:
        shape = (rows, *spec.shape[1:]) if rows is not None else spec.shape
        values = np.arange(int(np.prod(shape, dtype=np.int64))) % 7 - 3
        inputs[spec.name] = values.astype(to_numpy(spec.datatype)).reshape(shape)
    return inputs


def exercise(runtime: AclRuntime, runs: Iterable[int | None]) -> list[tuple[dict, dict]]:
    """One batch per entry of `runs` (its rows), then a utilization query: (inputs, outputs) of each."""
    done = []
    for rows in runs:
        inputs = sample_inputs(runtime, rows)
        done.append((inputs, runtime.run(inputs, [])))
    runtime.utilization()
    return done


def _session(acl: Any, model: Path, config: mc.ModelConfig, device_id: int, runs: Sequence[int | None] | None):
    """Load, run, close and (if this session initialised ACL) finalize, as a process does at exit."""
    runtime = None
    try:
        runtime = AclRuntime(model, device_id, config, acl=acl)
        runs = list(runs) if runs is not None else list(runtime.batch_sizes or [None])
        return runtime, runs, exercise(runtime, runs)
    finally:
        if runtime is not None:
            runtime.close()
        PROCESS_ACL.finalize(acl)


def record(acl: Any, model: Path, config: mc.ModelConfig, device_id: int = 0, runs=None) -> tuple[dict, list]:
    """A trace of one session of `model` through `acl`, and what its batches returned. A session
    that fails raises its error with the trace as its `trace` attribute, the error in it."""
    recorder = Recorder(acl, model)
    trace = {
        "format": FORMAT,
        "host": {},  # the recording machine, as its recorder describes it
        "model": {},
        "config": text_format.MessageToString(config),
        "device_id": device_id,
        "runs": runs,
        "absent": [],
        "calls": recorder.calls,
    }
    try:
        _, trace["runs"], done = _session(recorder, Path(model), config, device_id, runs)
    except Exception as error:
        trace["error"] = _error(error)
        error.trace = trace
        raise
    finally:
        trace["model"] = describe(Path(model).name, recorder.calls)
        trace["absent"] = sorted(recorder.absent)
    return trace, done


def replay(trace: dict, model: Path) -> AclRuntime | None:
    """The trace's session once more, with its answers; raises ReplayMismatch where the runtime
    departs from it, and the session's error unless it is the one the trace recorded (then None).
    `model` must exist (the runtime checks); its content is never read."""
    if trace.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} trace: {trace.get('format')!r}")
    replayer = Replayer(trace, model)
    config = text_format.Parse(trace["config"], mc.ModelConfig())
    try:
        runtime, _, _ = _session(replayer, Path(model), config, trace["device_id"], trace["runs"])
    except Exception as error:
        replayer.finish()  # the first call that differs explains a failure better than the failure
        if _error(error) != trace.get("error"):
            raise
        return None
    replayer.finish()
    if "error" in trace:
        raise ReplayMismatch(f"the recorded session failed ({trace['error']}), the replayed one did not")
    return runtime


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def describe(file: str, calls: Sequence[dict]) -> dict:
    """The model as its description queries answered: each input and output (name, dims, ACL data
    type, size in bytes), the dynamic batch gears and the gear input ATC adds for them."""

    def answer(call: str, *args):
        for entry in calls:
            if entry["call"] == call and entry["args"][1:] == list(args) and "result" in entry:
                return entry["result"]
        return None

    def tensors(kind: str) -> list[dict]:
        described = []
        for index in range(answer(f"acl.mdl.get_num_{kind}s") or 0):
            dims = answer(f"acl.mdl.get_{kind}_dims", index)
            entry = {
                "name": answer(f"acl.mdl.get_{kind}_name_by_index", index),
                "dims": dims[0].get("dims") if dims else None,
                "data_type": answer(f"acl.mdl.get_{kind}_data_type", index),
                "size": answer(f"acl.mdl.get_{kind}_size_by_index", index),
            }
            described.append({key: value for key, value in entry.items() if value is not None})
        return described

    batch = answer("acl.mdl.get_dynamic_batch")
    gears = batch[0]["batch"][: batch[0]["batchCount"]] if batch and batch[1] == 0 else []
    model = {"file": file, "inputs": tensors("input"), "outputs": tensors("output"), "gears": gears}
    found = answer("acl.mdl.get_input_index_by_name", DYNAMIC_BATCH_INPUT)
    if gears and found and found[1] == 0:
        model["gear_input"] = {"index": found[0], "size": answer("acl.mdl.get_input_size_by_index", found[0])}
        model["inputs"][found[0]] = {"name": DYNAMIC_BATCH_INPUT, **model["inputs"][found[0]]}
    return model


def dump(trace: dict) -> str:
    """The trace as JSON text, one call a line (a new trace of the same session diffs call by call)."""
    head = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in trace.items() if key != "calls"]
    calls = ",\n".join(f"    {json.dumps(call)}" for call in trace["calls"])
    return "{\n" + ",\n".join(head) + ',\n  "calls": [\n' + calls + "\n  ]\n}\n"


# ---- on an Ascend host -------------------------------------------------------------------------

#: tests/data/acl_traces/ of a clone, where the replay test finds traces.
TRACES = Path(__file__).resolve().parents[3] / "tests" / "data" / "acl_traces"
CHECK_GEARS = "1,2,4"


class HostCheckFailed(Exception):
    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.fix = fix


def host_check(workdir: Path, device: int, trace: Path | None, timeout: float, environment: dict) -> str:
    """`make check-ascend`'s check of an ATC-built .om through pyACL: `check` in a process of its own,
    as ACL initialises once per process. What it found, or HostCheckFailed with the fix."""
    command = [sys.executable, "-m", __name__, "check", str(workdir / "check.onnx"), *([str(trace)] if trace else [])]
    done = subprocess.run(command + ["--device", str(device)], capture_output=True, text=True, env=environment,
                          timeout=timeout)
    try:
        result = json.loads(done.stdout.splitlines()[-1])
    except (IndexError, ValueError):
        raise HostCheckFailed(f"the .om check crashed (exit {done.returncode}): {done.stderr.strip()[-2000:]}",
                              "see pyACL's and CANN's messages above; CANN's own logs are in ~/ascend/log") from None
    if "error" in result:
        raise HostCheckFailed(result["error"], result["fix"])
    where = "" if Path(result["trace"]).parent == TRACES else ", copy it into tests/data/acl_traces/ of a clone"
    return (f"ATC compiled the Relu model for {result['soc']} with gears {CHECK_GEARS}, the acl runtime ran each"
            f" gear correctly, and its {result['calls']} pyACL calls are in {result['trace']}: a regression test"
            f" once it is in the project (docs/operating.md, \"pyACL traces\"){where}")


def _check(onnx: Path, device: int, trace: Path | None) -> dict:
    """Run as `check`: compile, load, run and record; what was found, or the error and its fix."""
    from .. import compile_cache
    from ...errors import DeviceError, ModelLoadError

    try:
        import acl
    except ImportError as error:
        return {"error": f"import acl failed: {error}", "fix": "source the CANN toolkit's set_env.sh"}
    soc = acl.get_soc_name()  # needs no acl.init (hicann/runtime example/tools/get_soc_version)
    if not soc:
        return {"error": "acl.get_soc_name() named no chip", "fix": "check the NPU driver with `npu-smi info`"}
    atc = shutil.which("atc")
    if atc is None:
        return {"error": "ATC (`atc`) is not on PATH", "fix": "the CANN toolkit's set_env.sh puts its bin/ on PATH"}
    om = onnx.with_suffix(".om")
    compiled = subprocess.run(  # in the model's directory: ATC writes its working files where it runs
        [atc, f"--model={onnx}", "--framework=5", f"--output={om.with_suffix('')}", f"--soc_version={soc}",
         "--input_shape=x:-1,4", f"--dynamic_batch_size={CHECK_GEARS}"],
        capture_output=True, text=True, cwd=onnx.parent,
    )
    if compiled.returncode != 0 or not om.exists():
        return {"error": f"ATC failed (exit {compiled.returncode}): {(compiled.stdout + compiled.stderr).strip()[-2000:]}",
                "fix": "see ATC's message; CANN's logs are in ~/ascend/log"}
    version = compile_cache.cann_version()
    if trace is None:
        folder = TRACES if os.access(TRACES, os.W_OK) else Path(tempfile.gettempdir())
        trace = folder / f"{soc}-cann{version or 'unknown'}.json"
    config = check_config()
    host = {"soc": soc, "cann": version, "acl": getattr(acl, "__file__", None), "machine": platform.machine()}
    try:
        written, done = record(acl, om, config, device)
    except (DeviceError, ModelLoadError) as error:
        _write(error.trace, host, trace)
        return {"error": f"the acl runtime could not load or run the ATC-built model: {error} (its calls: {trace})",
                "fix": "look the return code up in CANN's acl_base.h / rt_error_codes.h; CANN's logs are in ~/ascend/log"}
    _write(written, host, trace)
    for inputs, outputs in done:
        if not np.array_equal(outputs["y"], np.maximum(inputs["x"], 0)):
            return {"error": f"Relu({inputs['x'].tolist()}) on the NPU gave {outputs['y'].tolist()} (its calls: {trace})",
                    "fix": "report it with the trace: the model ran but computed something else"}
    return {"trace": str(trace), "soc": soc, "calls": len(written["calls"])}


def check_config() -> mc.ModelConfig:
    """The config `check` serves its model with: the output by the Relu model's name, y."""
    return mc.ModelConfig(name="check", output=[mc.ModelOutput(name="y")])


def _write(trace: dict, host: dict, path: Path) -> None:
    trace["host"].update(host)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(trace))


def _record(model: Path, trace: Path, device: int, config: Path | None) -> None:
    """Run as `record`: one session of `model` through the `acl` on the path."""
    import acl

    parsed = text_format.Parse(config.read_text(), mc.ModelConfig()) if config else mc.ModelConfig()
    written, _ = record(acl, model, parsed, device)
    _write(written, {"acl": getattr(acl, "__file__", None), "machine": platform.machine()}, trace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="one session of any .om through the acl on the path")
    recording.add_argument("model", type=Path)
    recording.add_argument("trace", type=Path)
    recording.add_argument("--config", type=Path, help="its config.pbtxt (output names, execution_timeout_ms)")
    checking = commands.add_parser("check", help="make check-ascend's check 7 (see the module doc)")
    checking.add_argument("onnx", type=Path)
    checking.add_argument("trace", type=Path, nargs="?")
    for command in (recording, checking):
        command.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    if args.command == "record":
        _record(args.model, args.trace, args.device, args.config)
    else:
        print(json.dumps(_check(args.onnx.absolute(), args.device, args.trace and args.trace.absolute())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The pyACL runtime: a CANN `.om` model (built by ATC) on one Ascend NPU.

Written against the real pyACL API, the `acl` Python module of the CANN toolkit, with the
calling conventions of CANN's own Python samples:

* a call that produces something returns `(value, ret)`: `acl.rt.create_context`,
  `acl.rt.create_stream`, `acl.rt.malloc`, `acl.rt.malloc_host`, `acl.mdl.load_from_file`,
  `acl.mdl.get_input_dims`, `acl.mdl.get_dynamic_batch`, `acl.mdl.get_input_index_by_name`,
  `acl.mdl.add_dataset_buffer`;
* a call that only acts returns a bare `ret` (0 is success);
* constructors of host-side structures return a bare handle, 0 when they fail
  (`acl.mdl.create_desc`, `acl.mdl.create_dataset`, `acl.create_data_buffer`), and queries of
  a model description return a bare value (counts, sizes, names, data types).

Everything the device needs is made once at load (device buffers, pinned host staging buffers,
data buffers, datasets), so `run` only queues its copies and the execution on the instance's
stream and waits once, with a timeout, for all of them.
"""

from __future__ import annotations

import ctypes
import logging
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ...config import execution_timeout_s
from ...datatypes import from_numpy, to_numpy
from ...errors import DeviceError, InvalidInput, ModelLoadError, ModelNotReady
from ..memory_meter import read_mem_info
from .acl_process import ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, ACL_SUCCESS, PROCESS_ACL, check, import_acl, recent_error
from .base import Runtime, TensorSpec

log = logging.getLogger(__name__)

ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
INT32_MAX = 2**31 - 1

#: The extra model input ATC adds for --dynamic_batch_size; set_dynamic_batch_size fills it.
DYNAMIC_BATCH_INPUT = "ascend_mbatch_shape_data"

#: aclDataType -> OIP datatype (acl_base.h; ACL_STRING and the complex/4-bit types have no
#: fixed-size numpy equivalent here).
ACL_DATATYPES = {
    0: "FP32",  # ACL_FLOAT
    1: "FP16",  # ACL_FLOAT16
    2: "INT8",
    3: "INT32",
    4: "UINT8",
    6: "INT16",
    7: "UINT16",
    8: "UINT32",
    9: "INT64",
    10: "UINT64",
    11: "FP64",  # ACL_DOUBLE
    12: "BOOL",
}

# DeviceError wants a return code; constructors that fail return a null handle instead.
_NULL_HANDLE = -1


def _host_view(acl: Any, address: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A writable numpy array over `address`'s host memory, no copy.

    pyACL's acl.util.ptr_to_numpy does it, but says on each call that it "will be deprecated" in
    favour of ptr_to_bytes (util/numpy_convert.cpp), which copies into an immutable `bytes`
    (util/bytes_convert.cpp) and so can stage neither inputs nor outputs in place. Where it is gone,
    ctypes makes the same view of the address.
    """
    to_numpy = getattr(acl.util, "ptr_to_numpy", None)
    if to_numpy is not None:
        with warnings.catch_warnings():  # "will be deprecated", on each call; one per buffer
            warnings.simplefilter("ignore")
            return to_numpy(address, shape, dtype.num)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.frombuffer((ctypes.c_char * size).from_address(address), dtype).reshape(shape)


def _datatype_of(value: Any) -> str:
    try:
        return from_numpy(value.dtype)
    except (AttributeError, KeyError):
        return str(getattr(value, "dtype", type(value).__name__))


def _onnx_name(name: str) -> str:
    """The ONNX output name in an ATC output name `<operator>:<edge>:<name>`; else the name itself."""
    parts = name.rsplit(":", 2)
    return parts[2] if len(parts) == 3 and parts[1].isdigit() else name


def _network_index(name: str) -> int | None:
    """The network output index in an Ascend Graph API output name `output_<i>_<operator>_<edge>`."""
    found = re.fullmatch(r"output_(\d+)_.+_\d+", name)
    return int(found[1]) if found else None


def served_output_names(file_names: Sequence[str], config_names: Sequence[str]) -> list[str]:
    """The name each output of an `.om` file is served under.

    aclmdlGetOutputNameByIndex names the outputs of a model ATC converted from ONNX
    `<operator>:<edge>:<output name>`, or `<operator>:<edge>` when the conversion named output
    nodes, and those of a model built with the Ascend Graph API `output_<network output
    index>_<operator>_<edge>` (CANN 8.0 API reference, aclmdlGetOutputNameByIndex:
    hiascend.com/document/detail/zh/CANNCommunityEdition/80RC3alpha003/apiref/appdevgapi/aclcppdevg_03_1457.html);
    inputs keep their names. So a file output is the config's output of the same name, else of
    the name after its last ':'; when none matches either way and the config names as many
    outputs as the file has, they pair in order (a config lists them in the network's order), by
    the index a Graph API name carries where every name carries one. A config that names no
    outputs gets the ONNX names. An output no rule names keeps its file name, for the config
    check to refuse. (The names are the real ones however long: aclmdlGetOutputDims would rename
    one over 127 characters, acl_modelId_<id>_output_<i>, which changes with the load order.)
    """
    wanted = set(config_names)
    matched = [name if name in wanted else _onnx_name(name) if _onnx_name(name) in wanted else None
               for name in file_names]
    if config_names and not any(matched) and len(config_names) == len(file_names):
        order = [_network_index(name) for name in file_names]
        if None not in order and sorted(order) == list(range(len(order))):
            return [config_names[i] for i in order]
        return list(config_names)
    if not config_names:
        matched = [_onnx_name(name) for name in file_names]
    names = [served or name for served, name in zip(matched, file_names)]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ModelLoadError(f"several outputs of the model file answer to {twice}: {list(file_names)}")
    return names


@dataclass
class _Tensor:
    """One model input or output, with its buffers made once at load and reused by every run."""

    spec: TensorSpec
    dtype: np.dtype
    size: int  # bytes, as the model reports them (for the largest gear)
    rows: int  # batch rows `size` holds; 0 when the tensor has no batch dimension
    device: int = 0  # acl.rt.malloc pointer
    data_buffer: int = 0  # acl.create_data_buffer handle over `device`
    host_ptr: int = 0  # acl.rt.malloc_host pointer, `size` bytes of pinned memory
    host: np.ndarray | None = None  # a numpy view of host_ptr's memory

    @property
    def row_bytes(self) -> int:
        return self.size // self.rows if self.rows else self.size

    def nbytes(self, rows: int | None) -> int:
        """Bytes that `rows` batch rows take (the whole tensor when it is not batched)."""
        return self.row_bytes * rows if self.rows and rows is not None else self.size


class AclRuntime(Runtime):
    """A CANN offline model (.om) loaded with pyACL on one device."""

    name = "acl"

    def __init__(self, path: Path, device_id: int, config: mc.ModelConfig, acl: Any = None):
        super().__init__(Path(path), device_id, config)
        if not self.path.is_file():
            raise ModelLoadError(f"OM model file {self.path} not found")
        # aclrtSynchronizeStreamWithTimeout takes whole milliseconds, -1 or more than 0, as a C int
        # (pyACL parses it with "i": a larger number is a TypeError); 24.8 days is as good as for ever.
        self._timeout_ms = min(INT32_MAX, max(1, round(execution_timeout_s(config) * 1000)))
        self._acl = acl if acl is not None else import_acl()
        self._joined = False  # holds a reference on the process-wide ACL
        self._device_set = False
        self._context = 0
        self._stream = 0
        self._model_id: int | None = None
        self._desc = 0
        self._input_dataset = 0
        self._output_dataset = 0
        self._slots: list[_Tensor] = []  # every model input in model (= dataset) order, gear input too
        self._inputs: list[_Tensor] = []
        self._outputs: list[_Tensor] = []
        self._gears: tuple[int, ...] = ()  # dynamic batch gears, ascending
        self._gear_index: int | None = None  # index of DYNAMIC_BATCH_INPUT
        self._batch_sizes: tuple[int, ...] = ()  # batches one execute takes (gears or static)
        self._fault: DeviceError | None = None  # what made the context unusable
        self._closed = False
        #: Device bytes the load took: the device's free memory before and after it (None if pyACL cannot tell).
        self.memory_bytes: int | None = None
        try:
            self._load()
        except BaseException:
            self._release(raise_errors=False)
            raise

    # ---- loading -------------------------------------------------------------------------

    def _load(self) -> None:
        acl = self._acl
        PROCESS_ACL.join(acl, self.device_id)
        self._joined = True
        self._call("acl.rt.set_device", acl.rt.set_device(self.device_id))
        self._device_set = True
        # Device -> Context -> Stream, the order CANN's resource guide prescribes.
        self._context = self._value("acl.rt.create_context", acl.rt.create_context(self.device_id))
        self._stream = self._value("acl.rt.create_stream", acl.rt.create_stream())
        before = read_mem_info(acl)
        self._model_id = self._value(
            "acl.mdl.load_from_file", acl.mdl.load_from_file(str(self.path))
        )
        self._desc = self._handle("acl.mdl.create_desc", acl.mdl.create_desc())
        self._call("acl.mdl.get_desc", acl.mdl.get_desc(self._desc, self._model_id))
        self._read_gears()
        self._read_tensors()
        self._choose_batching()
        names = served_output_names([t.spec.name for t in self._outputs], [o.name for o in self.config.output])
        for tensor, name in zip(self._outputs, names):
            tensor.spec = replace(tensor.spec, name=name)
        self._allocate()
        after = read_mem_info(acl)
        if before is not None and after is not None:
            self.memory_bytes = max(0, before[0] - after[0])

    @staticmethod
    def query_size(path: Path, device_id: int) -> int | None:
        """What the model will take on the device before it is loaded: `acl.mdl.query_size(path)` returns
        `(work_size, weight_size, ret)` (CANN's pyACL reference, acl.mdl.query_size), the memory its execution
        and its weights need; its inputs and outputs come on top. None where it cannot tell."""
        acl = import_acl()
        PROCESS_ACL.join(acl, device_id)  # acl.init first
        try:
            query = getattr(acl.mdl, "query_size", None)
            if query is None:
                return None
            work, weight, ret = query(str(path))
            return work + weight if ret == ACL_SUCCESS else None
        finally:
            PROCESS_ACL.leave(acl)

    def _read_gears(self) -> None:
        batch = self._value(
            "acl.mdl.get_dynamic_batch", self._acl.mdl.get_dynamic_batch(self._desc)
        )
        gears = sorted(int(gear) for gear in batch["batch"][: batch["batchCount"]])
        if not gears:
            return
        self._gears = tuple(gears)
        self._gear_index = self._value(
            "acl.mdl.get_input_index_by_name",
            self._acl.mdl.get_input_index_by_name(self._desc, DYNAMIC_BATCH_INPUT),
        )

    def _read_tensors(self) -> None:
        mdl = self._acl.mdl
        for index in range(mdl.get_num_inputs(self._desc)):
            if index == self._gear_index:
                size = mdl.get_input_size_by_index(self._desc, index)
                self._slots.append(self._gear_tensor(size))
                continue
            tensor = self._tensor(
                mdl.get_input_name_by_index(self._desc, index),
                self._value("acl.mdl.get_input_dims", mdl.get_input_dims(self._desc, index)),
                mdl.get_input_data_type(self._desc, index),
                mdl.get_input_size_by_index(self._desc, index),
            )
            self._slots.append(tensor)
            self._inputs.append(tensor)
        for index in range(mdl.get_num_outputs(self._desc)):
            self._outputs.append(
                self._tensor(
                    mdl.get_output_name_by_index(self._desc, index),
                    self._value("acl.mdl.get_output_dims", mdl.get_output_dims(self._desc, index)),
                    mdl.get_output_data_type(self._desc, index),
                    mdl.get_output_size_by_index(self._desc, index),
                )
            )

    def _gear_tensor(self, size: int) -> _Tensor:
        if size <= 0:
            raise ModelLoadError(f"{self.path}: input {DYNAMIC_BATCH_INPUT} reports size {size}")
        spec = TensorSpec(DYNAMIC_BATCH_INPUT, "UINT8", (size,))
        return _Tensor(spec, np.dtype(np.uint8), size, rows=0)

    def _tensor(self, name: str, dims: Mapping, acl_type: int, size: int) -> _Tensor:
        """A tensor from what the model description reports, or ModelLoadError if unusable."""
        where = f"{self.path}: tensor {name!r}"
        if acl_type not in ACL_DATATYPES:
            raise ModelLoadError(f"{where}: ACL data type {acl_type} is not supported")
        datatype = ACL_DATATYPES[acl_type]
        shape = [int(d) for d in dims["dims"][: dims.get("dimCount", len(dims["dims"]))]]
        if self._gears and shape:
            # Dynamic batch: inputs report -1 for the batch, outputs the largest gear.
            if shape[0] not in (-1, self._gears[-1]):
                raise ModelLoadError(f"{where}: batch dimension {shape[0]} is not a gear")
            shape[0] = self._gears[-1]
        if any(d < 0 for d in shape):
            raise ModelLoadError(
                f"{where}: dynamic dimensions {shape} are not supported; compile the model with "
                "fixed shapes or ATC --dynamic_batch_size gears"
            )
        dtype = to_numpy(datatype)
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if size != expected or size == 0:
            raise ModelLoadError(
                f"{where}: the model reports {size} bytes, but {datatype}{shape} takes {expected} "
                "(inputs preprocessed on the device, such as AIPP, are not supported)"
            )
        return _Tensor(TensorSpec(name, datatype, tuple(shape)), dtype, size, rows=0)

    def _choose_batching(self) -> None:
        """Dimension 0 is the batch when gears say so, or when every tensor shares it."""
        tensors = self._inputs + self._outputs
        leading = {t.spec.shape[0] if t.spec.shape else 0 for t in tensors}
        if self._gears:
            if 0 in leading:
                raise ModelLoadError(
                    f"{self.path}: dynamic batch gears, but a tensor has no batch dimension"
                )
            self._batch_sizes = self._gears
        elif len(leading) == 1 and min(leading) > 0:
            self._batch_sizes = (leading.pop(),)
        else:
            return  # not batched: every run takes the exact shapes
        for tensor in tensors:
            tensor.rows = self._batch_sizes[-1]
            tensor.spec = TensorSpec(
                tensor.spec.name, tensor.spec.datatype, (-1, *tensor.spec.shape[1:])
            )

    def _allocate(self) -> None:
        """The buffer pool: device memory, pinned host staging, data buffers and datasets, once."""
        acl = self._acl
        for tensor in self._slots + self._outputs:
            tensor.device = self._value(
                "acl.rt.malloc", acl.rt.malloc(tensor.size, ACL_MEM_MALLOC_HUGE_FIRST)
            )
        for tensor in self._inputs + self._outputs:
            # Pinned memory: what acl.rt.memcpy_async wants on the host side (CANN: other host
            # memory "may cause unpredictable errors"), and it is copied without a bounce.
            tensor.host_ptr = self._value("acl.rt.malloc_host", acl.rt.malloc_host(tensor.size))
            shape = (tensor.rows, *tensor.spec.shape[1:]) if tensor.rows else tensor.spec.shape
            tensor.host = _host_view(acl, tensor.host_ptr, tuple(shape), tensor.dtype)
        self._input_dataset = self._handle("acl.mdl.create_dataset", acl.mdl.create_dataset())
        self._fill(self._input_dataset, self._slots)
        self._output_dataset = self._handle("acl.mdl.create_dataset", acl.mdl.create_dataset())
        self._fill(self._output_dataset, self._outputs)

    def _fill(self, dataset: int, tensors: list[_Tensor]) -> None:
        """One aclDataBuffer per tensor, over its device buffer, in model order."""
        for tensor in tensors:
            tensor.data_buffer = self._handle(
                "acl.create_data_buffer", self._acl.create_data_buffer(tensor.device, tensor.size)
            )
            self._value(
                "acl.mdl.add_dataset_buffer",
                self._acl.mdl.add_dataset_buffer(dataset, tensor.data_buffer),
            )

    # ---- the Runtime interface -----------------------------------------------------------

    @property
    def inputs(self) -> Sequence[TensorSpec]:
        return tuple(t.spec for t in self._inputs)

    @property
    def outputs(self) -> Sequence[TensorSpec]:
        return tuple(t.spec for t in self._outputs)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self._batch_sizes

    @property
    def info(self) -> Mapping[str, str]:
        return {
            **super().info,
            "gears": ",".join(map(str, self._gears)) or "static",
            "max_batch_size": str(self.max_batch_size),
        }

    def utilization(self) -> float | None:
        """AI Core utilization: the busier of its Cube and Vector units, per pyACL.

        `acl.rt.get_device_utilization_rate(device_id)` returns `(info, ret)`, `info` a dict of
        percentages (`cube_utilization`, `vector_utilization`, `aicpu_utilization`,
        `memory_utilization`); a unit the chip lacks reads -1 (Atlas 300 inference
        cards have no Vector).
        It names the device, not a context, so any thread may ask.
        """
        query = getattr(self._acl.rt, "get_device_utilization_rate", None)
        if self._closed or query is None:  # unloaded, or a pyACL that predates the call
            return None
        info, ret = query(self.device_id)
        if ret != ACL_SUCCESS:
            return None
        rates = [info.get(unit, -1) for unit in ("cube_utilization", "vector_utilization")]
        busiest = max(rates)
        return float(busiest) if busiest >= 0 else None

    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        if self._closed:
            raise ModelNotReady(f"{self.path} has been unloaded")
        if self._fault is not None:
            raise DeviceError(
                self._fault.call, self._fault.ret,
                f"{self.path.name} on device {self.device_id} is out of service since this failure; "
                "reload the model", fatal=True,
            )
        wanted = self._wanted_outputs(output_names)
        rows = self._batch_of(inputs)
        try:
            self._execute(inputs, wanted, rows)
        except DeviceError as error:
            if error.fatal:
                self._fault = error
            else:
                self._drain()
            raise
        return {t.spec.name: (t.host[:rows] if rows is not None else t.host).copy() for t in wanted}

    def _execute(self, inputs: Mapping[str, np.ndarray], wanted: list[_Tensor], rows: int | None) -> None:
        """Stages the inputs, queues H2D copies, the execution and D2H copies, waits once."""
        acl = self._acl
        # ACL contexts are bound to threads: make ours current in whichever thread runs.
        self._call("acl.rt.set_context", acl.rt.set_context(self._context))
        for tensor in self._inputs:
            if rows is None:
                tensor.host[...] = inputs[tensor.spec.name]
            else:
                tensor.host[:rows] = inputs[tensor.spec.name]
            self._copy(tensor.device, tensor.size, tensor.host_ptr, tensor.nbytes(rows), ACL_MEMCPY_HOST_TO_DEVICE)
        if self._gears:
            self._call(
                "acl.mdl.set_dynamic_batch_size",
                acl.mdl.set_dynamic_batch_size(self._model_id, self._input_dataset, self._gear_index, rows),
            )
        self._call(
            "acl.mdl.execute_async",
            acl.mdl.execute_async(self._model_id, self._input_dataset, self._output_dataset, self._stream),
        )
        for tensor in wanted:
            self._copy(tensor.host_ptr, tensor.size, tensor.device, tensor.nbytes(rows), ACL_MEMCPY_DEVICE_TO_HOST)
        self._synchronize()

    def _copy(self, dst: int, dest_max: int, src: int, count: int, kind: int) -> None:
        self._call(
            "acl.rt.memcpy_async", self._acl.rt.memcpy_async(dst, dest_max, src, count, kind, self._stream)
        )

    def _synchronize(self) -> None:
        """Waits for the stream; a batch that outlives execution_timeout_ms means a hung device."""
        rt = self._acl.rt
        sync = getattr(rt, "synchronize_stream_with_timeout", None)
        if sync is None:  # a pyACL older than the call: no timeout, a hung device blocks this instance
            self._call("acl.rt.synchronize_stream", rt.synchronize_stream(self._stream))
            return
        ret = sync(self._stream, self._timeout_ms)
        if ret == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
            raise DeviceError(
                "acl.rt.synchronize_stream_with_timeout", ret,
                f"the batch did not finish within execution_timeout_ms={self._timeout_ms}", fatal=True,
            )
        self._call("acl.rt.synchronize_stream_with_timeout", ret)

    def _drain(self) -> None:
        """After a failed batch: lets what it queued finish, so the next batch starts on an empty stream."""
        try:
            self._synchronize()
        except DeviceError as error:
            if error.fatal:
                self._fault = error

    def _wanted_outputs(self, names: Sequence[str]) -> list[_Tensor]:
        if not names:
            return list(self._outputs)
        by_name = {t.spec.name: t for t in self._outputs}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise InvalidInput(
                f"unknown output(s) {', '.join(unknown)}; the model has {', '.join(by_name)}"
            )
        return [by_name[n] for n in names]

    def _batch_of(self, inputs: Mapping[str, np.ndarray]) -> int | None:
        """Checks every input against the model; the common batch, None if not batched."""
        names = {t.spec.name for t in self._inputs}
        if set(inputs) != names:
            missing, extra = names - set(inputs), set(inputs) - names
            raise InvalidInput(
                "inputs do not match the model"
                + (f"; missing {', '.join(sorted(missing))}" if missing else "")
                + (f"; unknown {', '.join(sorted(extra))}" if extra else "")
            )
        batches = {self._checked_rows(t, inputs[t.spec.name]) for t in self._inputs}
        if len(batches) > 1:
            raise InvalidInput(f"inputs have different batch sizes {sorted(batches)}")
        rows = batches.pop() if batches else None
        if rows is not None and rows not in self._batch_sizes:
            # The Instance pads a batch to the next of these sizes and splits larger ones.
            raise ValueError(
                f"{self.path.name} runs batches of {','.join(map(str, self._batch_sizes))} rows only, "
                f"not {rows}"
            )
        return rows

    @staticmethod
    def _checked_rows(tensor: _Tensor, array: np.ndarray) -> int | None:
        spec = tensor.spec
        if not isinstance(array, np.ndarray) or array.dtype != tensor.dtype:
            raise InvalidInput(
                f"input {spec.name}: datatype {_datatype_of(array)} does not match "
                f"the model's {spec.datatype}"
            )
        fixed = spec.shape[1:] if tensor.rows else spec.shape
        actual = array.shape[1:] if tensor.rows else array.shape
        if array.ndim != len(spec.shape) or actual != fixed:
            raise InvalidInput(
                f"input {spec.name}: shape {list(array.shape)} does not match {list(spec.shape)}"
            )
        return array.shape[0] if tensor.rows else None

    def close(self) -> None:
        if not self._closed:
            self._release(raise_errors=True)

    # ---- teardown ------------------------------------------------------------------------

    def _release(self, raise_errors: bool) -> None:
        """Frees whatever was acquired, in reverse order; every step runs even if one fails."""
        self._closed = True
        acl = self._acl
        errors: list[DeviceError] = []

        def attempt(call: str, action) -> None:
            try:
                check(acl, call, action())
            except DeviceError as error:
                errors.append(error)

        if self._context:
            attempt("acl.rt.set_context", lambda: acl.rt.set_context(self._context))
        force = getattr(acl.rt, "destroy_stream_force", None)
        if self._stream and self._fault is not None and force is not None:
            # A task may be stuck on the stream for good: drop it rather than wait for it.
            attempt("acl.rt.destroy_stream_force", lambda: force(self._stream))
            self._stream = 0
        for tensor in self._slots + self._outputs:
            if tensor.data_buffer:
                attempt(
                    "acl.destroy_data_buffer",
                    lambda t=tensor: acl.destroy_data_buffer(t.data_buffer),
                )
                tensor.data_buffer = 0
        for dataset in (self._input_dataset, self._output_dataset):
            if dataset:
                attempt("acl.mdl.destroy_dataset", lambda d=dataset: acl.mdl.destroy_dataset(d))
        self._input_dataset = self._output_dataset = 0
        for tensor in self._slots + self._outputs:
            if tensor.device:
                attempt("acl.rt.free", lambda t=tensor: acl.rt.free(t.device))
                tensor.device = 0
            tensor.host = None  # the view must not outlive the memory
            if tensor.host_ptr:
                attempt("acl.rt.free_host", lambda t=tensor: acl.rt.free_host(t.host_ptr))
                tensor.host_ptr = 0
        if self._model_id is not None:
            attempt("acl.mdl.unload", lambda: acl.mdl.unload(self._model_id))
            self._model_id = None
        if self._desc:
            attempt("acl.mdl.destroy_desc", lambda: acl.mdl.destroy_desc(self._desc))
            self._desc = 0
        if self._stream:
            attempt("acl.rt.destroy_stream", lambda: acl.rt.destroy_stream(self._stream))
            self._stream = 0
        if self._context:
            attempt("acl.rt.destroy_context", lambda: acl.rt.destroy_context(self._context))
            self._context = 0
        if self._device_set:
            attempt("acl.rt.reset_device", lambda: acl.rt.reset_device(self.device_id))
            self._device_set = False
        if self._joined:
            self._joined = False
            PROCESS_ACL.leave(acl)
        for error in errors:
            log.warning("releasing %s: %s", self.path, error)
        if errors and raise_errors:
            raise errors[0]

    # ---- return conventions --------------------------------------------------------------

    def _call(self, call: str, ret: int) -> None:
        check(self._acl, call, ret)

    def _value(self, call: str, result: tuple[Any, int]) -> Any:
        value, ret = result
        check(self._acl, call, ret)
        return value

    def _handle(self, call: str, handle: int) -> int:
        if not handle:
            raise DeviceError(
                call, _NULL_HANDLE, recent_error(self._acl) or "returned a null handle"
            )
        return handle

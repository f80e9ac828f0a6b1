"""FAKE pyACL, FOR TESTS ONLY. This is not Huawei's `acl` module and drives no device.

It stands in for the `acl` Python module of the CANN toolkit so that code written against the
real pyACL API can be tested on any machine: pass this module as `AclRuntime(..., acl=...)`,
or put `tests/fake_acl` on PYTHONPATH so that `import acl` finds it (it never claims to be
real: `FAKE is True`, and every helper meant for tests starts with `fake_`).

What it mimics of the real API (the shapes the CANN samples rely on):
  * every call is held to its C wrapper in pyACL's source, the table PYACL (hicann/runtime
    python/pyACL/: the PyArg_ParseTuple format of its arguments, the Py_BuildValue format of its
    result): arity, int32 `i`, unsigned `k`/`K`/`I` as C converts them, a tuple where the wrapper
    wants one, and the result's shape. Calls that produce something return `(value, ret)`; calls
    that act return a bare `ret`; `acl.mdl.create_desc`, `acl.mdl.create_dataset` and
    `acl.create_data_buffer` return a bare handle (0 on failure); description queries return
    bare values (for a bad index what the C API gives: 0, "", ACL_DT_UNDEFINED);
  * return codes are the real ones (acl_base.h, rt_error_codes.h, ge_error_codes.h);
  * call order: nothing before `acl.init`, a context before device work, contexts bound to
    threads (`acl.rt.set_context`), a model runs only under the context that loaded it;
  * `acl.init` / `acl.finalize` as CANN documents them. `acl.init` twice answers
    ACL_ERROR_REPEAT_INITIALIZE (100002) and ACL stays initialised. By default the older CANN:
    "一个进程内只能调用一次acl.init接口" (pyACL acl.init, CANN 8.0.RC2:
    hiascend.com/document/detail/zh/canncommercial/80RC22/apiref/appdevgapi/aclpythondevg_01_0005.html),
    whose acl.cpp keeps its "initialised" flag after aclFinalize, so an `acl.init` after
    `acl.finalize` answers 100002 and ACL stays down (every later call: 100001). With
    `fake_newer_cann()` (or env FAKE_ACL_NEWER_CANN=1) the newer CANN (hicann/runtime
    docs/03_api_ref/02_初始化与去初始化.md): `acl.init` after `acl.finalize` initialises again, and
    one `acl.finalize` clears every aclInit's reference at once, tearing ACL down under every
    other user in the process. A second `acl.finalize` answers ACL_ERROR_REPEAT_FINALIZE.
    With env FAKE_ACL_LIBRARY=/path/libascendcl.so (the stub tests/cann_stubs/acl_stub.c builds),
    `acl.init` and `acl.finalize` call that library's aclInit and aclFinalize through ctypes and
    ACL is up while the library says so (its test-only `stub_acl_initialized()`): one ACL shared
    with whatever else in the process calls the library, such as ONNX Runtime's CANN execution
    provider, as pyACL and the provider share the real libascendcl.so. The library's rules then
    hold (the stub's are the older CANN's) and `fake_newer_cann()` has no effect;
  * streams run their tasks in order, later: `acl.rt.memcpy_async` and `acl.mdl.execute_async`
    only check their arguments and enqueue (a task's device failure is reported by the next
    synchronize of its stream, hicann/runtime docs/02_dev_guide/09_异常处理.md);
    `acl.rt.synchronize_stream[_with_timeout]` runs them; `acl.rt.destroy_stream` waits for
    them, `acl.rt.destroy_stream_force` drops them (docs/03_api_ref/06_Stream管理.md);
    `acl.rt.memcpy_async` takes host memory only from `acl.rt.malloc_host` (CANN: other host
    memory gives "unpredictable errors"; the fake refuses it) and 64-byte aligned addresses;
  * `acl.rt.synchronize_stream_with_timeout(stream, ms)`: -1 waits for ever, > 0 milliseconds, 0 and
    below -1 are ACL_ERROR_RT_PARAM_INVALID (see the function for the sources);
  * host addresses are real addresses, as pyACL hands them out: `acl.rt.malloc_host` returns
    `(address, ret)` of pinned memory, 64-byte aligned, `acl.util.numpy_to_ptr` and
    `acl.util.bytes_to_ptr` the data's own address; device addresses are fake, above any host
    address. `acl.util.ptr_to_numpy(address, shape_tuple, npy_type)` returns a writable numpy
    array over that memory (no copy), as pyACL's util/numpy_convert.cpp does; it and
    `acl.util.numpy_to_ptr` warn that they "will be deprecated"; `acl.util.bytes_to_ptr`
    accepts only `bytes`. After `acl.rt.free_host` a view of that memory fails on use: writes
    raise, reads give POISON bytes (real pyACL's view points at freed memory);
  * env FAKE_ACL_WITHOUT="acl.util.ptr_to_numpy,...": a pyACL without those calls;
  * device memory: each device has FAKE_ACL_DEVICE_MEMORY_MB of it (default 24576, a 310P's 24 GB;
    `fake_set_device_memory(device_id, total_bytes)` changes it). `acl.rt.malloc` takes from it
    and `acl.rt.free` gives back; `acl.mdl.load_from_file` takes the model's work and weight memory
    (the descriptor's `work_size` and `weight_size`, default 0: counted, not backed by host
    memory) and `acl.mdl.unload` gives it back. Past the total, `acl.rt.malloc` answers
    ACL_ERROR_RT_MEMORY_ALLOCATION (207001, rt_error_codes.h: "only used by out of memory") and
    `acl.mdl.load_from_file` ACL_ERROR_GE_MEMORY_ALLOCATION (245000, hicann/ge
    inc/external/ge/ge_error_codes.h). `acl.rt.get_mem_info(attr)` returns `(free, total, ret)`
    (pyACL rt/rt_memory.cpp WrapAclRtGetMemInfo, Py_BuildValue "kki") of the device the calling
    thread set (acl.rt.set_device) or whose context is current, as aclrtGetMemInfo's constraints
    say (hicann/runtime docs/zh/api_ref/11-01_device_memory_malloc_and_free.md: a device must be
    set first; an attribute the hardware lacks reads 0 and 0, but ACL_HBM_MEM on a chip without
    HBM reads its DDR: the fake's devices answer ACL_DDR_MEM (0) and ACL_HBM_MEM (1) alike);
    `acl.mdl.query_size(path)` returns `(work_size, weight_size, ret)` of a model file (pyACL
    mdl/mdl_wrap.cpp WrapAclMdlQuerySize, "kki"; CANN's pyACL reference, acl.mdl.query_size).

What it adds for tests:
  * `fake_calls()`: every call in order, with its arguments and what it returned;
  * allocation tracking (`fake_mallocs()`, `fake_device_memory()`, `fake_leaks()`);
  * `fake_initialized()`; `fake_external_user(device_id)`: another framework in the process
    calling ACL itself, as ONNX Runtime's CANN execution provider does (see ExternalUser);
  * device utilization (`acl.rt.get_device_utilization_rate`) reads FAKE_UTILIZATION, or
    what `fake_set_utilization(device_id, ...)` set;
  * stricter order checks than the real runtime (destroying a context that still has
    streams, resetting a device that still has contexts): they return
    ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED instead of cleaning up implicitly.

Faults (the control API other tests rely on):
  * `fake_inject(call, ret, times=1, after=0, device=None)`: the call named `call` (e.g.
    "acl.mdl.execute_async") fails with `ret` `times` times, after `after` calls that succeed;
    with `device=N` only calls on device N count (the device of the calling thread's current
    context, or the `device_id` argument of acl.rt.set_device/reset_device/create_context/
    get_device_utilization_rate). A failing call returning `(value, ret)` returns `(0, ret)`,
    one returning a handle returns 0. On the asynchronous calls (`acl.rt.memcpy_async`,
    `acl.mdl.execute_async`) a `ret` of 500000 or more (CANN's codes for failures of the
    device's execution) fails the task instead: the call returns 0 and the next synchronize of
    its stream returns `ret`.
  * `fake_hang(call, device=None)`: the next call named `call` (on device N if given) hangs
    until `fake_release()`. A hung `acl.mdl.execute_async` or `acl.rt.memcpy_async` returns 0 but
    its task never finishes, so its stream is stuck; a hung
    `acl.rt.synchronize_stream_with_timeout` returns ACL_ERROR_RT_STREAM_SYNC_TIMEOUT (507046) and
    its stream is stuck. On a stuck stream `acl.rt.synchronize_stream_with_timeout(stream, ms)`
    returns 507046 at once (the fake does not sleep out the timeout), while
    `acl.rt.synchronize_stream` and `acl.rt.destroy_stream` block until release,
    `acl.rt.destroy_stream_force` drops the stuck tasks, and `acl.mdl.unload` of a model stuck
    in it returns ACL_ERROR_RT_MODEL_RUNNING (107037). Any other hung call blocks until release.
  * A control file, for a fake running inside another process (a server under test): set env
    FAKE_ACL_FAULTS=/path/faults.json. The file is read again whenever its mtime, size or inode
    changes (write it whole: a temporary file renamed over it); it holds a JSON list whose
    entries are each applied once per read:
        {"call": "acl.mdl.execute_async", "ret": 507015, "times": 1, "after": 0, "device": 1}
            -> fake_inject(call, ret, times, after, device) ("times", "after", "device" optional)
        {"call": "acl.mdl.execute_async", "hang": true, "device": 0}
            -> fake_hang(call, device) ("device" optional)
        {"release": true}
            -> fake_release()
    AclRuntime (kserve_ascend/core/execution/runtimes/acl.py) makes, per batch: acl.rt.set_context,
    acl.rt.memcpy_async per input, acl.mdl.set_dynamic_batch_size (gear models),
    acl.mdl.execute_async, acl.rt.memcpy_async per output, and one
    acl.rt.synchronize_stream_with_timeout.
  * An AI Core exception is not modelled as poisoning its context: CANN documents the error
    code (507015, rt_error_codes.h) and that the application usually exits, but not that later
    calls on the context fail unless the stream is in ACL_STOP_ON_FAILURE mode, which nothing
    here sets (aclrtSetStreamFailureMode, docs/03_api_ref/06_Stream管理.md).

A fake `.om` file is a JSON descriptor (see `fake_write_om`): inputs and outputs with names,
ACL data types and dims, and optional dynamic batch gears. "Executing" it copies input i to
output i for the rows of the gear chosen (bytewise, or cast when the output's type differs, as
ATC's --output_type does), so values round-trip; or computes Relu of it (`relu`). Memory is real Python memory: device pointers
are fake integer addresses backed by bytearrays, and host pointers handed out by
numpy_to_ptr/bytes_to_ptr map fake addresses to the array's own memory, so copies really move
data.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import json
import os
import string
import threading
import types
import warnings
import weakref
from collections import Counter, namedtuple
from pathlib import Path

import numpy as np

FAKE = True

# ---- constants of the real API -------------------------------------------------------------

ACL_SUCCESS = ACL_ERROR_NONE = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_UNINITIALIZE = 100001
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_INVALID_MODEL_ID = 100011
ACL_ERROR_PARSE_MODEL = 100013
ACL_ERROR_REPEAT_FINALIZE = 100037
ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED = 148051
ACL_ERROR_BAD_ALLOC = 200000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_GE_MEMORY_ALLOCATION = 245000
ACL_DDR_MEM, ACL_HBM_MEM = 0, 1  # aclrtMemAttr (acl_rt.h)
ACL_ERROR_INTERNAL_ERROR = 500000
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_STREAM_CONTEXT = 107003
ACL_ERROR_RT_MODEL_CONTEXT = 107004
ACL_ERROR_RT_MODEL_RUNNING = 107037
ACL_ERROR_RT_LOST_HEARTBEAT = 507010
ACL_ERROR_RT_MODEL_EXECUTE = 507011
ACL_ERROR_RT_AICORE_TIMEOUT = 507014
ACL_ERROR_RT_AICORE_EXCEPTION = 507015
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046
ACL_ERROR_GE_PARAM_INVALID = 145000
ACL_ERROR_GE_EXEC_MODEL_PATH_INVALID = 145002
ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID = 145006
ACL_ERROR_GE_EXEC_MODEL_ADDR_INVALID = 145007
ACL_ERROR_GE_DYNAMIC_BATCH_SIZE_INVALID = 145013

ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY, ACL_MEM_MALLOC_NORMAL_ONLY = 0, 1, 2
ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE = 0, 1
ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE = 2, 3

ACL_FLOAT, ACL_FLOAT16, ACL_INT8, ACL_INT32, ACL_UINT8 = 0, 1, 2, 3, 4
ACL_INT16, ACL_UINT16, ACL_UINT32, ACL_INT64, ACL_UINT64 = 6, 7, 8, 9, 10
ACL_DOUBLE, ACL_BOOL, ACL_STRING = 11, 12, 13

#: Item size of each aclDataType the fake models can declare (ACL_STRING is refused).
ITEM_SIZES = {0: 4, 1: 2, 2: 1, 3: 4, 4: 1, 6: 2, 7: 2, 8: 4, 9: 8, 10: 8, 11: 8, 12: 1}
#: aclDataType -> numpy, for the cast an output of another type than its input takes.
NUMPY_TYPES = {0: "float32", 1: "float16", 2: "int8", 3: "int32", 4: "uint8", 6: "int16",
               7: "uint16", 8: "uint32", 9: "int64", 10: "uint64", 11: "float64", 12: "bool"}
#: NumPy C-API type numbers (what acl.util.ptr_to_numpy takes) -> dtype.
_NPY_TYPES = {np.dtype(code).num: np.dtype(code) for code in "?bBhHiIlLqQefd"}

DYNAMIC_BATCH_INPUT = "ascend_mbatch_shape_data"
_GEAR_INPUT_SIZE = 8  # the fake stores the gear there as one uint64
_ALIGNMENT = 64  # aclrtMemcpyAsync wants both addresses 64-byte aligned
_DEVICE_FAILURES = 500000  # CANN's rule 4: codes of 5xxxxx are failures inside the device
_ASYNC_CALLS = ("acl.rt.memcpy_async", "acl.mdl.execute_async")  # the stream is their last argument
_DEVICE_ARGUMENT_CALLS = (
    "acl.rt.set_device", "acl.rt.reset_device", "acl.rt.create_context", "acl.rt.get_device_utilization_rate",
)

#: What acl.rt.get_device_utilization_rate reports unless fake_set_utilization says otherwise:
#: an Atlas 300 inference card (no Vector unit, memory rate reserved: both -1) with its Cube 37% busy.
FAKE_UTILIZATION = {
    "cube_utilization": 37,
    "vector_utilization": -1,
    "aicpu_utilization": 0,
    "memory_utilization": -1,
    "utilization_extend": 0,
}

Call = namedtuple("Call", "name args result")

#: The C wrapper behind a pyACL call: `args`, the PyArg_ParseTuple format it parses its arguments
#: with (None: it does not parse them, extra arguments are ignored); `result`, the Py_BuildValue
#: format of what it returns (one unit: a bare value; several: a tuple); `source`, where in
#: hicann/runtime python/pyACL/ (as of commit 134e2ed) the wrapper is; `failed`, what a failing
#: call returns in place of its value (None: its aclError for a bare "i", else 0, or {} for an "O").
Wrapper = namedtuple("Wrapper", "args result source failed", defaults=(None,))

#: Every pyACL call the project makes (kserve_ascend/, tools/), and those the fake adds for tests.
#: `_api` enforces it on every fake call: CPython's own PyArg_ParseTuple parses the arguments with
#: `args`, as the wrapper does (arity, int for "k"/"K" and no numpy integers, the int32 range of "i",
#: unsigned wrap-around of "k"/"K"/"I", str for "s"), and a failed parse raises the TypeError
#: "<call> args parse failed" the wrapper's CHECK_NULL sets (utils_methods.h); the implementation
#: gets the values as C sees them. The result is checked against `result` (tuple shape, C ranges).
PYACL = {
    "acl.init": Wrapper("|s", "i", "py_init_acl.cpp WrapAclInit"),
    "acl.finalize": Wrapper(None, "i", "py_init_acl.cpp WrapAclFinalize"),
    "acl.get_recent_err_msg": Wrapper(None, "s", "py_init_acl.cpp WrapAclGetRecentErrMsg"),
    "acl.get_soc_name": Wrapper(None, "s", "py_init_acl.cpp WrapAclRtGetSocName"),
    "acl.create_data_buffer": Wrapper("kk", "k", "py_init_acl.cpp WrapAclCreateDataBuffer"),
    "acl.destroy_data_buffer": Wrapper("k", "i", "py_init_acl.cpp WrapAclDestroyDataBuffer"),
    "acl.get_data_buffer_addr": Wrapper("k", "k", "py_init_acl.cpp WrapAclGetDataBufferAddr"),
    "acl.get_data_buffer_size_v2": Wrapper("k", "k", "py_init_acl.cpp WrapAclGetDataBufferSizeV2"),
    "acl.rt.set_device": Wrapper("i", "i", "rt/rt_device.cpp WrapAclRtSetDevice"),
    "acl.rt.reset_device": Wrapper("i", "i", "rt/rt_device.cpp WrapAclRtResetDevice"),
    "acl.rt.get_device_count": Wrapper(None, "Ii", "rt/rt_device.cpp WrapAclRtGetDeviceCount"),
    # The dict is built from the zero-initialised aclrtUtilizationInfo whatever the call returned.
    "acl.rt.get_device_utilization_rate": Wrapper(
        "i", "OI", "rt/rt_device.cpp WrapAclRtGetDeviceUtilizationRate",
        {"cube_utilization": 0, "vector_utilization": 0, "aicpu_utilization": 0, "memory_utilization": 0,
         "utilization_extend": 0},
    ),
    "acl.rt.create_context": Wrapper("i", "ki", "rt/rt_context.cpp WrapAclRtCreateContext"),
    "acl.rt.set_context": Wrapper("k", "i", "rt/rt_context.cpp WrapAclRtSetCurrentContext"),
    "acl.rt.destroy_context": Wrapper("k", "i", "rt/rt_context.cpp WrapAclRtDestroyContext"),
    "acl.rt.create_stream": Wrapper(None, "ki", "rt/rt_stream.cpp WrapAclRtCreateStream"),
    "acl.rt.destroy_stream": Wrapper("k", "i", "rt/rt_stream.cpp WrapAclRtDestroyStream"),
    "acl.rt.destroy_stream_force": Wrapper("k", "i", "rt/rt_stream.cpp WrapAclRtDestroyStreamForce"),
    "acl.rt.synchronize_stream": Wrapper("k", "i", "rt/rt_synchronize.cpp WrapAclRtSynchronizeStream"),
    "acl.rt.synchronize_stream_with_timeout": Wrapper(
        "ki", "i", "rt/rt_synchronize.cpp WrapAclRtSynchronizeStreamWithTimeout"
    ),
    "acl.rt.malloc": Wrapper("ki", "ki", "rt/rt_memory.cpp WrapAclRtMalloc"),
    "acl.rt.free": Wrapper("k", "i", "rt/rt_memory.cpp WrapAclRtFree"),
    "acl.rt.malloc_host": Wrapper("k", "ki", "rt/rt_memory.cpp WrapAclRtMallocHost"),
    "acl.rt.free_host": Wrapper("k", "i", "rt/rt_memory.cpp WrapAclRtFreeHost"),
    "acl.rt.memcpy": Wrapper("kkkki", "i", "rt/rt_memory.cpp WrapAclRtMemcpy"),
    "acl.rt.memcpy_async": Wrapper("kkkkik", "i", "rt/rt_memory.cpp WrapAclRtMemcpyAsync"),
    "acl.rt.get_mem_info": Wrapper("i", "kki", "rt/rt_memory.cpp WrapAclRtGetMemInfo"),
    "acl.util.numpy_to_ptr": Wrapper("O", "k", "util/numpy_convert.cpp WrapNumpyToPtr"),
    "acl.util.ptr_to_numpy": Wrapper("kOi", "O", "util/numpy_convert.cpp WrapPtrToNumpy"),
    "acl.util.bytes_to_ptr": Wrapper("O", "k", "util/bytes_convert.cpp WrapBytesToPtr"),
    # Not Py_BuildValue: PyBytes_FromStringAndSize, a copy of the memory.
    "acl.util.ptr_to_bytes": Wrapper("kk", "O", "util/bytes_convert.cpp WrapPtrToBytes"),
    "acl.mdl.load_from_file": Wrapper("s", "Ii", "mdl/mdl_wrap.cpp WrapAclMdlLoadFromFile"),
    "acl.mdl.unload": Wrapper("I", "i", "mdl/mdl_wrap.cpp WrapAclMdlUnload"),
    "acl.mdl.query_size": Wrapper("s", "kki", "mdl/mdl_wrap.cpp WrapAclMdlQuerySize"),
    "acl.mdl.create_desc": Wrapper(None, "k", "mdl/mdl_wrap.cpp WrapAclMdlCreateDesc"),
    "acl.mdl.get_desc": Wrapper("kI", "i", "mdl/mdl_wrap.cpp WrapAclMdlGetDesc"),
    "acl.mdl.destroy_desc": Wrapper("k", "i", "mdl/mdl_wrap.cpp WrapAclMdlDestroyDesc"),
    "acl.mdl.get_num_inputs": Wrapper("k", "k", "mdl/mdl_wrap.cpp WrapAclMdlGetNumInputs"),
    "acl.mdl.get_num_outputs": Wrapper("k", "k", "mdl/mdl_wrap.cpp WrapAclMdlGetNumOutputs"),
    "acl.mdl.get_input_size_by_index": Wrapper("kk", "k", "mdl/mdl_wrap.cpp WrapAclMdlGetInputSizeByIndex"),
    "acl.mdl.get_output_size_by_index": Wrapper("kk", "k", "mdl/mdl_wrap.cpp WrapAclMdlGetOutputSizeByIndex"),
    # A bad index: "" and ACL_DT_UNDEFINED (-1), from aclmdlGetNameByIndex and aclmdlGetDataType in
    # hicann/ge api/acl/acl_model/model/model_om2.cpp.
    "acl.mdl.get_input_name_by_index": Wrapper("kk", "s", "mdl/mdl_wrap.cpp WrapAclMdlGetInputNameByIndex", ""),
    "acl.mdl.get_output_name_by_index": Wrapper("kk", "s", "mdl/mdl_wrap.cpp WrapAclMdlGetOutputNameByIndex", ""),
    "acl.mdl.get_input_data_type": Wrapper("kk", "i", "mdl/mdl_wrap.cpp WrapAclMdlGetInputDataType", -1),
    "acl.mdl.get_output_data_type": Wrapper("kk", "i", "mdl/mdl_wrap.cpp WrapAclMdlGetOutputDataType", -1),
    "acl.mdl.get_input_dims": Wrapper("kk", "Oi", "mdl/mdl_wrap.cpp WrapAclMdlGetInputDims"),
    "acl.mdl.get_output_dims": Wrapper("kk", "Oi", "mdl/mdl_wrap.cpp WrapAclMdlGetOutputDims"),
    "acl.mdl.get_input_index_by_name": Wrapper("ks", "ki", "mdl/mdl_wrap.cpp WrapAclMdlGetInputIndexByName"),
    "acl.mdl.get_dynamic_batch": Wrapper("k", "Oi", "mdl/mdl_wrap.cpp WrapAclMdlGetDynamicBatch"),
    "acl.mdl.create_dataset": Wrapper(None, "k", "mdl/mdl_wrap.cpp WrapAclMdlCreateDataset"),
    "acl.mdl.add_dataset_buffer": Wrapper("kk", "ki", "mdl/mdl_wrap.cpp WrapAclMdlAddDatasetBuffer"),
    "acl.mdl.get_dataset_num_buffers": Wrapper("k", "k", "mdl/mdl_wrap.cpp WrapAclMdlGetDatasetNumBuffers"),
    "acl.mdl.get_dataset_buffer": Wrapper("kk", "k", "mdl/mdl_wrap.cpp WrapAclMdlGetDatasetBuffer"),
    "acl.mdl.destroy_dataset": Wrapper("k", "i", "mdl/mdl_wrap.cpp WrapAclMdlDestroyDataset"),
    "acl.mdl.set_dynamic_batch_size": Wrapper("IkkK", "i", "mdl/mdl_wrap.cpp WrapAclMdlSetDynamicBatchSize"),
    "acl.mdl.execute": Wrapper("Ikk", "i", "mdl/mdl_wrap.cpp WrapAclMdlExecute"),
    "acl.mdl.execute_async": Wrapper("Ikkk", "i", "mdl/mdl_wrap.cpp WrapAclMdlExecuteAsync"),
}


class _Region:
    """Memory behind an address: device (a bytearray at a fake address) or host (real memory at its
    real address, as pyACL hands out: pinned memory of acl.rt.malloc_host, or an array's own)."""

    def __init__(self, kind: str, memory: memoryview, owner: object = None, pinned: bool = False, device: int = -1):
        self.kind = kind  # "device" or "host"
        self.device = device  # of device memory
        self.memory = memory
        self.owner = owner  # keeps a host array alive while its address is handed out
        self.pinned = pinned  # host memory of acl.rt.malloc_host
        self.views: list[weakref.ref] = []  # acl.util.ptr_to_numpy arrays over it


class _Model:
    """A loaded fake .om: tensors as the descriptor declares them, and the context it lives in."""

    def __init__(self, descriptor: dict, context: int):
        self.context = context
        self.device = _state.contexts[context]
        self.work_size, self.weight_size = _sizes(descriptor)
        self.gears = sorted(descriptor.get("dynamic_batch") or [])
        self.relu = bool(descriptor.get("relu"))
        self.inputs = [_tensor(t) for t in descriptor["inputs"]]
        self.outputs = [_tensor(t) for t in descriptor["outputs"]]
        self.user_inputs = list(self.inputs)
        if self.gears:
            self.inputs.append({"name": DYNAMIC_BATCH_INPUT, "dtype": ACL_UINT64, "dims": [1]})
        self.gear_index = len(self.inputs) - 1 if self.gears else None
        _validate(self)

    def size(self, tensor: dict) -> int:
        if tensor["name"] == DYNAMIC_BATCH_INPUT:
            return _GEAR_INPUT_SIZE
        dims = self.dims(tensor)
        if any(d < 0 for d in dims):  # a dynamic dim and no gear: the fake has nothing to size it by
            return 0  # as aclmdlGetTensorSize when its shape range cannot (hicann/ge api/acl/acl_model/model/model_om2.cpp)
        return int(np.prod(dims)) * ITEM_SIZES[tensor["dtype"]]

    def dims(self, tensor: dict) -> list[int]:
        """Dims with the largest gear for the batch (what sizes are computed from)."""
        dims = list(tensor["dims"])
        if self.gears and tensor["name"] != DYNAMIC_BATCH_INPUT:
            dims[0] = self.gears[-1]
        return dims


def _sizes(descriptor: dict) -> tuple[int, int]:
    """The work and weight memory a fake .om declares (what acl.mdl.query_size reports and a load takes)."""
    return int(descriptor.get("work_size", 0)), int(descriptor.get("weight_size", 0))


def _tensor(declared: dict) -> dict:
    return {
        "name": str(declared["name"]),
        "dtype": int(declared["dtype"]),
        "dims": list(declared["dims"]),
    }


def _validate(model: _Model) -> None:
    """Refuses descriptors the 'execution' (output i from input i) cannot honour."""
    if len(model.outputs) > len(model.user_inputs):
        raise ValueError("a fake model needs an input for each output (output i copies input i)")
    for tensor in model.user_inputs + model.outputs:
        if tensor["dtype"] not in ITEM_SIZES:
            raise ValueError(f"ACL data type {tensor['dtype']} is not one the fake can size")
        if model.gears and tensor["dims"][:1] != [-1]:
            raise ValueError("with dynamic_batch, every tensor's first dim must be -1")
    for source, target in zip(model.user_inputs, model.outputs):
        if source["dims"] != target["dims"]:
            raise ValueError(f"output {target['name']} must have the dims of input {source['name']}")
        if source["dtype"] != target["dtype"] and {source["dtype"], target["dtype"]} - set(NUMPY_TYPES):
            raise ValueError(f"the fake cannot cast input {source['name']} to output {target['name']}")


class _Stream:
    """A stream: tasks run in order when someone synchronizes; `stuck` while a hung task holds it."""

    def __init__(self, context: int):
        self.context = context
        self.tasks: list[tuple[str, object, int | None]] = []  # (call, action, model id)
        self.stuck = False


class _Process:
    """ACL's process-wide initialisation: unlike everything else, it survives fake_reset().

    Kept here, or by the library FAKE_ACL_LIBRARY names (see the module doc).
    """

    def __init__(self):
        self._initialized = False
        self.finalized = False  # older CANN: no acl.init after this
        self.newer = os.environ.get("FAKE_ACL_NEWER_CANN") == "1"
        library = os.environ.get("FAKE_ACL_LIBRARY")
        self.library = ctypes.CDLL(library) if library else None

    @property
    def initialized(self) -> bool:
        if self.library is not None:
            return bool(self.library.stub_acl_initialized())
        return self._initialized

    @initialized.setter
    def initialized(self, value: bool) -> None:
        self._initialized = value


class _State:
    """Everything the fake runtime holds but the process-wide ACL state; fake_reset() starts over."""

    def __init__(self):
        self.lock = threading.RLock()
        self.calls: list[Call] = []
        self.injected: dict[tuple[str, int | None], list[int]] = {}
        self.hangs: Counter = Counter()  # (call, device) -> armed hangs
        self.released = threading.Event()  # set by fake_release(); a new one replaces it
        self.faults_stamp: tuple | None = None  # of the FAKE_ACL_FAULTS file last applied
        self.error = threading.local()  # .message, for get_recent_err_msg
        self.thread = threading.local()  # .context, the thread's current context
        self.devices: Counter = Counter()  # device id -> set_device references
        self.contexts: dict[int, int] = {}  # context -> device id
        self.streams: dict[int, _Stream] = {}
        self.regions: dict[int, _Region] = {}  # base address -> memory
        self.freed: list[_Region] = []  # freed pinned memory, poisoned and kept (see _poison)
        self.mallocs: list[tuple[int, int, int]] = []  # every acl.rt.malloc: (address, size, policy)
        self.models: dict[int, _Model] = {}
        self.descs: dict[int, int | None] = {}  # desc -> model id it describes
        self.datasets: dict[int, list[int]] = {}  # dataset -> data buffers
        self.data_buffers: dict[int, tuple[int, int]] = {}  # data buffer -> (address, size)
        self.utilization: dict[int, dict] = {}  # device id -> what get_device_utilization_rate reports
        default_mb = int(os.environ.get("FAKE_ACL_DEVICE_MEMORY_MB", "24576"))
        self.memory_total: collections.defaultdict[int, int] = collections.defaultdict(lambda: default_mb << 20)
        self.handles = itertools.count(0x1000, 0x10)
        self.model_ids = itertools.count(1)
        # Above every address a 48-bit virtual address space gives a process: never a host address.
        self.next_device_address = 2**52

    def device_address(self, size: int) -> int:
        """A fresh fake address, page aligned, with a gap after each region so overruns hit nothing."""
        address = self.next_device_address
        self.next_device_address = (address + size + 0x1FFF) // 0x1000 * 0x1000
        return address


_process = _Process()
_state = _State()


# ---- test helpers (not part of pyACL) ------------------------------------------------------


def fake_reset() -> None:
    """Forgets every call, handle, allocation, injected fault and hang.

    ACL's process-wide initialisation survives it, as it survives every model of a real
    process: for a fresh process, load a fresh copy of this module.
    """
    global _state
    _state.released.set()  # nothing stays blocked on a state that is gone
    _state = _State()


def fake_newer_cann(enabled: bool = True) -> None:
    """Behave as the newer CANN (acl.init again after acl.finalize) or, with False, the older one."""
    _process.newer = enabled


def fake_initialized() -> bool:
    return _process.initialized


def fake_calls() -> list[Call]:
    return list(_state.calls)


def fake_call_names() -> list[str]:
    return [call.name for call in _state.calls]


def fake_inject(
    name: str, ret: int = ACL_ERROR_INTERNAL_ERROR, times: int = 1, after: int = 0, device: int | None = None
) -> None:
    """The call `name` fails with `ret` `times` times, after `after` successes (see the module doc)."""
    with _state.lock:
        _state.injected[(name, device)] = [ACL_SUCCESS] * after + [ret] * times


def fake_hang(name: str, device: int | None = None) -> None:
    """The next call `name` (on `device` if given) hangs until fake_release() (see the module doc)."""
    with _state.lock:
        _state.hangs[(name, device)] += 1


def fake_release() -> None:
    """Ends every hang: blocked calls go on, stuck streams run their tasks at their next synchronize."""
    with _state.lock:
        for stream in _state.streams.values():
            stream.stuck = False
        released, _state.released = _state.released, threading.Event()
        released.set()


def fake_set_utilization(device_id: int, **rates: int) -> None:
    """Rates (`cube_utilization=90`, ...) acl.rt.get_device_utilization_rate reports for a device."""
    with _state.lock:
        _state.utilization[device_id] = {**FAKE_UTILIZATION, **rates}


def fake_set_device_memory(device_id: int, total: int) -> None:
    """The bytes of memory device `device_id` has (see the module doc)."""
    with _state.lock:
        _state.memory_total[device_id] = total


def fake_device_used(device_id: int) -> int:
    """Bytes taken on a device: its live acl.rt.malloc allocations and its loaded models' work and weight memory."""
    allocated = sum(len(r.memory) for r in _state.regions.values() if r.kind == "device" and r.device == device_id)
    return allocated + sum(m.work_size + m.weight_size for m in _state.models.values() if m.device == device_id)


def _take(device_id: int, size: int, ret: int) -> None:
    """Fails with `ret` unless `size` more bytes fit on the device."""
    free = _state.memory_total[device_id] - fake_device_used(device_id)
    if size > free:
        raise _Fail(ret, f"out of device memory: {size} bytes asked, {free} free on device {device_id}")


def fake_mallocs() -> list[tuple[int, int, int]]:
    """Every acl.rt.malloc so far, freed or not: (address, size, policy)."""
    return list(_state.mallocs)


def fake_device_memory() -> dict[int, int]:
    """Live device allocations: address -> size."""
    return {a: len(r.memory) for a, r in _state.regions.items() if r.kind == "device"}


def fake_host_memory() -> dict[int, int]:
    """Live acl.rt.malloc_host allocations: address -> size."""
    return {a: len(r.memory) for a, r in _state.regions.items() if r.pinned}


def fake_read(address: int, size: int) -> bytes:
    """The bytes at a fake address (device or host), for assertions."""
    region, offset = _resolve(address, size)
    if region is None:
        raise ValueError(f"no fake memory at {address:#x}")
    return bytes(region.memory[offset : offset + size])


def fake_leaks() -> dict[str, object]:
    """Whatever a user of ACL still holds; {} when everything acquired was released.

    ACL's own initialisation is not a leak: it lasts until the process ends (fake_initialized()).
    """
    s = _state
    leaks = {
        "device_memory": fake_device_memory(),
        "host_memory": fake_host_memory(),
        "data_buffers": sorted(s.data_buffers),
        "datasets": sorted(s.datasets),
        "descs": sorted(s.descs),
        "models": sorted(s.models),
        "streams": sorted(s.streams),
        "contexts": sorted(s.contexts),
        "devices": {d: n for d, n in s.devices.items() if n},
    }
    return {k: v for k, v in leaks.items() if v}


def fake_write_om(
    path, inputs, outputs=None, dynamic_batch=None, atc_names: bool = False, graph_names: list[int] | None = None,
    relu: bool = False, work_size: int = 0, weight_size: int = 0,
) -> Path:
    """Writes a fake .om descriptor; tensors are (name, acl_dtype, dims) or dicts.

    `outputs` defaults to one output per input, "<input>_out", with its dtype and dims; output i is
    input i, or Relu of it with `relu` (the model `make check-ascend` compiles).
    How aclmdlGetOutputNameByIndex names the outputs (CANN 8.0 API reference:
    hiascend.com/document/detail/zh/CANNCommunityEdition/80RC3alpha003/apiref/appdevgapi/aclcppdevg_03_1457.html),
    the operator being a made-up `node_<i>`; inputs keep their names either way:
    `atc_names`, as ATC names those of a model converted from ONNX, `<operator>:<edge>:<output name>`;
    `graph_names`, as a model built with the Ascend Graph API, `output_<network output index>_<operator>_<edge>`:
    the network output index of each of `outputs`, which may list them in another order than the network.
    `work_size`, `weight_size`: the device memory a load takes (acl.mdl.query_size reports them).
    """
    inputs = [_as_dict(t) for t in inputs]
    if outputs is None:
        outputs = [{**t, "name": f"{t['name']}_out"} for t in inputs]
    outputs = [_as_dict(t) for t in outputs]
    if atc_names:
        outputs = [{**t, "name": f"node_{i}:0:{t['name']}"} for i, t in enumerate(outputs)]
    if graph_names is not None:
        outputs = [{**t, "name": f"output_{i}_node_{i}_0"} for i, t in zip(graph_names, outputs, strict=True)]
    descriptor = {
        "fake_acl_om": 1,
        "inputs": inputs,
        "outputs": outputs,
        "dynamic_batch": list(dynamic_batch or []),
        "relu": relu,
        "work_size": work_size,
        "weight_size": weight_size,
    }
    path = Path(path)
    path.write_text(json.dumps(descriptor, indent=2))
    return path


def _as_dict(tensor) -> dict:
    if isinstance(tensor, dict):
        return dict(tensor)
    name, dtype, dims = tensor
    return {"name": name, "dtype": dtype, "dims": list(dims)}


class ExternalUser:
    """Another framework in this process using ACL through the same library.

    As ONNX Runtime's CANN execution provider does: its provider library calls aclInit when it
    loads and aclFinalize when it unloads (InitializeRegistry / DeleteRegistry in
    onnxruntime/core/providers/cann/cann_execution_provider.cc), and its sessions set a device
    and work in a context of their own.
    """

    def __init__(self, device_id: int = 0):
        self.device_id = device_id
        self.init_ret = init()  # 0: it initialised ACL; 100002: someone in the process had
        ret = rt.set_device(device_id)
        self.context, ret = rt.create_context(device_id) if ret == ACL_SUCCESS else (0, ret)
        if ret != ACL_SUCCESS:
            raise RuntimeError(f"external user: no context on device {device_id} (return code {ret})")

    def works(self) -> bool:
        """Whether its context still does device work (ACL not torn down under it)."""
        if rt.set_context(self.context):
            return False
        address, ret = rt.malloc(64, ACL_MEM_MALLOC_HUGE_FIRST)
        return ret == ACL_SUCCESS and rt.free(address) == ACL_SUCCESS

    def close(self) -> None:
        """Releases its context and device, as a session closing does (not ACL itself)."""
        rt.set_context(self.context)
        rt.destroy_context(self.context)
        rt.reset_device(self.device_id)

    def finalize(self) -> int:
        """Its aclFinalize, as the provider library calls when it unloads."""
        return finalize()


def fake_external_user(device_id: int = 0) -> ExternalUser:
    return ExternalUser(device_id)


# ---- machinery -------------------------------------------------------------------------------


class _Fail(Exception):
    """Raised inside a fake call to return an error code (with a message for get_recent_err_msg)."""

    def __init__(self, ret: int, message: str):
        super().__init__(message)
        self.ret = ret


class _Block(Exception):
    """Raised inside a fake call that must wait until fake_release(); the call is then retried."""

    def __init__(self, released: threading.Event):
        super().__init__("blocked until fake_release()")
        self.released = released


#: What PyArg_ParseTuple stores each format unit the table uses into.
_C_SLOTS = {"i": ctypes.c_int, "I": ctypes.c_uint, "k": ctypes.c_ulong, "K": ctypes.c_ulonglong,
            "s": ctypes.c_char_p, "O": ctypes.py_object}
#: The values Py_BuildValue makes of each integer format unit (a C int, unsigned int, unsigned long).
_C_RANGES = {"i": range(-(2**31), 2**31), "I": range(2**32), "k": range(2**64), "K": range(2**64)}
_parse_tuple = ctypes.pythonapi.PyArg_ParseTuple
_parse_tuple.restype = ctypes.c_int


def _parse(name: str, wrapper: Wrapper, args: tuple) -> tuple:
    """The arguments as the C wrapper gets them, parsed by CPython's PyArg_ParseTuple with its format."""
    if wrapper.args is None:  # the wrapper never looks at them
        return ()
    slots = [_C_SLOTS[unit]() for unit in wrapper.args if unit != "|"]
    try:
        _parse_tuple(ctypes.py_object(args), wrapper.args.encode(), *map(ctypes.byref, slots))
    except (TypeError, ValueError, OverflowError) as error:
        # CHECK_NULL(PyArg_ParseTuple(...), "<call> args parse failed") replaces the parser's error.
        raise TypeError(f"{name} args parse failed (fake: {error}; pyACL {wrapper.source})") from None
    given = slots[: len(args)]  # optional units left out stay out
    return tuple(slot.value.decode() if isinstance(slot, ctypes.c_char_p) else slot.value for slot in given)


def _check_result(name: str, wrapper: Wrapper, result) -> None:
    """A FAKE bug, loudly: a result Py_BuildValue could not have built from the table's format."""
    units = wrapper.result
    values = result if len(units) > 1 else (result,)
    shaped = isinstance(result, tuple) == (len(units) > 1) and len(values) == len(units)
    if not shaped or not all(_builds(unit, value) for unit, value in zip(units, values)):
        raise AssertionError(f"FAKE {name} returned {result!r}, not what pyACL's {units!r} builds ({wrapper.source})")


def _builds(unit: str, value) -> bool:
    if unit in _C_RANGES:
        return isinstance(value, int) and value in _C_RANGES[unit]
    if unit == "s":  # a NULL char* becomes None
        return value is None or isinstance(value, str)
    return value is not None  # "O"


def _failure(wrapper: Wrapper, ret: int):
    """What a failed call returns: its aclError, or (what stands for its value, its aclError)."""
    if wrapper.result == "i" and wrapper.failed is None:
        return ret
    failed = wrapper.failed if wrapper.failed is not None else {} if wrapper.result[0] == "O" else 0
    # The zero-initialised outputs, then the aclError (a wrapper building one value alone returns that value).
    return (*[failed] * (len(wrapper.result) - 1), ret) if len(wrapper.result) > 1 else failed


def _api(name: str):
    """The fake of the pyACL call `name`, held to its wrapper in PYACL; records the call and turns
    _Fail and injected faults into the real return convention.

    The implementation returns the call's value (None for a call that only acts); a call whose
    wrapper builds "i" then returns ACL_SUCCESS, one that builds a pair returns (value, 0). A
    blocked call waits outside the lock, so other threads (other devices) go on.
    """
    wrapper = PYACL[name]

    def wrap(function):
        def call(*args):
            parsed = _parse(name, wrapper, args)
            while True:
                with _state.lock:
                    _apply_faults_file()
                    try:
                        result = _invoke(name, wrapper, function, parsed)
                    except _Block as block:
                        released = block.released
                    else:
                        _check_result(name, wrapper, result)
                        _state.calls.append(Call(name, args, result))
                        return result
                released.wait()

        call.__name__ = function.__name__
        call.__qualname__ = name
        call.__doc__ = f"FAKE {name} (tests only; pyACL {wrapper.source}). {function.__doc__ or ''}"
        return call

    return wrap


def _invoke(name: str, wrapper: Wrapper, function, args):
    device = _device_of(name, args)
    ret = _injected(name, device)
    deferred = name in _ASYNC_CALLS and ret >= _DEVICE_FAILURES  # a failure of the task, not the call
    if ret != ACL_SUCCESS:
        _state.error.message = f"fake: injected failure of {name}"
        if not deferred:
            return _failure(wrapper, ret)
    hang = _take_hang(name, device)
    if hang and name == "acl.rt.synchronize_stream_with_timeout":
        _stream(args[0]).stuck = True
        _state.error.message = "fake: hung stream"
        return ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    if hang and name not in _ASYNC_CALLS:
        raise _Block(_state.released)  # the hang is used up: the call runs when it is retried
    try:
        value = function(*args)
    except _Fail as failure:
        _state.error.message = f"fake {name}: {failure}"
        return _failure(wrapper, failure.ret)
    if name in _ASYNC_CALLS and (deferred or hang):
        stream = _state.streams[args[-1]]
        if deferred:
            call, _, model_id = stream.tasks.pop()
            stream.tasks.append((call, _failing(name, ret), model_id))
        stream.stuck = stream.stuck or hang
    if len(wrapper.result) > 2:  # several values, then the aclError ("kki")
        return (*value, ACL_SUCCESS)
    if len(wrapper.result) > 1:
        return value, ACL_SUCCESS
    return ACL_SUCCESS if value is None else value


def _failing(name: str, ret: int):
    def fail():
        raise _Fail(ret, f"injected failure of the task of {name}")

    return fail


def _device_of(name: str, args) -> int | None:
    if name in _DEVICE_ARGUMENT_CALLS and args:
        return args[0]
    return _state.contexts.get(getattr(_state.thread, "context", 0))


def _injected(name: str, device: int | None) -> int:
    for key in ((name, device), (name, None)):
        queue = _state.injected.get(key)
        if queue:
            return queue.pop(0)
    return ACL_SUCCESS


def _take_hang(name: str, device: int | None) -> bool:
    for key in ((name, device), (name, None)):
        if _state.hangs[key] > 0:
            _state.hangs[key] -= 1
            return True
    return False


def _apply_faults_file() -> None:
    """Arms what FAKE_ACL_FAULTS lists, once per new version of the file."""
    path = os.environ.get("FAKE_ACL_FAULTS")
    if not path:
        return
    try:
        status = os.stat(path)
        stamp = (status.st_mtime_ns, status.st_size, status.st_ino)
        if stamp == _state.faults_stamp:
            return
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return  # absent, or caught half written: read it at the next call
    _state.faults_stamp = stamp
    for entry in entries:
        if entry.get("release"):
            fake_release()
        elif entry.get("hang"):
            fake_hang(entry["call"], entry.get("device"))
        else:
            fake_inject(entry["call"], entry["ret"], entry.get("times", 1), entry.get("after", 0), entry.get("device"))


def _require_init() -> None:
    if not _process.initialized:
        raise _Fail(ACL_ERROR_UNINITIALIZE, "acl.init has not been called, or acl.finalize tore ACL down")


def _require_context() -> int:
    _require_init()
    context = getattr(_state.thread, "context", 0)
    if not context:
        raise _Fail(ACL_ERROR_RT_CONTEXT_NULL, "this thread has no current context")
    return context


def _new_handle() -> int:
    return next(_state.handles)


def _resolve(address: int, count: int) -> tuple[_Region | None, int]:
    """The region holding [address, address + count), and the offset in it."""
    for base, region in _state.regions.items():
        if base <= address and address + count <= base + len(region.memory):
            return region, address - base
    return None, 0


def _model(model_id: int) -> _Model:
    if model_id not in _state.models:
        raise _Fail(ACL_ERROR_INVALID_MODEL_ID, f"no model {model_id} is loaded")
    return _state.models[model_id]


def _described(desc: int) -> _Model:
    model_id = _state.descs.get(desc)
    if model_id is None or model_id not in _state.models:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"desc {desc:#x} describes no loaded model")
    return _state.models[model_id]


def _stream(stream: int) -> _Stream:
    if stream not in _state.streams:
        raise _Fail(ACL_ERROR_RT_PARAM_INVALID, f"no stream {stream!r}")
    return _state.streams[stream]


def _current_stream(stream: int) -> _Stream:
    """A stream that belongs to the calling thread's current context."""
    context = _require_context()
    found = _stream(stream)
    if found.context != context:
        raise _Fail(ACL_ERROR_RT_STREAM_CONTEXT, "the stream is not in the current context")
    return found


def _run_tasks(stream: _Stream) -> int:
    """Runs what the stream holds, in order; the first failure's code (the stream is then empty)."""
    tasks, stream.tasks = stream.tasks, []
    first = ACL_SUCCESS
    for name, action, _ in tasks:
        try:
            action()
        except _Fail as failure:
            if first == ACL_SUCCESS:
                first = failure.ret
                _state.error.message = f"fake {name}: {failure}"
    return first


# ---- acl ---------------------------------------------------------------------------------------


@_api("acl.init")
def init(config_path: str | None = None):
    if _process.library is not None:
        ret = _process.library.aclInit(config_path.encode() if config_path else None)
        if ret != ACL_SUCCESS:
            raise _Fail(ret, f"aclInit of {os.environ['FAKE_ACL_LIBRARY']} returned {ret}")
        return
    if _process.initialized:
        raise _Fail(ACL_ERROR_REPEAT_INITIALIZE, "acl.init was already called")
    if _process.finalized and not _process.newer:
        # Older CANN's acl.cpp: aclFinalize never clears the "initialised" flag.
        raise _Fail(ACL_ERROR_REPEAT_INITIALIZE, "acl.init after acl.finalize (older CANN: once per process)")
    _process.initialized = True


@_api("acl.finalize")
def finalize():
    if _process.library is not None:
        ret = _process.library.aclFinalize()
        if ret != ACL_SUCCESS:
            raise _Fail(ret, f"aclFinalize of {os.environ['FAKE_ACL_LIBRARY']} returned {ret}")
        return
    if not _process.initialized:
        raise _Fail(ACL_ERROR_REPEAT_FINALIZE, "acl is not initialised")
    # Tears ACL down for the whole process, whoever still holds devices and contexts.
    _process.initialized = False
    _process.finalized = True


def get_recent_err_msg() -> str:
    """FAKE acl.get_recent_err_msg (tests only): the last failure in this thread, then clears it.

    Not recorded in fake_calls(): it is diagnostics, and runtimes call it only after a failure.
    """
    message = getattr(_state.error, "message", "")
    _state.error.message = ""
    return message


@_api("acl.get_soc_name")
def get_soc_name():
    """The chip's name, which ATC's --soc_version takes; needs no acl.init (CANN's example
    tools/get_soc_version in hicann/runtime). The fake's names no real chip."""
    return "FAKE_SOC"


@_api("acl.create_data_buffer")
def create_data_buffer(data: int, size: int):
    handle = _new_handle()
    _state.data_buffers[handle] = (data, size)
    return handle


@_api("acl.destroy_data_buffer")
def destroy_data_buffer(data_buffer: int):
    if _state.data_buffers.pop(data_buffer, None) is None:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"no data buffer {data_buffer:#x}")


@_api("acl.get_data_buffer_addr")
def get_data_buffer_addr(data_buffer: int):
    return _state.data_buffers.get(data_buffer, (0, 0))[0]


@_api("acl.get_data_buffer_size_v2")
def get_data_buffer_size_v2(data_buffer: int):
    return _state.data_buffers.get(data_buffer, (0, 0))[1]


get_data_buffer_size = get_data_buffer_size_v2


# ---- acl.rt ------------------------------------------------------------------------------------

rt = types.ModuleType("acl.rt", "FAKE acl.rt (tests only)")


@_api("acl.rt.set_device")
def _set_device(device_id: int):
    _require_init()
    if device_id < 0:  # an int already: PYACL's "i"
        raise _Fail(ACL_ERROR_RT_INVALID_DEVICEID, f"invalid device {device_id!r}")
    _state.devices[device_id] += 1
    _state.thread.device = device_id  # aclrtSetDevice: the device the thread computes on from now on


@_api("acl.rt.reset_device")
def _reset_device(device_id: int):
    _require_init()
    if not _state.devices[device_id]:
        raise _Fail(ACL_ERROR_RT_INVALID_DEVICEID, f"device {device_id} is not set")
    if _state.devices[device_id] == 1 and device_id in _state.contexts.values():
        raise _Fail(
            ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED,
            "contexts remain on the device (fake: stricter)",
        )
    _state.devices[device_id] -= 1


@_api("acl.rt.create_context")
def _create_context(device_id: int):
    _require_init()
    if not _state.devices[device_id]:
        raise _Fail(ACL_ERROR_RT_INVALID_DEVICEID, f"device {device_id} is not set")
    context = _new_handle()
    _state.contexts[context] = device_id
    _state.thread.context = context  # a new context becomes the creating thread's
    return context


@_api("acl.rt.set_context")
def _set_context(context: int):
    _require_init()
    if context not in _state.contexts:
        raise _Fail(ACL_ERROR_RT_CONTEXT_NULL, f"no context {context!r}")
    _state.thread.context = context


@_api("acl.rt.destroy_context")
def _destroy_context(context: int):
    _require_init()
    if context not in _state.contexts:
        raise _Fail(ACL_ERROR_RT_CONTEXT_NULL, f"no context {context!r}")
    if any(s.context == context for s in _state.streams.values()):
        raise _Fail(
            ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED,
            "streams remain in the context (fake: stricter)",
        )
    del _state.contexts[context]
    if getattr(_state.thread, "context", 0) == context:
        _state.thread.context = 0  # destroying the current context unbinds the thread


@_api("acl.rt.create_stream")
def _create_stream():
    stream = _new_handle()
    _state.streams[stream] = _Stream(_require_context())
    return stream


@_api("acl.rt.destroy_stream")
def _destroy_stream(stream: int):
    """Waits for the stream's tasks to finish, then destroys it."""
    _require_context()
    found = _stream(stream)
    if found.stuck:
        raise _Block(_state.released)
    _run_tasks(found)
    del _state.streams[stream]


@_api("acl.rt.destroy_stream_force")
def _destroy_stream_force(stream: int):
    """Destroys the stream without waiting: its tasks are dropped."""
    _require_context()
    _stream(stream)
    del _state.streams[stream]


@_api("acl.rt.synchronize_stream")
def _synchronize_stream(stream: int):
    _require_init()
    found = _stream(stream)
    if found.stuck:
        raise _Block(_state.released)
    if ret := _run_tasks(found):
        raise _Fail(ret, "a task of the stream failed")


@_api("acl.rt.synchronize_stream_with_timeout")
def _synchronize_stream_with_timeout(stream: int, timeout: int):
    """timeout: -1 waits for ever (as synchronize_stream), > 0 milliseconds; the rest is refused.

    CANN's API reference allows only -1 and > 0 (hicann/runtime
    docs/zh/api_ref/06_stream_management.md, aclrtSynchronizeStreamWithTimeout; pyACL's
    synchronize_stream_with_timeout page says the same). acl_rt.h's comment calls 0 an immediate
    check, but the implementation refuses it: below -1 in aclrtSynchronizeStreamWithTimeoutImpl
    (src/acl/aclrt_impl/stream.cpp), after the stream is validated 0 too in
    ApiErrorDecorator::StreamSynchronize (src/runtime/api/impl/api_error.cc, "greater than or equal
    to -1 and not equal to 0"), both ACL_ERROR_RT_PARAM_INVALID (RT_ERROR_INVALID_VALUE's code in
    src/runtime/core/src/common/errcode_manage.cc). A poll is acl.rt.stream_query.
    """
    _require_init()
    if timeout < -1:
        raise _Fail(ACL_ERROR_RT_PARAM_INVALID, f"timeout {timeout} is below -1")
    found = _stream(stream)
    if timeout == 0:
        raise _Fail(ACL_ERROR_RT_PARAM_INVALID, "timeout 0 is refused (greater than or equal to -1 and not equal to 0)")
    if found.stuck:
        if timeout == -1:
            raise _Block(_state.released)
        raise _Fail(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, f"the stream's tasks did not finish within {timeout} ms")
    if ret := _run_tasks(found):
        raise _Fail(ret, "a task of the stream failed")


@_api("acl.rt.malloc")
def _malloc(size: int, policy: int):
    context = _require_context()
    if size <= 0 or policy not in (0, 1, 2):
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"malloc({size}, {policy})")
    device = _state.contexts[context]
    _take(device, size, ACL_ERROR_RT_MEMORY_ALLOCATION)
    address = _state.device_address(size)
    _state.regions[address] = _Region("device", memoryview(bytearray(size)), device=device)
    _state.mallocs.append((address, size, policy))
    return address


@_api("acl.rt.free")
def _free(address: int):
    _require_context()
    region = _state.regions.get(address)
    if region is None or region.kind != "device":
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"{address!r} is not a device allocation")
    del _state.regions[address]


@_api("acl.rt.get_mem_info")
def _get_mem_info(attr: int):
    """(free, total) of the thread's device: its current context's, else the one it set."""
    _require_init()
    context = getattr(_state.thread, "context", 0)
    device = _state.contexts.get(context, getattr(_state.thread, "device", None))
    if device is None or not _state.devices[device]:
        raise _Fail(ACL_ERROR_RT_CONTEXT_NULL, "no device is set in this thread (aclrtSetDevice first)")
    if attr not in (ACL_DDR_MEM, ACL_HBM_MEM):
        return 0, 0  # an attribute the hardware does not have
    total = _state.memory_total[device]
    return total - fake_device_used(device), total


@_api("acl.rt.malloc_host")
def _malloc_host(size: int):
    """Pinned host memory at a real address, 64-byte aligned: WrapAclRtMallocHost returns the pointer
    aclrtMallocHost gave (rt/rt_memory.cpp), so a view made of the address alone (ctypes) works as
    with real pyACL. Its content is not initialised (the fake: zeros)."""
    _require_context()
    if size <= 0:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"malloc_host({size})")
    memory = bytearray(size + _ALIGNMENT)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % _ALIGNMENT
    view = memoryview(memory)[start : start + size]  # an export: the bytearray cannot move now
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    _state.regions[address] = _Region("host", view, pinned=True)
    return address


@_api("acl.rt.free_host")
def _free_host(address: int):
    _require_init()
    region = _state.regions.get(address)
    if region is None or not region.pinned:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"{address!r} is not an acl.rt.malloc_host allocation")
    del _state.regions[address]
    _poison(region)


#: The byte freed pinned memory is filled with: NaN in floats, -1 in integers.
POISON = 0xFF


def _poison(region: _Region) -> None:
    """A use of a view of freed pinned memory fails clearly. Real pyACL's ptr_to_numpy array does not
    own its memory (WrapPtrToNumpy passes the module as its base, util/numpy_convert.cpp), so after
    acl.rt.free_host it points at memory given back: a crash, or someone else's data. The fake's
    views turn read-only (writes raise), the memory reads POISON, and it is kept, never reused."""
    region.memory[:] = bytes([POISON]) * len(region.memory)
    for view in (ref() for ref in region.views):
        if view is not None:
            view.flags.writeable = False
    _state.freed.append(region)


def _copy_between(dst: int, dest_max: int, src: int, count: int, kind: int) -> tuple[memoryview, memoryview, _Region]:
    """The target and source memory of a copy, checked as aclrtMemcpy checks its arguments."""
    if count > dest_max:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"count {count} > dest_max {dest_max}")
    target, at = _resolve(dst, dest_max)
    source, frm = _resolve(src, count)
    if target is None or source is None:
        raise _Fail(ACL_ERROR_INVALID_PARAM, "an address range is outside any allocation")
    expected = {
        0: ("host", "host"),
        1: ("host", "device"),
        2: ("device", "host"),
        3: ("device", "device"),
    }
    if expected.get(kind) != (source.kind, target.kind):
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"kind {kind} does not copy {source.kind} to {target.kind}")
    if target.memory.readonly:
        raise _Fail(ACL_ERROR_INVALID_PARAM, "the fake will not write into an immutable bytes object")
    host = source if source.kind == "host" else target
    return target.memory[at : at + count], source.memory[frm : frm + count], host


@_api("acl.rt.memcpy")
def _memcpy(dst: int, dest_max: int, src: int, count: int, kind: int):
    _require_context()
    target, source, _ = _copy_between(dst, dest_max, src, count, kind)
    target[:] = source


@_api("acl.rt.memcpy_async")
def _memcpy_async(dst: int, dest_max: int, src: int, count: int, kind: int, stream: int):
    found = _current_stream(stream)
    target, source, host = _copy_between(dst, dest_max, src, count, kind)
    if dst % _ALIGNMENT or src % _ALIGNMENT:
        raise _Fail(ACL_ERROR_INVALID_PARAM, "memcpy_async wants 64-byte aligned addresses")
    if kind in (ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST) and not host.pinned:
        raise _Fail(ACL_ERROR_INVALID_PARAM, "host memory not from acl.rt.malloc_host (fake: stricter)")

    def copy():
        target[:] = source

    found.tasks.append(("acl.rt.memcpy_async", copy, None))


@_api("acl.rt.get_device_utilization_rate")
def _get_device_utilization_rate(device_id: int):
    _require_init()
    if not _state.devices[device_id]:
        raise _Fail(ACL_ERROR_RT_INVALID_DEVICEID, f"device {device_id} is not set (fake: stricter)")
    return dict(_state.utilization.get(device_id, FAKE_UTILIZATION))


rt.set_device = _set_device
rt.reset_device = _reset_device
rt.create_context = _create_context
rt.set_context = _set_context
rt.destroy_context = _destroy_context
rt.create_stream = _create_stream
rt.destroy_stream = _destroy_stream
rt.destroy_stream_force = _destroy_stream_force
rt.synchronize_stream = _synchronize_stream
rt.synchronize_stream_with_timeout = _synchronize_stream_with_timeout
rt.malloc = _malloc
rt.free = _free
rt.malloc_host = _malloc_host
rt.get_mem_info = _get_mem_info
rt.free_host = _free_host
rt.memcpy = _memcpy
rt.memcpy_async = _memcpy_async
rt.get_device_utilization_rate = _get_device_utilization_rate


# ---- acl.util ----------------------------------------------------------------------------------

util = types.ModuleType("acl.util", "FAKE acl.util (tests only)")


def _host_address(owner: object, memory: memoryview) -> int:
    """The real address of host memory, as pyACL's PyArray_BYTES / PyBytes_AsString give it."""
    address = np.frombuffer(memory, dtype=np.uint8).ctypes.data if len(memory) else id(owner)
    known = _state.regions.get(address)
    if known is None or len(known.memory) < len(memory):
        _state.regions[address] = _Region("host", memory, owner)
    return address


@_api("acl.util.numpy_to_ptr")
def _numpy_to_ptr(array):
    warnings.warn(
        "acl.util.numpy_to_ptr will be deprecated. Please use acl.util.bytes_to_ptr instead.",
        Warning,
        stacklevel=3,
    )
    if not isinstance(array, np.ndarray):
        raise ValueError("needs an ndarray as argument")
    if not array.flags.c_contiguous:
        raise ValueError("fake acl: a non-contiguous ndarray has no single pointer")
    return _host_address(array, memoryview(array.reshape(-1).view(np.uint8)))


@_api("acl.util.ptr_to_numpy")
def _ptr_to_numpy(address: int, shape: tuple, npy_type: int):
    """A writable array over the memory at `address` (no copy), as pyACL's WrapPtrToNumpy builds it."""
    warnings.warn(
        "acl.util.ptr_to_numpy will be deprecated. Please use acl.util.ptr_to_bytes instead.",
        Warning,
        stacklevel=3,
    )
    # WrapPtrToNumpy: PyTuple_Size of anything but a tuple fails, "shape is empty"; each dim must
    # pass PyObject_TypeCheck(PyLong_Type) (a Python int or bool, not a numpy integer).
    if not isinstance(shape, tuple):
        raise ValueError("shape is empty")
    if not all(isinstance(d, int) for d in shape):
        raise TypeError("the second argument is not list of int")
    dtype = _NPY_TYPES[npy_type]
    count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    region, offset = _resolve(address, count)
    if region is None:  # the real one would read whatever is there
        raise ValueError(f"fake acl: no memory of {count} bytes at {address:#x}")
    view = np.frombuffer(region.memory[offset : offset + count], dtype=dtype).reshape(shape)
    region.views.append(weakref.ref(view))
    return view


@_api("acl.util.bytes_to_ptr")
def _bytes_to_ptr(data):
    if not isinstance(data, bytes):  # the real one checks PyBytes_Check too
        raise ValueError("needs an byte as argument")
    return _host_address(data, memoryview(data))


@_api("acl.util.ptr_to_bytes")
def _ptr_to_bytes(address: int, size: int):
    return fake_read(address, size)


util.numpy_to_ptr = _numpy_to_ptr
util.ptr_to_numpy = _ptr_to_numpy
util.bytes_to_ptr = _bytes_to_ptr
util.ptr_to_bytes = _ptr_to_bytes


# ---- acl.mdl -----------------------------------------------------------------------------------

mdl = types.ModuleType("acl.mdl", "FAKE acl.mdl (tests only)")


@_api("acl.mdl.load_from_file")
def _load_from_file(path: str):
    context = _require_context()
    descriptor = _read_descriptor(path)
    try:
        model = _Model(descriptor, context)
    except (KeyError, TypeError, ValueError) as error:
        raise _Fail(ACL_ERROR_PARSE_MODEL, f"bad fake om descriptor: {error!r}") from None
    _take(model.device, model.work_size + model.weight_size, ACL_ERROR_GE_MEMORY_ALLOCATION)
    model_id = next(_state.model_ids)
    _state.models[model_id] = model
    return model_id


@_api("acl.mdl.query_size")
def _query_size(path: str):
    """The work and weight memory the model file needs; reads the file only (no device, no context)."""
    _require_init()
    return _sizes(_read_descriptor(path))


def _read_descriptor(path: str) -> dict:
    """A fake .om file's descriptor (JSON); an unreadable or unparsable file fails with acl.mdl's codes for them."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as error:
        raise _Fail(ACL_ERROR_GE_EXEC_MODEL_PATH_INVALID, str(error)) from None
    except ValueError as error:
        raise _Fail(ACL_ERROR_PARSE_MODEL, f"not a fake om descriptor: {error}") from None


@_api("acl.mdl.unload")
def _unload(model_id: int):
    _require_context()
    _model(model_id)
    if any(s.stuck and any(task[2] == model_id for task in s.tasks) for s in _state.streams.values()):
        raise _Fail(ACL_ERROR_RT_MODEL_RUNNING, "the model is still executing")
    del _state.models[model_id]


@_api("acl.mdl.create_desc")
def _create_desc():
    desc = _new_handle()
    _state.descs[desc] = None
    return desc


@_api("acl.mdl.get_desc")
def _get_desc(desc: int, model_id: int):
    _require_init()
    _model(model_id)
    if desc not in _state.descs:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"no desc {desc!r}")
    _state.descs[desc] = model_id


@_api("acl.mdl.destroy_desc")
def _destroy_desc(desc: int):
    if desc not in _state.descs:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"no desc {desc!r}")
    del _state.descs[desc]


def _query(name: str, pick):
    """A description query returning a bare value; for a bad desc/index what the C API returns
    (0, "" for a name, ACL_DT_UNDEFINED for a data type: PYACL's `failed`)."""
    failed = 0 if PYACL[name].failed is None else PYACL[name].failed

    def query(desc: int, index: int):
        try:
            return pick(_described(desc), index)
        except (_Fail, IndexError):
            return failed

    return _api(name)(query)


def _dims(which: str):
    def dims(desc: int, index: int):
        model = _described(desc)
        tensors = model.inputs if which == "input" else model.outputs
        if not 0 <= index < len(tensors):
            raise _Fail(ACL_ERROR_INVALID_PARAM, f"no {which} {index}")
        tensor = tensors[index]
        # Real pyACL: input dims keep -1 for a dynamic batch; output dims give the largest gear.
        reported = list(tensor["dims"]) if which == "input" else model.dims(tensor)
        name = _dims_name(model, _state.descs[desc], which, index)
        return {"name": name, "dimCount": len(reported), "dims": reported}

    return _api(f"acl.mdl.get_{which}_dims")(dims)


def _dims_name(model: _Model, model_id: int, which: str, index: int) -> str:
    """The name in aclmdlIODims. One longer than 127 characters does not fit its char[128]
    (ACL_MAX_TENSOR_NAME_LEN, acl_mdl.h): it reads acl_modelId_<model id>_<input|output>_<index>,
    with _a.._z, then _aa.._zzz, added when a tensor of the model already has that name
    (GetTensorDescNameToDims, GetConvertTensorName and TransConvertTensorNameToLegal in hicann/ge
    api/acl/acl_model/model/model_common.cpp; documented on aclmdlGetInputDims/aclmdlGetOutputDims,
    CANN 9.0 API reference aclcppdevg_03_1455). aclmdlGet{Input,Output}NameByIndex keep the real one."""
    real = (model.inputs if which == "input" else model.outputs)[index]["name"]
    if len(real) <= 127:
        return real
    taken = {t["name"] for t in model.inputs + model.outputs}
    converted = f"acl_modelId_{model_id}_{which}_{index}"
    if converted not in taken:
        return converted
    for length in (1, 2, 3):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            if (candidate := f"{converted}_{''.join(letters)}") not in taken:
                return candidate
    return converted  # TransConvertTensorNameToLegal gives up after three letters


mdl.get_num_inputs = _api("acl.mdl.get_num_inputs")(
    lambda desc: len(_described(desc).inputs) if _state.descs.get(desc) in _state.models else 0
)
mdl.get_num_outputs = _api("acl.mdl.get_num_outputs")(
    lambda desc: len(_described(desc).outputs) if _state.descs.get(desc) in _state.models else 0
)
mdl.get_input_size_by_index = _query(
    "acl.mdl.get_input_size_by_index", lambda m, i: m.size(m.inputs[i])
)
mdl.get_output_size_by_index = _query(
    "acl.mdl.get_output_size_by_index", lambda m, i: m.size(m.outputs[i])
)
mdl.get_input_name_by_index = _query(
    "acl.mdl.get_input_name_by_index", lambda m, i: m.inputs[i]["name"]
)
mdl.get_output_name_by_index = _query(
    "acl.mdl.get_output_name_by_index", lambda m, i: m.outputs[i]["name"]
)
mdl.get_input_data_type = _query("acl.mdl.get_input_data_type", lambda m, i: m.inputs[i]["dtype"])
mdl.get_output_data_type = _query(
    "acl.mdl.get_output_data_type", lambda m, i: m.outputs[i]["dtype"]
)
mdl.get_input_dims = _dims("input")
mdl.get_output_dims = _dims("output")


@_api("acl.mdl.get_input_index_by_name")
def _get_input_index_by_name(desc: int, name: str):
    for index, tensor in enumerate(_described(desc).inputs):
        if tensor["name"] == name:
            return index
    raise _Fail(ACL_ERROR_INVALID_PARAM, f"no input named {name!r}")


@_api("acl.mdl.get_dynamic_batch")
def _get_dynamic_batch(desc: int):
    gears = _described(desc).gears
    return {"batchCount": len(gears), "batch": list(gears)}


@_api("acl.mdl.create_dataset")
def _create_dataset():
    dataset = _new_handle()
    _state.datasets[dataset] = []
    return dataset


@_api("acl.mdl.add_dataset_buffer")
def _add_dataset_buffer(dataset: int, data_buffer: int):
    if dataset not in _state.datasets or data_buffer not in _state.data_buffers:
        raise _Fail(ACL_ERROR_INVALID_PARAM, "unknown dataset or data buffer")
    _state.datasets[dataset].append(data_buffer)
    return dataset


@_api("acl.mdl.get_dataset_num_buffers")
def _get_dataset_num_buffers(dataset: int):
    return len(_state.datasets.get(dataset, ()))


@_api("acl.mdl.get_dataset_buffer")
def _get_dataset_buffer(dataset: int, index: int):
    buffers = _state.datasets.get(dataset, ())
    return buffers[index] if 0 <= index < len(buffers) else 0


@_api("acl.mdl.destroy_dataset")
def _destroy_dataset(dataset: int):
    # Like the real one, this leaves the data buffers to acl.destroy_data_buffer.
    if _state.datasets.pop(dataset, None) is None:
        raise _Fail(ACL_ERROR_INVALID_PARAM, f"no dataset {dataset!r}")


def _buffer_memory(model: _Model, dataset: int, tensors: list[dict]) -> list[memoryview]:
    """The device memory behind each buffer of a dataset, checked against the model."""
    buffers = _state.datasets.get(dataset)
    if buffers is None or len(buffers) != len(tensors):
        raise _Fail(
            ACL_ERROR_GE_PARAM_INVALID,
            f"dataset has {len(buffers or [])} buffers, model {len(tensors)}",
        )
    views = []
    for data_buffer, tensor in zip(buffers, tensors):
        address, size = _state.data_buffers[data_buffer]
        if size < model.size(tensor):
            raise _Fail(
                ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID, f"{tensor['name']}: {size} bytes"
            )
        region, offset = _resolve(address, size)
        if region is None or region.kind != "device":
            raise _Fail(
                ACL_ERROR_GE_EXEC_MODEL_ADDR_INVALID, f"{tensor['name']}: not device memory"
            )
        views.append(region.memory[offset : offset + size])
    return views


@_api("acl.mdl.set_dynamic_batch_size")
def _set_dynamic_batch_size(model_id: int, dataset: int, index: int, batch_size: int):
    _require_context()
    model = _model(model_id)
    if index != model.gear_index:
        raise _Fail(ACL_ERROR_GE_PARAM_INVALID, f"input {index} is not {DYNAMIC_BATCH_INPUT}")
    if batch_size not in model.gears:
        raise _Fail(
            ACL_ERROR_GE_DYNAMIC_BATCH_SIZE_INVALID, f"{batch_size} is not one of {model.gears}"
        )
    # Like GE, write the gear into the model's gear input, where execute reads it.
    views = _buffer_memory(model, dataset, model.inputs)
    views[index][:_GEAR_INPUT_SIZE] = np.uint64(batch_size).tobytes()


def _execution(model_id: int, input_dataset: int, output_dataset: int):
    """Checks an execution's arguments now; returns what runs it (output i from input i)."""
    model = _model(model_id)
    if _require_context() != model.context:
        raise _Fail(ACL_ERROR_RT_MODEL_CONTEXT, "the model was loaded under another context")
    _buffer_memory(model, input_dataset, model.inputs)
    _buffer_memory(model, output_dataset, model.outputs)

    def execute():
        sources = _buffer_memory(model, input_dataset, model.inputs)
        targets = _buffer_memory(model, output_dataset, model.outputs)
        rows = None
        if model.gears:
            rows = int(np.frombuffer(sources[model.gear_index][:_GEAR_INPUT_SIZE], dtype=np.uint64)[0])
            if rows not in model.gears:
                raise _Fail(ACL_ERROR_GE_DYNAMIC_BATCH_SIZE_INVALID, f"gear input holds {rows}")
        for source, target, given, made in zip(sources, targets, model.user_inputs, model.outputs):
            count = model.size(given)
            if rows is not None:
                count = count // model.gears[-1] * rows  # only the rows of the gear run
            if model.relu:  # the host check's model (tools/check_ascend_host.py, check 7)
                values = np.frombuffer(source[:count], dtype=NUMPY_TYPES[given["dtype"]])
                target[:count] = np.maximum(values, 0).astype(NUMPY_TYPES[made["dtype"]]).tobytes()
            elif given["dtype"] == made["dtype"]:
                target[:count] = source[:count]
            else:  # ATC --output_type: the output is cast
                values = np.frombuffer(source[:count], dtype=NUMPY_TYPES[given["dtype"]])
                cast = values.astype(NUMPY_TYPES[made["dtype"]]).tobytes()
                target[: len(cast)] = cast

    return execute


@_api("acl.mdl.execute")
def _execute(model_id: int, input_dataset: int, output_dataset: int):
    _execution(model_id, input_dataset, output_dataset)()


@_api("acl.mdl.execute_async")
def _execute_async(model_id: int, input_dataset: int, output_dataset: int, stream: int):
    found = _current_stream(stream)
    found.tasks.append(("acl.mdl.execute_async", _execution(model_id, input_dataset, output_dataset), model_id))


mdl.load_from_file = _load_from_file
mdl.unload = _unload
mdl.query_size = _query_size
mdl.create_desc = _create_desc
mdl.get_desc = _get_desc
mdl.destroy_desc = _destroy_desc
mdl.get_input_index_by_name = _get_input_index_by_name
mdl.get_dynamic_batch = _get_dynamic_batch
mdl.create_dataset = _create_dataset
mdl.add_dataset_buffer = _add_dataset_buffer
mdl.get_dataset_num_buffers = _get_dataset_num_buffers
mdl.get_dataset_buffer = _get_dataset_buffer
mdl.destroy_dataset = _destroy_dataset
mdl.set_dynamic_batch_size = _set_dynamic_batch_size
mdl.execute = _execute
mdl.execute_async = _execute_async


def _without(name: str) -> None:
    namespace, _, attribute = name.rpartition(".")
    owner = {"acl.rt": rt, "acl.mdl": mdl, "acl.util": util}.get(namespace)
    if owner is None:
        del globals()[attribute]
    else:
        delattr(owner, attribute)


# A pyACL that lacks calls, FAKE_ACL_WITHOUT="acl.util.ptr_to_numpy,...": an older one, or a newer one
# without what it documents as "will be deprecated" (util/numpy_convert.cpp: ptr_to_numpy, numpy_to_ptr).
for _name in filter(None, os.environ.get("FAKE_ACL_WITHOUT", "").split(",")):
    _without(_name.strip())

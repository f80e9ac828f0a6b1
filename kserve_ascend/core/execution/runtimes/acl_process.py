"""pyACL in this process: the `acl` module, ACL's one initialisation per process, and what its return codes mean.

Every AclRuntime of the process shares them (`PROCESS_ACL`).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import threading
from collections import Counter
from typing import Any

from ...errors import DeviceError, ModelLoadError
from .. import memory_meter, npu_access

log = logging.getLogger(__name__)

ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046

#: Return codes after which the context that saw them is not trusted again: the device stopped,
#: faulted or lost a task (rt_error_codes.h, hicann/runtime
#: include/external/acl/error_codes/rt_error_codes.h; meanings in its docs/03_api_ref/25-01_aclError.md,
#: which sends every one of them to technical support). The instance goes out of rotation.
CONTEXT_FATAL = frozenset({
    107020,  # ACL_ERROR_RT_TASK_TIMEOUT
    107022,  # ACL_ERROR_RT_DEVICE_TASK_ABORT
    107023,  # ACL_ERROR_RT_STREAM_ABORT
    107035,  # ACL_ERROR_RT_TASK_ABORT_STOP
    207004,  # ACL_ERROR_RT_NO_DEVICE
    507010,  # ACL_ERROR_RT_LOST_HEARTBEAT: the task scheduler stopped answering
    507013,  # ACL_ERROR_RT_SYS_DMA
    507014, 507015, 507016,  # ACL_ERROR_RT_AICORE_TIMEOUT, _EXCEPTION, _TRAP_EXCEPTION
    507017, 507018,  # ACL_ERROR_RT_AICPU_TIMEOUT, _EXCEPTION
    507034, 507035, 507036,  # ACL_ERROR_RT_VECTOR_CORE_TIMEOUT, _EXCEPTION, _TRAP_EXCEPTION
    507042, 507043, 507044, 507045,  # AI Core / Vector Core trap read/write overflow
    ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
    507048, 507049, 507050,  # ACL_ERROR_RT_FFTS_PLUS_TIMEOUT, _EXCEPTION, _TRAP_EXCEPTION
    507053, 507054,  # ACL_ERROR_RT_DEVICE_MEM_ERROR, ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR
    507901,  # ACL_ERROR_RT_SOCKET_CLOSE: the host-device link is gone
    545601,  # ACL_ERROR_GE_MODEL_EXECUTE_TIMEOUT
})

def import_acl() -> Any:
    try:
        return importlib.import_module("acl")
    except (ImportError, OSError) as error:
        raise ModelLoadError(
            "the acl runtime needs pyACL, the `acl` Python module of the CANN toolkit, and it "
            f"cannot be imported ({error}). Install the CANN toolkit and load its environment "
            "before starting the server: source /usr/local/Ascend/ascend-toolkit/set_env.sh"
        ) from error


class ProcessAcl:
    """ACL's initialisation, one per process, shared by every AclRuntime.

    `acl.init` runs once, when the first runtime loads; ACL_ERROR_REPEAT_INITIALIZE means another
    framework in the process got there first and ACL is usable. ONNX Runtime's CANN execution
    provider, which calls aclInit when its library loads, does not tolerate that code, so it is
    given the chance to initialise ACL before our acl.init. `acl.finalize` runs only at exit, only if our
    `acl.init` did the initialising and no runtime is open, because it cannot be undone: older
    CANN allows "一个进程内只能调用一次acl.init" (pyACL acl.init, CANN 8.0.RC2), so after a finalize
    the next model could never load; newer CANN's aclFinalize clears every aclInit's reference at
    once (hicann/runtime docs/03_api_ref/02_初始化与去初始化.md), tearing ACL down under the other
    frameworks of the process. Contexts and devices are still released by each runtime.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._ready: set = set()  # acl modules initialised (by us or before us)
        self._owned: set = set()  # those our acl.init initialised
        self._users: Counter = Counter()  # acl module -> open runtimes

    def join(self, acl: Any, device_id: int) -> None:
        with self._lock:
            if acl not in self._ready:
                npu_access.warn_once()  # says which device node or driver library this user cannot open
                _let_onnxruntime_initialise_acl(device_id)
                ret = acl.init()
                if ret not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
                    raise DeviceError("acl.init", ret, recent_error(acl))
                self._ready.add(acl)
                if ret == ACL_SUCCESS:
                    self._owned.add(acl)
            self._users[acl] += 1

    def leave(self, acl: Any) -> None:
        with self._lock:
            self._users[acl] -= 1

    def finalize(self, acl: Any) -> None:
        """acl.finalize, if our acl.init initialised ACL and no runtime holds a context any more."""
        with self._lock:
            if acl not in self._owned or self._users[acl]:
                return
            self._owned.discard(acl)
            self._ready.discard(acl)
            try:
                ret = acl.finalize()
            except Exception:  # exiting anyway: a broken runtime must not mask the exit status
                ret = None
            if ret != ACL_SUCCESS:
                log.warning("acl.finalize at exit returned %s", ret)

    def finalize_at_exit(self) -> None:
        for acl in list(self._owned):
            self.finalize(acl)


def _let_onnxruntime_initialise_acl(device_id: int) -> None:
    """The CANN execution provider throws on an ACL initialised before it, finalizing that ACL as
    it gives up (runtimes/onnx.py, initialise_acl): when it is installed, it goes first."""
    try:
        from . import onnx
    except ModelLoadError:  # no onnxruntime in this install
        return
    onnx.initialise_acl(device_id)


PROCESS_ACL = ProcessAcl()
# atexit, not a destructor: "不建议在析构函数中调用aclFinalize" (pyACL acl.finalize constraints).
atexit.register(PROCESS_ACL.finalize_at_exit)


def recent_error(acl: Any) -> str:
    """ACL's own description of the last failure in this thread, when it has one."""
    try:
        return str(acl.get_recent_err_msg() or "")
    except Exception:  # an old pyACL without it, or a broken runtime: the code is enough
        return ""


def device_memory(device_id: int) -> tuple[int, int] | None:
    """The NPU's (free, total) bytes through pyACL (ACL initialised first, as every user of it here does); None on
    a host without pyACL or if the device cannot tell: the metrics then show the host's, the budget is unlimited."""
    acl = memory_meter.pyacl()
    if acl is None:
        return None
    try:
        PROCESS_ACL.join(acl, device_id)
    except Exception:  # no usable ACL here
        return None
    try:
        return memory_meter.device_reading(acl, device_id)
    finally:
        PROCESS_ACL.leave(acl)


def check(acl: Any, call: str, ret: int) -> None:
    if ret != ACL_SUCCESS:
        raise DeviceError(call, ret, recent_error(acl), fatal=ret in CONTEXT_FATAL)

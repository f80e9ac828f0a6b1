"""What a runtime's load takes, measured: on its NPU through pyACL, or in this process's resident memory.

See `models.memory` for how the measurements are used (the budget, the repository index, the metrics).
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable

#: Where a measurement came from, as model metadata says it (`memory_source`).
RESIDENT = "process resident memory"
DEVICE = "acl.rt.get_mem_info"
CONFIGURED = "memory_mb"

#: Loads run one at a time while they are measured, so each before/after delta is one model's own.
_MEASURING = threading.Lock()
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


def host_memory() -> tuple[int, int]:
    """The host's memory in use and in total, bytes (/proc/meminfo: MemTotal - MemAvailable)."""
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"], fields["MemTotal"]


def measured(load: Callable[[], object]) -> tuple[object, int, str]:
    """Runs `load` (a runtime's), one at a time in the process; the runtime, the bytes it took and how
    they were measured: by the runtime on its device (its `memory_bytes`), else the process's resident memory."""
    with _MEASURING:
        before = resident_bytes()
        runtime = load()
        after = resident_bytes()
    own = getattr(runtime, "memory_bytes", None)
    if own is not None:
        return runtime, own, getattr(runtime, "memory_source", DEVICE)
    return runtime, max(0, after - before), getattr(runtime, "memory_source", RESIDENT)


#: aclrtMemAttr's ACL_HBM_MEM (hicann/runtime include/external/acl/acl_rt.h): on a chip without HBM (the
#: 310P's DDR) aclrtGetMemInfo reads its DDR instead (docs/zh/api_ref/11-01_device_memory_malloc_and_free.md).
ACL_HBM_MEM = 1


@functools.cache
def pyacl():
    """The `acl` module where pyACL is importable (an NPU host), else None (looked for once)."""
    try:
        return importlib.import_module("acl")
    except (ImportError, OSError):
        return None


def read_mem_info(acl) -> tuple[int, int] | None:
    """(free, total) bytes of the device the calling thread has set, from `acl.rt.get_mem_info(attr)`,
    which returns `(free, total, ret)` (pyACL rt/rt_memory.cpp WrapAclRtGetMemInfo, Py_BuildValue "kki")
    and needs a device set first (aclrtGetMemInfo's constraints); None if pyACL lacks it or it fails."""
    query = getattr(acl.rt, "get_mem_info", None)
    if query is None:
        return None
    free, total, ret = query(ACL_HBM_MEM)
    return (free, total) if ret == 0 and total else None


def device_reading(acl, device_id: int) -> tuple[int, int] | None:
    """(free, total) bytes of an NPU, in a process whose ACL is initialised (None if it is not, or cannot tell)."""
    if acl.rt.set_device(device_id) != 0:
        return None
    try:
        return read_mem_info(acl)
    finally:
        acl.rt.reset_device(device_id)

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


@functools.cache
def pyacl():
    """The `acl` module where pyACL is importable (an NPU host), else None (looked for once)."""
    try:
        return importlib.import_module("acl")
    except (ImportError, OSError):
        return None


def device_memory(device_id: int) -> tuple[int, int] | None:
    """The NPU's (free, total) bytes through pyACL; None on a host without pyACL or if the device cannot tell."""
    acl = pyacl()
    if acl is None:
        return None
    from .runtimes.acl_process import PROCESS_ACL, read_mem_info

    try:
        PROCESS_ACL.join(acl, device_id)
    except Exception:  # no usable ACL here: the host's figures serve
        return None
    try:
        if acl.rt.set_device(device_id) != 0:
            return None
        try:
            return read_mem_info(acl)
        finally:
            acl.rt.reset_device(device_id)
    finally:
        PROCESS_ACL.leave(acl)

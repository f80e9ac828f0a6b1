"""Where the cores went during a point: the server, the load generator, and everything else.

The machine has 2 cores that the client, the server and whatever else runs here share.
Cores used by others mean the point was measured on fewer cores, so each point says so;
and the server's CPU per request (its process tree's CPU seconds over the requests it answered
in the same span) compares servers regardless of what the client costs.
"""

from __future__ import annotations

import contextlib
import resource
import time

import psutil


def _busy() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _tree_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for process in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.NoSuchProcess):
                cpu = process.cpu_times()
                total += cpu.user + cpu.system
    return total


def _rusage(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """Measures a block; `cores()` gives the mean cores used by the server, the load, and others.

    The load is this process and its children that ended during the block (hey, perf_analyzer,
    grpc_load.py, raw.py), which getrusage counts once they have been waited for.
    """

    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid

    def _snapshot(self) -> tuple[float, ...]:
        load = _rusage(resource.RUSAGE_CHILDREN) + _rusage(resource.RUSAGE_SELF)
        return time.monotonic(), _busy(), _tree_cpu(self.server_pid), load

    def __enter__(self) -> "CpuMeter":
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc) -> None:
        self._end = self._snapshot()

    def cores(self) -> dict[str, float]:
        """Mean cores of the server, the load and others over the block, and the server's CPU seconds."""
        wall, busy, server, load = (end - start for start, end in zip(self._start, self._end))
        return {
            "server_cpu_s": server,
            "server_cores": server / wall,
            "load_cores": load / wall,
            "other_cores": max(busy - server - load, 0.0) / wall,
        }


def wait_for_quiet(limit_cores: float = 0.2, patience_s: float = 20.0) -> float:
    """Before a point (the server idle): waits, at most `patience_s`, until the machine's busy
    cores drop below `limit_cores`. Returns the seconds waited; a point that still starts on a
    busy machine shows it in its other cores."""
    start = time.monotonic()
    while psutil.cpu_percent(interval=1.0) / 100 * psutil.cpu_count() >= limit_cores:
        if time.monotonic() - start >= patience_s:
            break
    return time.monotonic() - start

"""Device memory: what each loaded version takes, the budget of each device, and which models make room.

What a version takes is measured as it loads, per instance (`execution.memory_meter.measured`), and
kept by the version (`ServedVersion.memory`: device -> bytes):

- pyACL (`.om`): the device's free memory before and after the load, from `acl.rt.get_mem_info`
  in the loading context (the runtime reads it itself: `Runtime.memory_bytes`);
- ONNX Runtime's CANN execution provider: the same, through pyACL when it is importable; without
  pyACL the process's resident memory, which does not see the device's (said in the metadata);
- `sim`: what its `sim_memory_mb` allocates, as a simulated device's memory;
- the CPU runtimes (ONNX on the CPU, the processing steps): the process's resident memory
  before and after.

Loads run one at a time in the process, so each delta is one model's own. A config's
`parameters { key: "memory_mb" }` replaces the measurement (per instance). A loaded version holds
the larger of its estimate and its measurement (`Ledger.hold`).

A load is admitted before it touches a device (`Ledger.shortfall`): what it will take is
estimated per instance from, in order, `memory_mb`, the `sim` runtime's `sim_memory_mb`,
`acl.mdl.query_size` (work + weight) for an `.om`, what the same version took at its last load,
and last the model file's size. Versions loaded and loads admitted count against the device's
budget: `--memory_budget_mb` per device, or by default, where pyACL is present, the device's free
memory when it is first used less `RESERVE_MB`; none (unlimited) on a host without pyACL.

With `--load_on_demand` a load that does not fit first unloads the models used least recently
that nothing uses now (`Ledger.victims`, by their second-to-last use: LRU-2; the repository
decides what is evictable).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import ModelLoadError
from ..execution.runtimes import parameter, runtime_name

log = logging.getLogger(__name__)

MB = 1 << 20
#: Of an NPU's free memory when it is first used, what the default budget leaves to everything else that
#: allocates there (CANN's own buffers, operators compiled at run time, other processes).
RESERVE_MB = 1024
#: Bounds of the load wait histogram, seconds.
WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def configured_bytes(config: mc.ModelConfig) -> int | None:
    """`parameters { key: "memory_mb" }`: what one instance takes, as the operator says (None: measure)."""
    return _megabytes(config, "memory_mb")


def _megabytes(config: mc.ModelConfig, key: str) -> int | None:
    value = parameter(config, key)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = -1
    if not number >= 0:
        raise ModelLoadError(f"parameter {key} must be a non-negative number of MB, got {value!r}")
    return round(number * MB)


def sim_bytes(config: mc.ModelConfig) -> int:
    """`parameters { key: "sim_memory_mb" }` of a `sim` model: what each of its instances allocates."""
    return _megabytes(config, "sim_memory_mb") or 0


def estimate(config: mc.ModelConfig, path: Path, last: int | None, query_om: Callable[[Path], int | None]) -> int:
    """What one instance of a version will take, before it loads (see the module's doc for the order)."""
    configured = configured_bytes(config)
    if configured is not None:
        return configured
    name = runtime_name(config, path)
    if name == "sim":
        return sim_bytes(config)
    if name == "acl" and (queried := query_om(path)) is not None:
        return queried
    if last is not None:
        return last
    return path.stat().st_size if path.is_file() else 0


class Ledger:
    """Per device: its budget, the memory of the versions loaded and of the loads admitted; the models'
    order of use; and what the metrics count (loads by reason, evictions, waits for a load).

    Used on the event loop only (its readers on other threads copy containers first).
    `device_free(device)`: the device's (free, total) bytes where pyACL can tell, else None.
    """

    def __init__(self, budget_mb: float | None = None, device_free: Callable[[int], tuple[int, int] | None] = lambda d: None):
        self.budget_bytes = None if budget_mb is None else round(budget_mb * MB)
        self.device_free = device_free
        self._defaults: dict[int, int | None] = {}
        #: loaded versions: the served version -> (model name, device -> bytes)
        self.held: dict[object, tuple[str, dict[int, int]]] = {}
        #: loads admitted and under way: model name -> device -> bytes
        self.reserved: dict[str, dict[int, int]] = {}
        #: (model, version) -> bytes one instance took at its last load
        self.last: dict[tuple[str, int], int] = {}
        #: model -> the ticks of its last two uses (0: none)
        self.recent: dict[str, tuple[int, int]] = {}
        self._ticks = itertools.count(1)
        self.loads: collections.Counter[tuple[str, str]] = collections.Counter()
        self.evictions: collections.Counter[str] = collections.Counter()
        #: model -> [count per WAIT_BUCKETS_S bound and +Inf, sum of seconds]
        self.waits: dict[str, list] = {}

    # ------------------------------------------------------------ budgets

    def budget(self, device: int) -> int | None:
        """The device's budget in bytes (None: unlimited)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        if device not in self._defaults:
            reading = self.device_free(device)
            self._defaults[device] = None if reading is None else max(0, reading[0] - RESERVE_MB * MB)
            if reading is not None:
                log.info("device %d: %d MB free, a budget of %d MB (%d MB reserved)", device, reading[0] // MB,
                         self._defaults[device] // MB, RESERVE_MB)
        return self._defaults[device]

    def devices(self) -> list[int]:
        """The devices memory is held or budgeted on."""
        held = {d for _, memory in list(self.held.values()) for d in memory}
        return sorted(held | set(self._defaults) | {d for r in list(self.reserved.values()) for d in r} | {0})

    def used(self, device: int) -> int:
        """Bytes the loaded versions and the admitted loads hold on `device`."""
        return sum(memory.get(device, 0) for _, memory in list(self.held.values())) + sum(
            memory.get(device, 0) for memory in list(self.reserved.values())
        )

    def shortfall(self, need: Mapping[int, int]) -> dict[int, int]:
        """Device -> bytes missing for `need` to fit in the budgets ({}: it fits)."""
        short = {}
        for device, size in need.items():
            budget = self.budget(device)
            if budget is not None and size and self.used(device) + size > budget:
                short[device] = self.used(device) + size - budget
        return short

    def refusal(self, name: str, need: Mapping[int, int]) -> str:
        """Why `name`'s load does not fit, with both numbers for every device it does not fit on."""
        parts = [
            f"it needs {_mb(need[device])} on device {device}, where {_mb(self.used(device))} of the budget of"
            f" {_mb(self.budget(device))} are taken ({_mb(max(0, self.budget(device) - self.used(device)))} free)"
            for device in sorted(self.shortfall(need))
        ]
        return f"model '{name}' does not fit in the memory budget: " + "; ".join(parts)

    # ------------------------------------------------------------ what is held

    def reserve(self, name: str, need: Mapping[int, int]) -> None:
        self.reserved[name] = dict(need)

    def unreserve(self, name: str) -> None:
        self.reserved.pop(name, None)

    def hold(self, name: str, version, estimate: Mapping[int, int]) -> None:
        """A version of model `name` serves now: until it is released it holds, on each device, the larger of
        what it measured (`version.memory`) and what it was admitted for (`estimate`), so a measurement
        that missed some of it (memory freed elsewhere in the process meanwhile) lets no more in."""
        devices = set(version.memory) | set(estimate)
        self.held[version] = (name, {d: max(version.memory.get(d, 0), estimate.get(d, 0)) for d in devices})
        if version.memory:
            self.last[(name, version.version)] = max(getattr(version, "instance_memory", None) or [0])

    def release(self, version: object) -> None:
        self.held.pop(version, None)

    def held_by(self, name: str) -> dict[int, int]:
        """Device -> bytes the loaded versions of model `name` hold."""
        total: collections.Counter[int] = collections.Counter()
        for model, memory in list(self.held.values()):
            if model == name:
                total.update(memory)
        return dict(total)

    # ------------------------------------------------------------ use and eviction

    def touch(self, name: str) -> None:
        """`name` was just used (the one cost on the hot path)."""
        last = self.recent.get(name)
        self.recent[name] = (next(self._ticks), last[0] if last is not None else 0)

    def victims(self, short: Mapping[int, int], evictable: Iterable[str]) -> list[str] | None:
        """The models used least recently, among `evictable`, whose unloading covers `short`; None if they cannot."""
        left = dict(short)
        chosen = []
        for name in sorted(evictable, key=self._age):
            freed = self.held_by(name)
            if not any(freed.get(device, 0) for device in left):
                continue  # frees nothing where room is needed
            chosen.append(name)
            for device in list(left):
                left[device] -= freed.get(device, 0)
                if left[device] <= 0:
                    del left[device]
            if not left:
                return chosen
        return None

    def _age(self, name: str) -> tuple[int, int]:
        """Smaller for a model used less recently, by its second-to-last use, then its last (LRU-2, O'Neil et al.,
        "The LRU-K page replacement algorithm", SIGMOD 1993): a model asked for once, as a cold one is, goes before
        one in steady use that happens not to have been asked for in the last few milliseconds."""
        last, previous = self.recent.get(name, (0, 0))
        return previous, last

    def waited(self, name: str, seconds: float) -> None:
        """A request waited `seconds` for `name` to load."""
        counts = self.waits.get(name)
        if counts is None:
            counts = self.waits[name] = [[0] * (len(WAIT_BUCKETS_S) + 1), 0.0]
        counts[0][bisect.bisect_left(WAIT_BUCKETS_S, seconds)] += 1  # the first bound >= seconds (+Inf past the last)
        counts[1] += seconds


def _mb(size: int | None) -> str:
    return "unlimited" if size is None else f"{size / MB:.0f} MB"


class OutOfBudget(ModelLoadError):
    """A load would exceed a device's memory budget (refused before it touched the device)."""

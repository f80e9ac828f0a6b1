"""Triton's rate limiter (`--rate_limit execution_count`): one per server, shared by every model's instances.

An instance group's `rate_limiter { resources [ { name count global } ] priority }` says what each
of its instances needs to run an execution. An instance holds those resources while it executes
(per device, or across the server for a `global` one) and runs only when all of them are free.
Instances waiting for resources run in order of their executions so far times their priority
(0 counts as 1), the fewest first: a priority 2 instance gets half the turns of a priority 1
instance it competes with. The first in that order waits for its resources while those behind
it wait too, as in Triton.

How many of a resource the server has: without `--rate_limit_resource`, the most any registered
instance needs; with it, what the flags give (a flag without a device applies to every device,
a global resource takes the largest count given for its name), and a resource no flag names is
limited to 0. A version whose instances need more is refused at load in Triton's words.

Triton's core src/rate_limiter.cc is the reference for every rule (ResourceManager's
ParseAndValidateExplicitResources and ValidateMaxResources, ModelInstanceContext::ScaledPriority,
RateLimiter::AttemptAllocation). Unlike Triton, which allocates one staged instance per release
or staging, a release here grants every waiting instance whose turn it is and whose resources are
free, in the same order.

Instances call `Gate.acquire` and `Gate.release` from their own threads around each execution
(the event loop never waits here): a waiting instance sleeps on its own event, woken when granted.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterable, Sequence

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import ModelLoadError

#: The key of global resources among device ids (Triton's GLOBAL_RESOURCE_KEY).
GLOBAL = -2
#: The device of a `--rate_limit_resource` that names none: every device (Triton's PER_DEVICE_RESOURCE_KEY).
EVERY_DEVICE = -1

#: device (or GLOBAL) -> resource name -> count
Resources = dict[int, dict[str, int]]

RESOURCE_FORMAT = "'<resource_name>:<count>:<device>' or '<resource_name>:<count>'"


def parse_resource(text: str) -> tuple[str, int, int]:
    """`--rate_limit_resource NAME:COUNT[:DEVICE]` as (name, count, device or EVERY_DEVICE); ValueError says the format."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError
        count, device = int(parts[1]), int(parts[2]) if len(parts) == 3 else EVERY_DEVICE
        if count < 0 or device < EVERY_DEVICE:
            raise ValueError
    except ValueError:
        raise ValueError(f"format is {RESOURCE_FORMAT} (count and device non-negative integers), got {text!r}") from None
    return parts[0], count, device


class Gate:
    """One instance's way through the rate limiter: `acquire` before each execution, `release` after."""

    __slots__ = ("_granted", "executions", "holding", "limiter", "needs", "priority", "registered")

    def __init__(self, limiter: RateLimiter, config: mc.ModelRateLimiter, device_id: int):
        self.limiter = limiter
        self.priority = max(config.priority, 1)
        self.needs: Resources = {}
        for resource in config.resources:
            key = GLOBAL if getattr(resource, "global") else device_id  # `global` is a Python keyword
            self.needs.setdefault(key, {})[resource.name] = resource.count
        #: Executions it ran: with its priority, its place among the instances waiting.
        self.executions = 0
        self._granted = threading.Event()
        self.registered = True
        #: Whether it holds its resources (from its grant to its release).
        self.holding = False

    def acquire(self) -> None:
        """Blocks this instance's thread until its resources are its own and it is its turn."""
        self.limiter._stage(self)
        self._granted.wait()
        self._granted.clear()

    def release(self) -> None:
        """The execution is over: its resources go to the instances waiting, in turn."""
        self.limiter._release(self)

    def _grant(self) -> None:
        self._granted.set()


class RateLimiter:
    """The server's resources and the instances competing for them (`--rate_limit execution_count`).

    `resources`: the `--rate_limit_resource` flags as (name, count, device or EVERY_DEVICE).
    """

    def __init__(self, resources: Iterable[tuple[str, int, int]] = ()):
        self._given: Resources = {}
        for name, count, device in resources:
            self._given.setdefault(device, {})[name] = count
        self._lock = threading.Lock()
        self._gates: list[Gate] = []
        #: How many of each resource the server has, given the instances registered (see `_capacity`).
        self._capacity: Resources = {}
        self._allocated: dict[tuple[int, str], int] = {}
        #: Instances waiting for their resources: (executions × priority, arrival, gate), least first.
        self._staged: list[tuple[int, int, Gate]] = []
        self._arrivals = itertools.count()

    def register(self, instances: Sequence[tuple[int, mc.ModelRateLimiter]]) -> list[Gate]:
        """Gates for a version's instances, (device id, its group's rate_limiter) each; ModelLoadError, in
        Triton's words, if the server has not the resources they need (then none is registered)."""
        gates = [Gate(self, config, device) for device, config in instances]
        with self._lock:
            self._gates += gates
            try:
                self._capacity = self._count_capacity()
            except ModelLoadError:
                self._gates = [g for g in self._gates if g not in gates]
                raise
        return gates

    def unregister(self, gates: Iterable[Gate]) -> None:
        """The version's instances leave (it retired, or failed to load): what they hold is freed, and an
        instance still waiting goes on (ungated) so that its thread can be shut down."""
        with self._lock:
            for gate in gates:
                if not gate.registered:
                    continue  # (released once already)
                gate.registered = False
                self._gates.remove(gate)
                if gate.holding:  # an execution that never returned (a hung device call)
                    self._take(gate, -1)
            waiting = [entry for entry in self._staged if not entry[2].registered]
            if waiting:
                self._staged = [entry for entry in self._staged if entry[2].registered]
                heapq.heapify(self._staged)
            self._capacity = self._count_capacity(check=False)
            self._allocate()
        for _, _, gate in waiting:
            gate._grant()

    def _count_capacity(self, check: bool = True) -> Resources:
        """Triton's ParseAndValidateResources: the most any instance needs of each resource, or what the flags
        give; ModelLoadError (if `check`) for a need above what is given, or a name both global and per device."""
        most: Resources = {}
        for gate in self._gates:
            for key, needs in gate.needs.items():
                for name, count in needs.items():
                    most.setdefault(key, {})[name] = max(count, most.get(key, {}).get(name, 0))
        if self._given:
            for key in sorted(most):
                for name in sorted(most[key]):
                    given = self._given_count(key, name)
                    if check and given < most[key][name]:
                        raise ModelLoadError(
                            f'Resource count for "{name}" is limited to {given} which will prevent scheduling of one'
                            f" or more model instances, the minimum required count is {most[key][name]}"
                        )
                    most[key][name] = given
        for name in sorted(most.get(GLOBAL, ())):
            if check and any(name in needs for key, needs in most.items() if key != GLOBAL):
                raise ModelLoadError(
                    f'Resource "{name}" is present as both global and device-specific resource in the model configuration.'
                )
        return most

    def _given_count(self, key: int, name: str) -> int:
        """What the flags give of a resource: global, the largest count given for its name on any device."""
        if key == GLOBAL:
            return max((given[name] for given in self._given.values() if name in given), default=0)
        return max(self._given.get(key, {}).get(name, 0), self._given.get(EVERY_DEVICE, {}).get(name, 0))

    def _stage(self, gate: Gate) -> None:
        with self._lock:
            if not gate.registered:
                gate._grant()
                return
            heapq.heappush(self._staged, (gate.executions * gate.priority, next(self._arrivals), gate))
            self._allocate()

    def _release(self, gate: Gate) -> None:
        with self._lock:
            gate.executions += 1
            if gate.holding:
                self._take(gate, -1)
                self._allocate()

    def _allocate(self) -> None:
        """Under the lock: grants the waiting instances in turn while the first one's resources are free."""
        while self._staged:
            gate = self._staged[0][2]
            if not self._free(gate):
                return
            heapq.heappop(self._staged)
            self._take(gate, 1)
            gate._grant()

    def _take(self, gate: Gate, sign: int) -> None:
        """Allocates (1) or frees (-1) the gate's resources."""
        gate.holding = sign > 0
        for key, needs in gate.needs.items():
            for name, count in needs.items():
                self._allocated[key, name] = self._allocated.get((key, name), 0) + sign * count

    def _free(self, gate: Gate) -> bool:
        return all(
            self._allocated.get((key, name), 0) + count <= self._capacity.get(key, {}).get(name, 0)
            for key, needs in gate.needs.items()
            for name, count in needs.items()
        )

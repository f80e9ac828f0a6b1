"""The model repository: one directory per model in Triton's layout, and the models' lifecycle.

    <root>/<model>/config.pbtxt
    <root>/<model>/<version>/model.onnx | model.om | model.sim

Loads and unloads run one at a time per model. A version taken out of service is retired
after the switch: requests already holding it finish there, new ones go to the new set.
As in Triton, loading an ensemble first loads the models its steps run that are not loaded;
an ensemble is loaded again (checked against its steps anew) when one of them is, and unloaded
with it when one of them is unloaded, to come back when that one is loaded again. Unloading a
model with its dependents (Triton's `unload_dependents`) also unloads the step models that were
loaded only along with it and that no other loaded ensemble runs (Triton's cascading removal,
core's model_repository_manager.cc `DependencyGraph::RemoveNodes`).

Memory (`memory.Ledger`): a load is admitted before it touches a device, against each device's
budget, or refused with both numbers. With `load_on_demand` every model is known from the start
and loaded when a request first asks for it (`wait_until_loaded`: one load however many ask, a
failed one tried again only after a back-off); a load that does not fit first unloads the models
used least recently that nothing is using (no request in flight or waiting, no ensemble running
them, not being loaded with it), never a pinned one (`pinned`, or config `pinned: "true"`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import watchfiles
from tritonclient.grpc import model_config_pb2 as mc

from .. import config as cfg
from ..cache import ResponseCache
from ..contracts import ServedVersion
from ..errors import AscendError, InvalidInput, ModelLoadError, ModelNotFound, ModelNotReady, Unavailable
from ..execution.loading import file_stamp
from ..execution.runtimes import parameter
from ..scheduling.rate_limiter import RateLimiter
from . import ensemble, memory
from .model import Model

log = logging.getLogger(__name__)

#: A changed model directory is loaded once its files have kept their size and mtime this long,
#: so a file still being copied is never loaded.
SETTLE_S = 1.0
#: A model that failed to load on demand is tried again after this long, doubled at each failure up to RETRY_MAX_S.
RETRY_S = 1.0
RETRY_MAX_S = 60.0


class Repository:
    """`cache`, `rate_limiter`: the server's response cache (`--cache_config`) and rate limiter (`--rate_limit
    execution_count`), shared by every model (None: none); `ledger`: what the devices hold and may hold
    (`--memory_budget_mb`); `load_on_demand`, `pinned`: `--load_on_demand` and the models it never unloads."""

    def __init__(
        self,
        root: Path | str,
        cache: ResponseCache | None = None,
        rate_limiter: RateLimiter | None = None,
        ledger: memory.Ledger | None = None,
        load_on_demand: bool = False,
        pinned: Iterable[str] = (),
    ):
        # Absolute: the watcher reports absolute paths, which must be under the root as given (a relative
        # --model_dir in poll mode once crashed the server on the first change), and the cwd may change.
        self.root = Path(root).absolute()
        #: The server's response cache (`--cache_config`), which the versions of models enabling it use.
        self.cache = cache
        if not self.root.is_dir():
            raise FileNotFoundError(f"model repository {self.root} is not a directory")
        #: Called (on the event loop) whenever what the repository serves changed: a model loaded, unloaded, removed
        #: or unavailable (the engine of `--workers N` tells its frontends, which cache models' metadata).
        self.on_change: Callable[[], None] = lambda: None
        self.rate_limiter = rate_limiter
        self.models: dict[str, Model] = {name: self._model(name, path) for name, path in self._directories().items()}
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        #: ensemble -> the models its steps run, as its config said when last loaded
        self._steps: dict[str, list[str]] = {}
        #: ensembles unloaded because a step model was: loaded again with it
        self._held: set[str] = set()
        #: step models loaded only because an ensemble needed them (not asked for by name)
        self._along: set[str] = set()
        #: what the devices hold and may hold, the order models were used in, the loads and evictions
        self.memory = ledger if ledger is not None else memory.Ledger()
        self.load_on_demand = load_on_demand
        #: models never unloaded to make room (`--load_model`; config `pinned: "true"` pins too)
        self.pinned = set(pinned)
        self._loading: set[str] = set()  # models whose load holds their lock
        self._waiting: collections.Counter[str] = collections.Counter()  # requests waiting for a model to load
        self._on_demand: dict[str, asyncio.Future] = {}  # the one load on demand under way per model
        self._failed: dict[str, tuple[float, str, float]] = {}  # model -> (retry at, reason, back-off), on demand
        self._change = asyncio.Event()  # set (and replaced) when a model was loaded or unloaded
        #: Loads are admitted and made one at a time (their device work is measured one at a time anyway), so each
        #: admission sees what the loads before it took and the evictions sees every model they loaded in use.
        self._admission = asyncio.Lock()

    def _model(self, name: str, path: Path) -> Model:
        return Model(name, path, self.get, lambda: self.on_change(), self.cache, self.rate_limiter)

    def _directories(self) -> dict[str, Path]:
        return {
            path.name: path for path in sorted(self.root.iterdir()) if path.is_dir() and not path.name.startswith(".")
        }

    def get(self, name: str) -> Model:
        try:
            return self.models[name]
        except KeyError:
            self.check_name(name)  # only now: a served model's name is a directory's, valid by construction
            # Triton's wording, which clients (and Triton's own examples) match on.
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found") from None

    def check_name(self, name: str) -> None:
        """Raises InvalidInput unless `name` can only mean a directory directly under the repository.

        Clients name models in URLs and messages, so `..`, separators, hidden and
        over-long names are refused before the name comes near a path. Symbolic links
        the operator put in the repository are followed, as Triton does.
        """
        if (
            not name
            or name.startswith(".")
            or any(c in name for c in "/\\\0")
            or len(os.fsencode(name)) > 255  # NAME_MAX
            or os.path.dirname(os.path.abspath(self.root / name)) != os.path.abspath(self.root)
        ):
            raise InvalidInput(
                f"invalid model name {name[:100]!r}: a model is named by one directory of the repository "
                "(no '/', '\\', leading '.', or more than 255 bytes)"
            )

    @property
    def ready(self) -> bool:
        """True when every model meant to serve is ready (Triton's strict readiness)."""
        return all(model.ready for model in self.models.values() if model.requested)

    def index(self) -> list[dict]:
        """Triton's repository index: name, version, state and reason of every model (and each file's sha256, and
        what Triton needs to serve the model alike where it needs more than the repository: `triton`)."""
        entries = []
        for model in list(self.models.values()):
            versions = dict(model.versions)
            if versions:
                note = {"triton": model.triton_needs} if model.triton_needs else {}
                entries += [
                    {"name": model.name, "version": str(v), "state": model.state.value, "reason": model.reason,
                     "sha256": served.sha256, "memory_bytes": sum(served.memory.values()), **note}
                    for v, served in versions.items()
                ]
            else:
                entries.append({"name": model.name, "state": model.state.value, "reason": model.reason})
        return entries

    async def load(
        self, name: str, override: mc.ModelConfig | None = None, reason: str = "explicit", wait: bool = False
    ) -> None:
        """Loads (or reloads) a model; raises ModelLoadError, with what served before serving on.

        `reason` (startup, explicit, poll, on_demand) is what the metrics count it under; `wait`: a load
        that must make room may wait for models in use to finish their requests (on demand) rather than
        be refused."""
        if name not in self.models:
            self.check_name(name)
            if not (self.root / name).is_dir():  # before a lock is made for the name
                raise ModelNotFound(f"Request for unknown model: '{name}' has no directory in the repository")
        self._along.discard(name)
        await self._load(name, override, {name}, reason, wait)

    async def _load(self, name: str, override: mc.ModelConfig | None, visiting: set[str], reason: str, wait: bool) -> None:
        """Loads `name` after the step models it needs, then reloads the ensembles that run it."""
        self._held.discard(name)
        steps = self._steps[name] = await asyncio.to_thread(_step_models, self.root / name, override)
        for step in steps:
            model = self.models.get(step)
            if step not in visiting and (model is None or not model.requested) and (self.root / step).is_dir():
                visiting.add(step)
                self._along.add(step)
                try:
                    await self._load(step, None, visiting, reason, wait)
                except AscendError as error:  # the ensemble's load says which step failed
                    log.error("model '%s', a step of ensemble '%s', did not load: %s", step, name, error)
        async with self._locks[name]:
            model = self.models.get(name)
            if model is None:
                model = self.models[name] = self._model(name, self.root / name)
            retired = await self._load_admitted(model, override, visiting, wait)
            self.memory.loads[(name, reason)] += 1
            await self._retire(retired)
        for dependent in self._dependents(name):
            if dependent not in visiting and (self.models[dependent].requested or dependent in self._held):
                visiting.add(dependent)
                try:
                    await self._load(dependent, None, visiting, reason, wait)
                except AscendError as error:
                    log.error("ensemble '%s' did not reload after its step '%s' did: %s", dependent, name, error)

    async def _load_admitted(
        self, model: Model, override: mc.ModelConfig | None, protected: set[str], wait: bool
    ) -> list[ServedVersion]:
        """Loads `model` once the memory its new versions will take is admitted (`_make_room`); the versions
        it took out of service. Called under the model's lock."""
        name = model.name
        self._loading.add(name)
        try:
            estimates = await asyncio.to_thread(self._estimates, model, override)
            need: collections.Counter[int] = collections.Counter()
            for estimate in estimates.values():
                need.update(estimate)
            async with self._admission:  # one at a time: each decides on what the one before left
                try:
                    await self._make_room(name, dict(need), protected, wait)
                except ModelLoadError as error:
                    model.refuse(str(error))
                    self.on_change()
                    raise
                try:
                    retired = await asyncio.to_thread(model.load, override)
                finally:
                    self.memory.unreserve(name)
                    self.on_change()  # serving the new versions, or the reason it failed
            for served in model.versions.values():
                if served not in self.memory.held:
                    self.memory.hold(name, served, estimates.get(served.version, {}))
            return retired
        finally:
            self._loading.discard(name)
            self._changed()

    async def unload(self, name: str, with_steps: bool = False) -> None:
        """Stops serving a model once the requests it holds are answered (and the ensembles that run it).

        `with_steps` (Triton's `unload_dependents`): then also the step models it loaded along with
        it that nothing else loaded still runs, and theirs in turn.
        """
        self.get(name)  # an unknown or invalid name raises before a lock is made for it
        self._held.discard(name)
        self._along.discard(name)
        async with self._locks[name]:
            retired = self.get(name).unload()
            self.on_change()
            await self._retire(retired)
        await self._unload_dependents(name)
        if with_steps:
            for step in self._steps.get(name, []):
                if step in self._along and step in self.models and not self._runs(step):
                    log.info("model '%s', loaded along with '%s', is unloaded with it", step, name)
                    await self.unload(step, with_steps=True)

    def _runs(self, step: str) -> bool:
        """Whether a loaded ensemble runs `step`."""
        return any(self.models[e].requested for e in self._dependents(step))

    async def remove(self, name: str) -> None:
        """Unloads a model whose directory is gone and drops it from the index."""
        self._steps.pop(name, None)
        self._held.discard(name)
        self._along.discard(name)
        async with self._locks[name]:
            model = self.models.pop(name, None)
            if model is not None:
                retired = model.unload()
                self.on_change()
                await self._retire(retired)
        await self._unload_dependents(name)

    def _dependents(self, name: str) -> list[str]:
        """The ensembles of the repository whose steps run `name`."""
        return [e for e, steps in list(self._steps.items()) if name in steps and e != name and e in self.models]

    async def _unload_dependents(self, name: str) -> None:
        for dependent in self._dependents(name):
            if self.models[dependent].requested:
                log.info("ensemble '%s' is unloaded with its step '%s'", dependent, name)
                await self.unload(dependent)
                self._held.add(dependent)

    async def follow(self, stop: asyncio.Event | None = None) -> AsyncIterator[set[str]]:
        """Poll mode: applies every change of the repository on disk; yields the models it changed.

        A new or changed model directory is (re)loaded once its files have settled; a
        removed one is unloaded. A model that fails to reload keeps serving what it served.
        """
        async for changes in watchfiles.awatch(self.root, stop_event=stop, recursive=True):
            names = {Path(path).relative_to(self.root).parts[0] for _, path in changes if Path(path) != self.root}
            names = {n for n in names if not n.startswith(".")}
            try:
                await self._apply(names)
            except Exception:  # the server goes on serving what it serves, and on watching
                log.exception("the repository's changes to %s could not be applied", sorted(names))
            yield names

    async def _apply(self, names: set[str]) -> None:
        await self._settle(names)
        present = self._directories()
        for name in sorted(names):
            if name not in present:
                log.info("model '%s' left the repository", name)
                await self.remove(name)
                continue
            if self.load_on_demand and not (name in self.models and self.models[name].requested):
                self.models.setdefault(name, self._model(name, present[name]))  # known; loaded when asked for
                self.on_change()
                continue
            try:
                await self.load(name, reason="poll")
            except Exception as error:  # recorded as the model's reason; the others go on
                log.error("model '%s' did not reload: %s", name, error)

    async def _settle(self, names: set[str]) -> None:
        """Waits until no file of these models changes for SETTLE_S (the directory walks off the event loop)."""
        before = await asyncio.to_thread(self._stamps, names)
        while True:
            await asyncio.sleep(SETTLE_S)
            after = await asyncio.to_thread(self._stamps, names)
            if after == before:
                return
            before = after

    def _stamps(self, names: set[str]) -> dict[Path, tuple[int, int]]:
        stamps = {}
        for name in names:
            for path in (self.root / name).rglob("*"):
                try:
                    if path.is_file():
                        stamps[path] = file_stamp(path)
                except FileNotFoundError:
                    continue  # removed while looking
        return stamps


    async def _retire(self, versions: list[ServedVersion]) -> None:
        """Retires versions taken out of service (each once its requests are answered); their memory is free then."""
        await asyncio.gather(*(version.retire() for version in versions))
        for version in versions:
            self.memory.release(version)
        if versions:
            self._changed()

    # ------------------------------------------------------------ memory and loading on demand

    def touch(self, name: str) -> None:
        """A request for `name` (and so for the steps of an ensemble): the most recently used now. Only loading on
        demand chooses by use (`Ledger.victims`): without it a request does no such work."""
        if not self.load_on_demand:
            return
        self.memory.touch(name)
        for step in self._steps.get(name, ()):
            self.memory.touch(step)

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    def _estimates(self, model: Model, override: mc.ModelConfig | None) -> dict[int, dict[int, int]]:
        """Version -> device -> bytes, what each version this load adds will take, estimated before anything is
        loaded (blocking: reads the config and, for an `.om`, asks pyACL). {} where the load itself will fail."""
        try:
            config = mc.ModelConfig()
            config.CopyFrom(override if override is not None else cfg.read_config(model.model_dir))
            config.name = config.name or model.name
            if ensemble.is_ensemble(config):
                return {}
            source = config.SerializeToString(deterministic=True)
            versions = cfg.select_versions(config, cfg.available_versions(model.model_dir))
            estimates: dict[int, dict[int, int]] = {}
            for version in versions:
                current = model.versions.get(version)
                if current is not None and current.healthy and current.unchanged(source, model.model_dir):
                    continue  # serves on as it is
                completed = mc.ModelConfig.FromString(source)  # per version, as ModelVersion.load completes it
                path = cfg.model_file(completed, model.model_dir / str(version))
                cfg.complete_backend(completed, path)  # before the placement: the backend sets default instance counts
                devices = cfg.device_placement(completed)
                last = self.memory.last.get((model.name, version))
                # One instance's estimate, asked once (an `.om` is queried on its first device): the same on each.
                each = memory.estimate(completed, path, last, lambda p, d=devices[0]: _query_om(p, d))
                need = estimates[version] = collections.Counter()
                for device in devices:
                    need[device] += each
        except Exception as error:  # the load reports what is wrong
            log.debug("no memory estimate for model '%s': %s", model.name, error)
            return {}
        for device in {d for need in estimates.values() for d in need}:
            self.memory.budget(device)  # a device's first budget reads its free memory: here, off the loop
        return {version: dict(need) for version, need in estimates.items()}

    async def _make_room(self, name: str, need: dict[int, int], protected: set[str], wait: bool) -> None:
        """Admits `name`'s load (reserving `need`), on demand after unloading models used least recently;
        OutOfBudget, before anything is loaded, if it cannot fit."""
        while short := self.memory.shortfall(need):
            refusal = self.memory.refusal(name, need)
            if not self.load_on_demand:
                raise memory.OutOfBudget(refusal)
            victims = self.memory.victims(short, [m for m in list(self.models) if self._evictable(m, protected)])
            if victims is None:
                if not wait or self.memory.victims(short, [m for m in list(self.models) if self._unpinned(m, protected)]) is None:
                    raise memory.OutOfBudget(f"{refusal}, and the models that could make room are pinned or in use")
                await self._next_change()  # a model in use finishes its requests, or one is unloaded
                continue
            for victim in victims:
                log.info("model '%s' is unloaded to make room for model '%s'", victim, name)
                self.memory.evictions[victim] += 1
                await self.unload(victim)
        self.memory.reserve(name, need)

    def _unpinned(self, name: str, protected: set[str]) -> bool:
        model = self.models.get(name)
        return (
            model is not None and bool(model.versions) and name not in protected and name not in self.pinned
            and parameter(model.config, "pinned", "false").lower() != "true"
        )

    def _evictable(self, name: str, protected: set[str]) -> bool:
        """Whether unloading `name` now loses nothing: unpinned, no request in flight or waiting for it or for
        an ensemble that runs it, and not being loaded."""
        if not self._unpinned(name, protected) or self._in_use(name):
            return False
        return not any(self._in_use(e) for e in self._dependents(name))

    def _in_use(self, name: str) -> bool:
        model = self.models.get(name)
        return (
            name in self._loading or self._waiting[name] > 0
            or (model is not None and any(v.scheduler.outstanding for v in list(model.versions.values())))
        )

    async def _next_change(self) -> None:
        """Waits until a loaded model finishes the requests it holds, or a model is loaded or unloaded."""
        versions = [v for m in list(self.models.values()) for v in list(m.versions.values()) if v.scheduler.outstanding]
        waits = [asyncio.ensure_future(v.scheduler.drain()) for v in versions]
        waits.append(asyncio.ensure_future(self._change.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    async def wait_until_loaded(self, name: str, deadline: float | None) -> None:
        """On demand: returns once `name` is ready, loading it if no load of it is under way (one for all who wait).

        `deadline` (time.perf_counter) bounds the wait: Unavailable past it. A model whose load failed answers
        ModelNotReady with the reason until its back-off has passed, then is tried again. The caller goes on to
        its request without awaiting anything: nothing can unload the model in between."""
        model = self.get(name)
        self._waiting[name] += 1
        try:
            while not model.ready:
                failed = self._failed.get(name)
                now = time.perf_counter()
                if failed is not None and failed[0] > now:
                    raise ModelNotReady(
                        f"model '{name}' failed to load: {failed[1]} (tried again in {failed[0] - now:.1f} s)"
                    )
                loading = self._on_demand.get(name)
                if loading is None:
                    loading = self._on_demand[name] = asyncio.ensure_future(self._load_on_demand(name))
                timeout = None if deadline is None else deadline - now
                if timeout is not None and timeout <= 0:
                    raise Unavailable(f"Request timeout expired: it waited for model '{name}' to load past its timeout")
                try:
                    await asyncio.wait_for(asyncio.shield(loading), timeout)
                except asyncio.TimeoutError:
                    raise Unavailable(
                        f"Request timeout expired: it waited for model '{name}' to load past its timeout"
                    ) from None
                except AscendError:
                    continue  # its reason, from _failed
                model = self.get(name)
        finally:
            self._waiting[name] -= 1

    async def _load_on_demand(self, name: str) -> None:
        try:
            await self.load(name, reason="on_demand", wait=True)
        except AscendError as error:
            model = self.models.get(name)
            if model is not None and not model.versions:
                model.requested = False  # not meant to serve until asked again: the server stays ready
            backoff = min(RETRY_MAX_S, self._failed[name][2] * 2) if name in self._failed else RETRY_S
            self._failed[name] = (time.perf_counter() + backoff, str(error), backoff)
            log.error("model '%s' failed to load on demand (tried again after %g s): %s", name, backoff, error)
            raise
        else:
            self._failed.pop(name, None)
        finally:
            self._on_demand.pop(name, None)

    def record_wait(self, name: str, seconds: float) -> None:
        self.memory.waited(name, seconds)


def _query_om(path: Path, device: int) -> int | None:
    """`acl.mdl.query_size` of an `.om` where pyACL is importable, else None."""
    from ..execution.runtimes.acl import AclRuntime

    try:
        return AclRuntime.query_size(path, device)
    except AscendError:
        return None


def _step_models(model_dir: Path, override: mc.ModelConfig | None) -> list[str]:
    """The models an ensemble's steps run ([] for another model, or a config that does not parse)."""
    try:
        return ensemble.step_models(override if override is not None else cfg.read_config(model_dir))
    except AscendError:
        return []  # the model's own load reports it


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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import watchfiles
from tritonclient.grpc import model_config_pb2 as mc

from .. import config as cfg
from ..cache import ResponseCache
from ..contracts import ServedVersion
from ..errors import AscendError, InvalidInput, ModelNotFound
from ..execution.loading import file_stamp
from ..scheduling.rate_limiter import RateLimiter
from . import ensemble
from .model import Model

log = logging.getLogger(__name__)

#: A changed model directory is loaded once its files have kept their size and mtime this long,
#: so a file still being copied is never loaded.
SETTLE_S = 1.0


class Repository:
    """`cache`, `rate_limiter`: the server's response cache (`--cache_config`) and rate limiter (`--rate_limit
    execution_count`), shared by every model; None: none."""

    def __init__(self, root: Path | str, cache: ResponseCache | None = None, rate_limiter: RateLimiter | None = None):
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
                    {"name": model.name, "version": str(v), "state": model.state.value, "reason": model.reason, "sha256": served.sha256, **note}
                    for v, served in versions.items()
                ]
            else:
                entries.append({"name": model.name, "state": model.state.value, "reason": model.reason})
        return entries

    async def load(self, name: str, override: mc.ModelConfig | None = None) -> None:
        """Loads (or reloads) a model; raises ModelLoadError, with what served before serving on."""
        if name not in self.models:
            self.check_name(name)
            if not (self.root / name).is_dir():  # before a lock is made for the name
                raise ModelNotFound(f"Request for unknown model: '{name}' has no directory in the repository")
        self._along.discard(name)
        await self._load(name, override, {name})

    async def _load(self, name: str, override: mc.ModelConfig | None, visiting: set[str]) -> None:
        """Loads `name` after the step models it needs, then reloads the ensembles that run it."""
        self._held.discard(name)
        steps = self._steps[name] = await asyncio.to_thread(_step_models, self.root / name, override)
        for step in steps:
            model = self.models.get(step)
            if step not in visiting and (model is None or not model.requested) and (self.root / step).is_dir():
                visiting.add(step)
                self._along.add(step)
                try:
                    await self._load(step, None, visiting)
                except AscendError as error:  # the ensemble's load says which step failed
                    log.error("model '%s', a step of ensemble '%s', did not load: %s", step, name, error)
        async with self._locks[name]:
            model = self.models.get(name)
            if model is None:
                model = self.models[name] = self._model(name, self.root / name)
            try:
                retired = await asyncio.to_thread(model.load, override)
            finally:
                self.on_change()  # serving the new versions, or the reason it failed
            await _retire(retired)
        for dependent in self._dependents(name):
            if dependent not in visiting and (self.models[dependent].requested or dependent in self._held):
                visiting.add(dependent)
                try:
                    await self._load(dependent, None, visiting)
                except AscendError as error:
                    log.error("ensemble '%s' did not reload after its step '%s' did: %s", dependent, name, error)

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
            await _retire(retired)
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
                await _retire(retired)
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
            try:
                await self.load(name)
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


def _step_models(model_dir: Path, override: mc.ModelConfig | None) -> list[str]:
    """The models an ensemble's steps run ([] for another model, or a config that does not parse)."""
    try:
        return ensemble.step_models(override if override is not None else cfg.read_config(model_dir))
    except AscendError:
        return []  # the model's own load reports it


async def _retire(versions: list[ServedVersion]) -> None:
    await asyncio.gather(*(version.retire() for version in versions))

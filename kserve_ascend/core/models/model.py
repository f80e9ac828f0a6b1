"""A model of the repository: its directory, its state and the versions it serves."""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from .. import config as cfg
from ..cache import ResponseCache
from ..contracts import ServedVersion
from ..errors import ModelLoadError, ModelNotFound, ModelNotReady
from ..scheduling.rate_limiter import RateLimiter
from . import ensemble
from .version import ModelVersion

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    """Model states with the names of Triton's repository index."""

    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"


class Model:
    """A model directory of the repository and the versions it serves.

    `load` and `unload` change which versions serve in one assignment of `versions`, so a
    request sees either the old set or the new one; versions taken out are returned to
    the caller, who retires them (drains, then releases their devices).
    """

    def __init__(
        self,
        name: str,
        model_dir: Path,
        models: Callable[[str], Model] | None = None,
        on_unavailable: Callable[[], None] = lambda: None,
        cache: ResponseCache | None = None,
        rate_limiter: RateLimiter | None = None,
    ):
        self.name = name
        self.model_dir = model_dir
        #: The repository's models by name, for an ensemble's steps.
        self.models = models
        #: Told when a served version can no longer serve (the repository tells who follows it).
        self.on_unavailable = on_unavailable
        #: The server's response cache: versions use it when their config enables it (`response_cache`).
        self.cache = cache
        #: The server's rate limiter, which its versions' instances go through (None: --rate_limit off).
        self.rate_limiter = rate_limiter
        self.config = mc.ModelConfig(name=name)
        self.versions: dict[int, ServedVersion] = {}
        self.weights: dict[int, float] = {}
        self.state = State.UNAVAILABLE
        self.reason = "unloaded"
        #: What Triton needs to serve the model as this server does (config.triton_needs), "" when nothing.
        self.triton_needs = ""
        #: Whether the model is meant to serve (loaded or being loaded): what server readiness waits for.
        self.requested = False
        self._choose = random.Random().choices

    @property
    def ready(self) -> bool:
        return self.state is State.READY and not self.waiting_for

    @property
    def waiting_for(self) -> str:
        """What a served version waits for (an ensemble: a step model not ready), "" when nothing."""
        return next((reason for v in list(self.versions.values()) if (reason := v.waiting_for)), "")

    def mark_loading(self) -> None:
        """LOADING, unless a version serves (it serves on while the model reloads)."""
        if not self.versions:
            self.state, self.reason = State.LOADING, "loading"

    def load(self, override: mc.ModelConfig | None = None) -> list[ServedVersion]:
        """Serves what the directory (or `override`, a config to use instead of config.pbtxt) describes.

        Blocking: call it off the event loop. Versions whose config and file are unchanged
        go on serving; new or changed ones load beside them. Raises ModelLoadError if any
        fails, and then whatever served before goes on serving. Returns the versions taken
        out of service.
        """
        self.requested = True
        self.mark_loading()
        loaded: dict[int, ServedVersion] = {}
        try:
            config = mc.ModelConfig()
            config.CopyFrom(override) if override is not None else config.CopyFrom(cfg.read_config(self.model_dir))
            config.name = config.name or self.name
            cfg.check_supported(config)
            source = config.SerializeToString(deterministic=True)
            weights = cfg.version_weights(config)
            served: dict[int, ServedVersion] = {}
            for version in cfg.select_versions(config, cfg.available_versions(self.model_dir)):
                current = self.versions.get(version)
                # A version with an instance out of rotation is loaded afresh: reloading is how instances come back.
                if current is not None and current.healthy and current.unchanged(source, self.model_dir):
                    served[version] = current
                else:
                    served[version] = loaded[version] = self._load_version(mc.ModelConfig.FromString(source), version)
        except Exception as error:  # any failure of a broken model is its reason, never a crash
            for version in loaded.values():
                version.close()
            reason = str(error) if isinstance(error, ModelLoadError) else f"{type(error).__name__}: {error}"
            self._failed(reason)
            log.error("model '%s' failed to load: %s", self.name, reason)
            raise ModelLoadError(reason) from None
        for version in loaded.values():
            version.on_unavailable = lambda reason, version=version: self._unavailable(version, reason)
            if self.cache is not None and version.config.response_cache.enable:
                version.cache, version.cache_scope = self.cache, self.cache.scope(self.name, version.version)
        retired = [v for number, v in self.versions.items() if served.get(number) is not v]
        self.weights = weights
        self.config = served[max(served)].config  # completed from the file where config.pbtxt was silent
        backend, refusals = cfg.triton_needs(config, self.config), cfg.triton_refusals(config)
        self.triton_needs = "; ".join(filter(None, (backend, refusals)))
        self.versions = dict(sorted(served.items()))
        self.state, self.reason = State.READY, ""
        if loaded or retired:
            log.info("model '%s' is READY with versions %s (loaded %s)", self.name, sorted(served), sorted(loaded))
            if backend:
                log.info("model '%s': %s", self.name, backend)
            if refusals:
                log.warning("model '%s': %s", self.name, refusals)
        return retired

    def refuse(self, reason: str) -> None:
        """A load refused before it began (it would not fit in the memory budget): recorded as a load that failed."""
        self.requested = True
        self._failed(reason)
        log.error("model '%s' was not loaded: %s", self.name, reason)

    def _failed(self, reason: str) -> None:
        """A load failed for `reason`: the versions serving serve on (the reason says so), else the model is UNAVAILABLE."""
        if self.versions and self.ready:
            self.reason = f"a reload failed, versions {sorted(self.versions)} serve on: {reason}"
        else:
            self.state, self.reason = State.UNAVAILABLE, reason

    def _load_version(self, config: mc.ModelConfig, version: int) -> ServedVersion:
        if ensemble.is_ensemble(config):
            if self.models is None:
                raise ModelLoadError("an ensemble is served from a repository, which runs its steps")
            models = self.models
            return ensemble.EnsembleVersion.load(config, self.model_dir, version, lambda name, v: models(name).version(v))
        return ModelVersion.load(config, self.model_dir, version, self.rate_limiter)

    def _unavailable(self, version: ServedVersion, reason: str) -> None:
        """A served version has no instance left in rotation: the model is not ready until reloaded."""
        if self.versions.get(version.version) is version:
            self.state, self.reason = State.UNAVAILABLE, reason
            log.error("model '%s' is UNAVAILABLE until it is reloaded: %s", self.name, reason)
            self.on_unavailable()

    def unload(self) -> list[ServedVersion]:
        """Stops serving; returns the versions to retire."""
        retired = list(self.versions.values())
        self.versions, self.requested = {}, False
        self.state, self.reason = State.UNAVAILABLE, "unloaded"
        return retired

    def version(self, version: str | None = None) -> ServedVersion:
        """The version a request names; else one chosen by `version_weights`, else the latest."""
        number = cfg.parse_version(version)  # as Triton: a version string that is no number is refused first
        if not self.ready:
            raise ModelNotReady(f"model '{self.name}' is not ready: {self.reason or self.waiting_for}")
        versions = self.versions
        if number is None:
            candidates = [v for v in self.weights if v in versions and self.weights[v]]
            if candidates:
                return versions[self._choose(candidates, [self.weights[v] for v in candidates])[0]]
            return versions[next(reversed(versions))]
        if number not in versions:
            # Triton's wording, which clients (and Triton's own examples) match on.
            raise ModelNotFound(
                f"Request for unknown model: '{self.name}' version {version} is not found"
                f" (it serves versions {sorted(versions)})"
            )
        return versions[number]

    def close(self) -> None:
        for version in self.unload():
            version.close()

"""A model of the repository: its config, the versions it serves and their instances."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import hashlib
import logging
import random
import time
from pathlib import Path
from typing import Callable, Collection, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from . import config as cfg
from . import classification, ensemble, sequence, tracing, warmup
from .batching import BatchQueue, Scheduler
from .errors import InvalidInput, ModelLoadError, ModelNotFound, ModelNotReady
from .instance import Instance, InstanceThread, complete_config
from .runtimes import Runtime, load_runtime
from .sequencer import SequenceScheduler
from .signature import Signature
from .stats import RequestTiming, VersionStats

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    """Model states with the names of Triton's repository index."""

    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"


class ModelVersion:
    """One loaded version of a model: its instances fed by one batch queue (or, for a model with
    `sequence_batching`, by the sequence batcher)."""

    #: What the version waits for before it can serve ("": nothing; an ensemble's: a step model not ready).
    waiting_for = ""

    def __init__(
        self,
        name: str,
        version: int,
        path: Path,
        config: mc.ModelConfig,
        instances: list[Instance],
        latency_target_ms: float = 0,
        execution_timeout_s: float | None = None,
        sequences: sequence.SequenceBatching | None = None,
    ):
        self.name = name
        self.version = version
        self.path = path
        self.config = config
        self.signature = Signature(config)
        self.instances = instances
        self._prepare_request = instances[0].runtime.prepare_request
        # Set by `load`: the config as read (before completion), the file's stamp and digest.
        self.source, self.stamp, self.sha256 = b"", (0, 0), ""
        #: The outputs' classification labels (config `label_filename`), read at load as Triton does.
        self.labels: classification.Labels = {}
        #: Milliseconds the warmup took, once it ran.
        self.warmup_ms: float | None = None
        #: Told why when no instance is left in rotation (set by the Model that serves this version).
        self.on_unavailable: Callable[[str], None] | None = None
        self.execution_timeout_s = execution_timeout_s
        self.threads = [InstanceThread(f"{name}-v{version}-dev{i.runtime.device_id}") for i in instances]
        dynamic = config.dynamic_batching if config.HasField("dynamic_batching") else None
        self.stats = VersionStats()
        runners = [i.run_batch for i in instances]
        span_attributes = [tracing.instance_attributes(name, version, i.runtime.device_id) for i in instances]
        if sequences is not None:
            self.scheduler: Scheduler | SequenceScheduler = SequenceScheduler(
                sequences, list(self.signature.outputs), runners, self.threads, self.stats, span_attributes,
                execution_timeout_s, self._instance_lost,
            )
        else:
            self.scheduler = Scheduler(
                runners,
                self.threads,
                BatchQueue(config.max_batch_size, dynamic, latency_target_ms),
                self.stats,
                span_attributes,
                execution_timeout_s,
                self._instance_lost,
            )

    @classmethod
    def load(cls, config: mc.ModelConfig, model_dir: Path, version: int) -> "ModelVersion":
        """Loads one version's file on every device of its placement and warms it up; the config may be completed.

        The file is refused unless its sha256 is the one the config expects (if it names one).
        """
        source = config.SerializeToString(deterministic=True)
        path = cfg.model_file(config, model_dir / str(version))
        stamp = file_stamp(path)
        sha256 = checked_sha256(config, path, version)
        labels = classification.read_labels(config, model_dir)
        latency_target_ms = _latency_target_ms(config)
        execution_timeout_s = cfg.execution_timeout_s(config)
        runtimes: list[Runtime] = []
        try:
            for device_id in cfg.device_placement(config):
                runtimes.append(load_runtime(config, path, device_id))
            complete_config(config, runtimes[0])
            cfg.apply_input_shape(config)
            sequence.apply_defaults(config)
            sequences = sequence.SequenceBatching(config, model_dir) if config.HasField("sequence_batching") else None
            # What the file takes: with a sequence batcher, also the control and state tensors it feeds.
            model_config = sequences.model_config(config) if sequences is not None else config
            signature = Signature(model_config)
            instances = [Instance(r, signature) for r in runtimes]
            samples = (
                warmup.configured_samples(model_config, model_dir)
                if config.model_warmup
                else warmup.default_samples(model_config, instances[0])
            )
        except BaseException:
            for runtime in runtimes:
                runtime.close()
            raise
        loaded = cls(config.name, version, path, config, instances, latency_target_ms, execution_timeout_s, sequences)
        loaded.source, loaded.stamp, loaded.sha256, loaded.labels = source, stamp, sha256, labels
        try:
            loaded.warm_up(samples)
        except BaseException:
            loaded.close()
            raise
        return loaded

    def warm_up(self, samples: Sequence[warmup.Sample]) -> None:
        """Runs every sample on every instance (in parallel, each on its own thread); ModelLoadError if one fails."""
        if not samples:
            return
        start = time.perf_counter()
        for sample in samples:
            for _ in range(sample.count):
                runs = [thread.submit(i.run_batch, [sample.inputs]) for i, thread in zip(self.instances, self.threads)]
                _, hung = concurrent.futures.wait(runs, self.execution_timeout_s)
                for thread, run in zip(self.threads, runs):
                    if run in hung:
                        thread.abandon()  # stuck in a device call: releasing its instance will not wait for it
                for instance, run in zip(self.instances, runs):
                    where = f"warmup sample '{sample.name}' on device {instance.runtime.device_id}"
                    if run in hung:
                        raise ModelLoadError(f"{where} did not finish within execution_timeout_ms {self.execution_timeout_s * 1000:g}")
                    if run.exception() is not None:
                        raise ModelLoadError(f"{where} failed: {run.exception()}")
        self.warmup_ms = (time.perf_counter() - start) * 1000
        for instance in self.instances:
            instance.padding_rows = 0  # statistics count requests only, as Triton's do
        log.info(
            "model '%s' version %d warmed up in %.0f ms: %d samples on %d instances",
            self.name, self.version, self.warmup_ms, len(samples), len(self.instances),
        )

    def unchanged(self, source: bytes, model_dir: Path) -> bool:
        """Whether this version still is what `source` (a config as read) and its file on disk describe."""
        try:
            path = cfg.model_file(mc.ModelConfig.FromString(source), model_dir / str(self.version))
        except ModelLoadError:
            return False
        return source == self.source and path == self.path and file_stamp(path) == self.stamp

    @property
    def healthy(self) -> bool:
        """Whether every instance is in rotation (a reload replaces a version that is not)."""
        return self.scheduler.in_rotation == len(self.instances)

    def _instance_lost(self, index: int, reason: str, hung: bool) -> None:
        device = self.instances[index].runtime.device_id
        log.error(
            "model '%s' version %d: instance %d on device %d is out of rotation until the model is reloaded: %s",
            self.name, self.version, index, device, reason,
        )
        if hung:
            self.threads[index].abandon()
        if not self.scheduler.in_rotation and self.on_unavailable is not None:
            self.on_unavailable(f"version {self.version}: {self.scheduler.health_report()}")

    @property
    def padding_rows(self) -> int:
        """Zero rows every instance added to fill batches up to a size the model file takes."""
        return sum(i.padding_rows for i in self.instances)

    @property
    def runtime_info(self) -> dict[str, str]:
        """What the runtime chose, the device of every instance in order, what batches go through, the warmup."""
        info = dict(self.instances[0].runtime.info)
        info.pop("device_id", None)
        info["device_ids"] = ",".join(str(i.runtime.device_id) for i in self.instances)
        info["sha256"] = self.sha256
        info.update(self.instances[0].parameters)
        if self.warmup_ms is not None:
            info["warmup_ms"] = f"{self.warmup_ms:.0f}"
        return info

    def statistics(self) -> dict:
        """This version in Triton's statistics extension, with `batch_padding_rows` added."""
        return self.stats.as_dict(self.name, self.version, self.padding_rows)

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Collection[str] | None = None,
        parameters: Mapping[str, object] | None = None,
        timing: RequestTiming | None = None,
    ) -> dict[str, np.ndarray]:
        """Runs one request, batched with others; returns the requested outputs (all by default).

        Request `parameters` the scheduler honours: `priority` (1 is the most urgent level)
        and `timeout` (microseconds in the queue, where the queue policy allows it); for a
        sequence model, Triton's `sequence_id`, `sequence_start`, `sequence_end` (and `timeout`
        bounds the wait in the sequence backlog).
        `timing`: the edge's, which records the request once answered (see Scheduler.submit).
        """
        parameters = parameters or {}
        # A malformed request never reaches the model: as in Triton, no statistic counts it.
        rows = self.signature.check_inputs(inputs)
        if output_names:
            self.signature.check_outputs(output_names)
        if self._prepare_request is not None:
            inputs = self._prepare_request(inputs, parameters)
        priority = timeout_us = None
        if parameters:
            priority, timeout_us = _int_parameter(parameters, "priority"), _int_parameter(parameters, "timeout")
        if isinstance(self.scheduler, SequenceScheduler):
            outputs = await self.scheduler.submit(inputs, rows, parameters, timeout_us, timing)
        else:
            shape_key = tuple(a.shape[1:] for a in inputs.values()) if self.signature.batching else ()
            outputs = await self.scheduler.submit(inputs, rows, shape_key, priority, timeout_us, timing)
        if output_names:
            return {name: outputs[name] for name in output_names}
        return outputs

    async def retire(self) -> None:
        """Takes the version out of service without losing a request.

        The caller has already stopped handing it requests: this waits until those it holds
        are answered, then releases its devices off the event loop.
        """
        await self.scheduler.drain()
        self.scheduler.close(ModelNotReady(f"model '{self.name}' version {self.version} was unloaded"))
        await asyncio.to_thread(self._release)
        log.info("model '%s' version %d unloaded", self.name, self.version)

    def abandon(self, reason: Exception) -> None:
        """Fails every request it holds, queued or executing, with `reason` (a shutdown that can wait no
        longer); an instance still executing is not waited for when the version closes."""
        self.scheduler.close(reason)
        for index in self.scheduler.abandon(reason):
            self.threads[index].abandon()

    def close(self) -> None:
        """Fails queued requests, waits for running batches, then releases every device."""
        self.scheduler.close(ModelNotReady(f"model '{self.name}' version {self.version} was unloaded"))
        self._release()

    def _release(self) -> None:
        """Closes each runtime on its thread after the batch it may be running; an instance stuck in a
        device call is not waited for (its runtime closes if the call ever returns)."""
        for instance, thread in zip(self.instances, self.threads):
            closing = thread.submit(instance.runtime.close)
            if not thread.abandoned:
                try:
                    closing.result()
                except Exception as error:  # a device that failed may fail its release too: the others go on
                    log.warning("model '%s' version %d: releasing device %d: %s", self.name, self.version, instance.runtime.device_id, error)
            thread.shutdown()


def file_stamp(path: Path) -> tuple[int, int]:
    """Size and modification time: what tells a changed (or still growing) file, cheaply."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def checked_sha256(config: mc.ModelConfig, path: Path, version: int) -> str:
    """The sha256 of a version's file; ModelLoadError unless it is the digest the config expects (if any).

    "" for a version of a processing runtime, which is a directory and no file.
    """
    if path.is_dir():
        return ""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    expected = cfg.expected_sha256(config, version)
    if expected and expected != sha256:
        raise ModelLoadError(f"{path.name} of version {version} has sha256 {sha256}, but the config expects {expected}")
    return sha256


def _int_parameter(parameters: Mapping[str, object], key: str) -> int | None:
    value = parameters.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"request parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


def _latency_target_ms(config: mc.ModelConfig) -> float:
    """`parameters { key: "latency_target_ms" }`: turns on adaptive batching (0: off)."""
    value = config.parameters["latency_target_ms"].string_value if "latency_target_ms" in config.parameters else "0"
    try:
        target = float(value)
    except ValueError:
        raise ModelLoadError(f"parameter latency_target_ms must be a number of milliseconds, got {value!r}") from None
    if target < 0:
        raise ModelLoadError("parameter latency_target_ms must not be negative")
    return target


class Model:
    """A model directory of the repository and the versions it serves.

    `load` and `unload` change which versions serve in one assignment of `versions`, so a
    request sees either the old set or the new one; versions taken out are returned to
    the caller, who retires them (drains, then releases their devices).
    """

    def __init__(self, name: str, model_dir: Path, models: Callable[[str], "Model"] | None = None):
        self.name = name
        self.model_dir = model_dir
        #: The repository's models by name, for an ensemble's steps.
        self.models = models
        self.config = mc.ModelConfig(name=name)
        self.versions: dict[int, ModelVersion] = {}
        self.weights: dict[int, float] = {}
        self.state = State.UNAVAILABLE
        self.reason = "unloaded"
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

    def load(self, override: mc.ModelConfig | None = None) -> list[ModelVersion]:
        """Serves what the directory (or `override`, a config to use instead of config.pbtxt) describes.

        Blocking: call it off the event loop. Versions whose config and file are unchanged
        go on serving; new or changed ones load beside them. Raises ModelLoadError if any
        fails, and then whatever served before goes on serving. Returns the versions taken
        out of service.
        """
        self.requested = True
        self.mark_loading()
        loaded: dict[int, ModelVersion] = {}
        try:
            config = mc.ModelConfig()
            config.CopyFrom(override) if override is not None else config.CopyFrom(cfg.read_config(self.model_dir))
            config.name = config.name or self.name
            cfg.check_supported(config)
            source = config.SerializeToString(deterministic=True)
            weights = cfg.version_weights(config)
            served: dict[int, ModelVersion] = {}
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
            if self.versions and self.ready:
                self.reason = f"a reload failed, versions {sorted(self.versions)} serve on: {reason}"
            else:
                self.state, self.reason = State.UNAVAILABLE, reason
            log.error("model '%s' failed to load: %s", self.name, reason)
            raise ModelLoadError(reason) from None
        for version in loaded.values():
            version.on_unavailable = lambda reason, version=version: self._unavailable(version, reason)
        retired = [v for number, v in self.versions.items() if served.get(number) is not v]
        self.weights = weights
        self.config = served[max(served)].config  # completed from the file where config.pbtxt was silent
        self.versions = dict(sorted(served.items()))
        self.state, self.reason = State.READY, ""
        if loaded or retired:
            log.info("model '%s' is READY with versions %s (loaded %s)", self.name, sorted(served), sorted(loaded))
        return retired

    def _load_version(self, config: mc.ModelConfig, version: int) -> ModelVersion:
        if ensemble.is_ensemble(config):
            if self.models is None:
                raise ModelLoadError("an ensemble is served from a repository, which runs its steps")
            return ensemble.EnsembleVersion.load(config, self.model_dir, version, self.models)
        return ModelVersion.load(config, self.model_dir, version)

    def _unavailable(self, version: ModelVersion, reason: str) -> None:
        """A served version has no instance left in rotation: the model is not ready until reloaded."""
        if self.versions.get(version.version) is version:
            self.state, self.reason = State.UNAVAILABLE, reason
            log.error("model '%s' is UNAVAILABLE until it is reloaded: %s", self.name, reason)

    def unload(self) -> list[ModelVersion]:
        """Stops serving; returns the versions to retire."""
        retired = list(self.versions.values())
        self.versions, self.requested = {}, False
        self.state, self.reason = State.UNAVAILABLE, "unloaded"
        return retired

    def version(self, version: str | None = None) -> ModelVersion:
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

"""A model of the repository: its config, the versions it serves and their instances."""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from . import config as cfg
from . import tracing
from .batching import BatchQueue, Scheduler
from .datatypes import to_config
from .errors import InvalidInput, ModelLoadError, ModelNotFound, ModelNotReady
from .runtimes import Runtime, TensorSpec, load_runtime
from .signature import Signature
from .stats import VersionStats

log = logging.getLogger(__name__)

#: Triton's default max_batch_size when it auto-completes a model that can batch.
AUTO_COMPLETE_MAX_BATCH_SIZE = 4


class State(str, enum.Enum):
    """Model states with the names of Triton's repository index."""

    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"


def complete_config(config: mc.ModelConfig, runtime: Runtime) -> None:
    """Fills inputs, outputs and max_batch_size from the model file where config.pbtxt leaves them out.

    As Triton's ONNX backend does: a model whose every tensor has a variable first
    dimension is taken to batch along it.
    """
    if config.input and config.output:
        return
    specs = [*runtime.inputs, *runtime.outputs]
    batches = config.max_batch_size > 0 or (specs and all(s.shape[:1] == (-1,) for s in specs))
    if batches and config.max_batch_size == 0:
        config.max_batch_size = runtime.max_batch_size or AUTO_COMPLETE_MAX_BATCH_SIZE
    def declare(target, spec: TensorSpec):
        target.add(name=spec.name, data_type=to_config(spec.datatype), dims=spec.shape[1:] if batches else spec.shape)

    if not config.input:
        for spec in runtime.inputs:
            declare(config.input, spec)
    if not config.output:
        for spec in runtime.outputs:
            declare(config.output, spec)


def check_against_file(signature: Signature, runtime: Runtime) -> None:
    """Refuses a config whose tensors the model file does not have."""
    batch = (-1,) if signature.batching else ()
    for declared, actual in ((signature.inputs, runtime.inputs), (signature.outputs, runtime.outputs)):
        specs = {s.name: s for s in actual}
        for decl in declared.values():
            spec = specs.get(decl.name)
            if spec is None:
                raise ModelLoadError(f"config.pbtxt declares '{decl.name}', the model file has {sorted(specs)}")
            if spec.datatype != decl.datatype:
                raise ModelLoadError(
                    f"'{decl.name}' is {decl.datatype} in config.pbtxt but {spec.datatype} in the model file"
                )
            want = batch + (decl.reshape if decl.reshape is not None else decl.dims)
            if len(want) != len(spec.shape) or any(a not in (-1, b) and b != -1 for a, b in zip(want, spec.shape)):
                raise ModelLoadError(
                    f"'{decl.name}' has shape {list(want)} in config.pbtxt but {list(spec.shape)} in the model file"
                )


class Instance:
    """One runtime on one device, running whole batches: the part both servers share.

    Not thread-safe: one thread at a time calls it (the KServe server gives each instance
    a thread of its own; Triton calls `execute` of one model instance at a time).
    """

    def __init__(self, runtime: Runtime, signature: Signature):
        self.runtime = runtime
        self._output_names = list(signature.outputs)
        self._reshape_in = {d.name: d.reshape for d in signature.inputs.values() if d.reshape is not None}
        self._reshape_out = {d.name: d.dims for d in signature.outputs.values() if d.reshape is not None}
        self._batching = signature.batching

    def _shaped(self, arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple], rows: int) -> dict:
        if not shapes:
            return dict(arrays)
        lead = (rows,) if self._batching else ()
        return {n: a.reshape(lead + shapes[n]) if n in shapes else a for n, a in arrays.items()}

    def run_batch(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Concatenates the requests along dimension 0, runs them once and splits the outputs back."""
        if len(requests) == 1:
            inputs = requests[0]
            counts = [self._rows(inputs)]
        else:
            counts = [self._rows(r) for r in requests]
            inputs = {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}
        rows = sum(counts)
        outputs = self.runtime.run(self._shaped(inputs, self._reshape_in, rows), self._output_names)
        outputs = self._shaped(outputs, self._reshape_out, rows)
        if len(requests) == 1:
            return [outputs]
        split, start = [], 0
        for count in counts:
            split.append({name: array[start : start + count] for name, array in outputs.items()})
            start += count
        return split

    def _rows(self, inputs: Mapping[str, np.ndarray]) -> int:
        return next(iter(inputs.values())).shape[0] if self._batching else 1


class ModelVersion:
    """One loaded version of a model: its instances fed by one batch queue."""

    def __init__(
        self, name: str, version: int, path: Path, config: mc.ModelConfig, instances: list[Instance], latency_target_ms: float = 0
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
        # One thread per instance: device contexts (ACL's) are bound to the thread that uses them.
        self.threads = [ThreadPoolExecutor(1, thread_name_prefix=f"{name}-v{version}-dev{i.runtime.device_id}") for i in instances]
        dynamic = config.dynamic_batching if config.HasField("dynamic_batching") else None
        self.stats = VersionStats()
        self.scheduler = Scheduler(
            [i.run_batch for i in instances],
            self.threads,
            BatchQueue(config.max_batch_size, dynamic, latency_target_ms),
            self.stats,
            [tracing.instance_attributes(name, version, i.runtime.device_id) for i in instances],
        )

    @classmethod
    def load(cls, config: mc.ModelConfig, model_dir: Path, version: int) -> "ModelVersion":
        """Loads one version's file on every device of its placement; the config may be completed.

        The file is refused unless its sha256 is the one the config expects (if it names one).
        """
        source = config.SerializeToString(deterministic=True)
        path = cfg.model_file(config, model_dir / str(version))
        stamp = file_stamp(path)
        sha256 = checked_sha256(config, path, version)
        latency_target_ms = _latency_target_ms(config)
        runtimes: list[Runtime] = []
        try:
            for device_id in cfg.device_placement(config):
                runtimes.append(load_runtime(config, path, device_id))
            complete_config(config, runtimes[0])
            cfg.apply_input_shape(config)
            signature = Signature(config)
            check_against_file(signature, runtimes[0])
        except BaseException:
            for runtime in runtimes:
                runtime.close()
            raise
        loaded = cls(config.name, version, path, config, [Instance(r, signature) for r in runtimes], latency_target_ms)
        loaded.source, loaded.stamp, loaded.sha256 = source, stamp, sha256
        return loaded

    def unchanged(self, source: bytes, model_dir: Path) -> bool:
        """Whether this version still is what `source` (a config as read) and its file on disk describe."""
        try:
            path = cfg.model_file(mc.ModelConfig.FromString(source), model_dir / str(self.version))
        except ModelLoadError:
            return False
        return source == self.source and path == self.path and file_stamp(path) == self.stamp

    @property
    def runtime_info(self) -> dict[str, str]:
        """What the runtime chose, and the device of every instance in order."""
        info = dict(self.instances[0].runtime.info)
        info.pop("device_id", None)
        info["device_ids"] = ",".join(str(i.runtime.device_id) for i in self.instances)
        info["sha256"] = self.sha256
        return info

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        output_names: Sequence[str] | None = None,
        parameters: Mapping[str, object] | None = None,
    ) -> dict[str, np.ndarray]:
        """Runs one request, batched with others; returns the requested outputs (all by default).

        Request `parameters` the scheduler honours: `priority` (1 is the most urgent level)
        and `timeout` (microseconds in the queue, where the queue policy allows it).
        """
        parameters = parameters or {}
        # A malformed request never reaches the model: as in Triton, no statistic counts it.
        rows = self.signature.check_inputs(inputs)
        if output_names:
            self.signature.check_outputs(output_names)
        if self._prepare_request is not None:
            inputs = self._prepare_request(inputs, parameters)
        priority, timeout_us = (_int_parameter(parameters, key) for key in ("priority", "timeout"))
        shape_key = tuple(a.shape[1:] for a in inputs.values()) if self.signature.batching else ()
        outputs = await self.scheduler.submit(inputs, rows, shape_key, priority, timeout_us)
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

    def close(self) -> None:
        """Fails queued requests, waits for running batches, then releases every device."""
        self.scheduler.close(ModelNotReady(f"model '{self.name}' version {self.version} was unloaded"))
        self._release()

    def _release(self) -> None:
        for instance, thread in zip(self.instances, self.threads):
            thread.submit(instance.runtime.close).result()  # after the batch it may be running
            thread.shutdown()


def file_stamp(path: Path) -> tuple[int, int]:
    """Size and modification time: what tells a changed (or still growing) file, cheaply."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def checked_sha256(config: mc.ModelConfig, path: Path, version: int) -> str:
    """The sha256 of a version's file; ModelLoadError unless it is the digest the config expects (if any)."""
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

    def __init__(self, name: str, model_dir: Path):
        self.name = name
        self.model_dir = model_dir
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
        return self.state is State.READY

    def load(self, override: mc.ModelConfig | None = None) -> list[ModelVersion]:
        """Serves what the directory (or `override`, a config to use instead of config.pbtxt) describes.

        Blocking: call it off the event loop. Versions whose config and file are unchanged
        go on serving; new or changed ones load beside them. Raises ModelLoadError if any
        fails, and then whatever served before goes on serving. Returns the versions taken
        out of service.
        """
        self.requested = True
        if not self.versions:
            self.state, self.reason = State.LOADING, "loading"
        loaded: dict[int, ModelVersion] = {}
        try:
            config = mc.ModelConfig()
            config.CopyFrom(override) if override is not None else config.CopyFrom(cfg.read_config(self.model_dir))
            config.name = config.name or self.name
            source = config.SerializeToString(deterministic=True)
            weights = cfg.version_weights(config)
            served: dict[int, ModelVersion] = {}
            for version in cfg.select_versions(config, cfg.available_versions(self.model_dir)):
                current = self.versions.get(version)
                if current is not None and current.unchanged(source, self.model_dir):
                    served[version] = current
                else:
                    served[version] = loaded[version] = ModelVersion.load(mc.ModelConfig.FromString(source), self.model_dir, version)
        except Exception as error:  # any failure of a broken model is its reason, never a crash
            for version in loaded.values():
                version.close()
            reason = str(error) if isinstance(error, ModelLoadError) else f"{type(error).__name__}: {error}"
            if self.versions:
                self.reason = f"a reload failed, versions {sorted(self.versions)} serve on: {reason}"
            else:
                self.state, self.reason = State.UNAVAILABLE, reason
            log.error("model '%s' failed to load: %s", self.name, reason)
            raise ModelLoadError(reason) from None
        retired = [v for number, v in self.versions.items() if served.get(number) is not v]
        self.weights = weights
        self.config = served[max(served)].config  # completed from the file where config.pbtxt was silent
        self.versions = dict(sorted(served.items()))
        self.state, self.reason = State.READY, ""
        if loaded or retired:
            log.info("model '%s' is READY with versions %s (loaded %s)", self.name, sorted(served), sorted(loaded))
        return retired

    def unload(self) -> list[ModelVersion]:
        """Stops serving; returns the versions to retire."""
        retired = list(self.versions.values())
        self.versions, self.requested = {}, False
        self.state, self.reason = State.UNAVAILABLE, "unloaded"
        return retired

    def version(self, version: str | None = None) -> ModelVersion:
        """The version a request names; else one chosen by `version_weights`, else the latest."""
        if not self.ready:
            raise ModelNotReady(f"model '{self.name}' is not ready: {self.reason}")
        versions = self.versions
        if not version:
            candidates = [v for v in self.weights if v in versions and self.weights[v]]
            if candidates:
                return versions[self._choose(candidates, [self.weights[v] for v in candidates])[0]]
            return versions[next(reversed(versions))]
        try:
            return versions[int(version)]
        except (ValueError, KeyError):
            # Triton's wording, which clients (and Triton's own examples) match on.
            raise ModelNotFound(
                f"Request for unknown model: '{self.name}' version {version} is not found"
                f" (it serves versions {sorted(versions)})"
            ) from None

    def close(self) -> None:
        for version in self.unload():
            version.close()

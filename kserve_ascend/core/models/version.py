"""A version of a model that runs on instances of its own: a model file on each device of its placement,
fed by a dynamic batcher (or, for a model with `sequence_batching`, by the sequence batcher)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from .. import config as cfg
from .. import tracing
from ..contracts import (
    InstanceHealth,
    RequestOptions,
    RequestScheduler,
    ServedVersion,
    Tensors,
    VersionHealth,
)
from ..errors import ModelLoadError
from ..execution import loading, memory_meter
from ..execution.loading import LoadedInstances
from ..execution.runtimes import parameter
from ..execution.threads import InstanceThread
from ..scheduling.batcher import DynamicBatcher
from ..scheduling.decoupled import StreamScheduler
from ..scheduling.queue import BatchQueue
from ..scheduling.rate_limiter import Gate, RateLimiter
from ..scheduling.sequencer import SequenceScheduler
from ..signature import Signature
from ..stats import VersionStats
from . import classification, memory

log = logging.getLogger(__name__)


class ModelVersion(ServedVersion):
    def __init__(
        self, config: mc.ModelConfig, version: int, loaded: LoadedInstances, source: bytes, labels: classification.Labels,
        gates: list[Gate] | None = None,
    ):
        self.name = config.name
        self.version = version
        self.config = config
        self.memory = {}
        self.signature = Signature(config)
        self.labels = labels
        self.source = source
        self.path, self.stamp, self.sha256 = loaded.path, loaded.stamp, loaded.sha256
        self.instances = loaded.instances
        self._prepare_request = loaded.prepare_request
        #: Milliseconds the warmup took, once it ran.
        self.warmup_ms: float | None = None
        self.execution_timeout_s = cfg.execution_timeout_s(config)
        self.threads = [InstanceThread(f"{self.name}-v{version}-dev{i.runtime.device_id}") for i in self.instances]
        #: Per instance, its way through the server's rate limiter (None: not limited).
        self.gates = gates
        self.stats = VersionStats()
        configured = memory.configured_bytes(config)
        self.instance_memory = loaded.memory if configured is None else [configured] * len(self.instances)
        self.memory_source = loaded.memory_source if configured is None else memory_meter.CONFIGURED
        for instance, size in zip(self.instances, self.instance_memory):
            device = instance.runtime.device_id
            self.memory[device] = self.memory.get(device, 0) + size
        self.decoupled = config.model_transaction_policy.decoupled
        self.scheduler = self._scheduler(loaded)

    def _scheduler(self, loaded: LoadedInstances) -> RequestScheduler:
        if self.decoupled:
            return StreamScheduler([instance.responses for instance in self.instances], self.threads, self.stats, self.gates or ())
        runners = [instance.run_batch for instance in self.instances]
        spans = [tracing.instance_attributes(self.name, self.version, i.runtime.device_id) for i in self.instances]
        if loaded.sequences is not None:
            return SequenceScheduler(
                loaded.sequences, list(self.signature.outputs), runners, self.threads, self.stats, spans,
                self.execution_timeout_s, self._instance_lost, self.gates or (),
            )
        config = self.config
        dynamic = config.dynamic_batching if config.HasField("dynamic_batching") else None
        queue = BatchQueue(config.max_batch_size, dynamic, _latency_target_ms(config))
        return DynamicBatcher(
            runners, self.threads, queue, self.stats, spans, self.execution_timeout_s, self._instance_lost, self.gates or ()
        )

    @classmethod
    def load(cls, config: mc.ModelConfig, model_dir: Path, version: int, rate_limiter: RateLimiter | None = None) -> ModelVersion:
        """Loads one version's file on every device of its placement and warms it up; the config may be completed.

        With a `rate_limiter`, its instances register there first (refused if the server lacks their resources).
        """
        source = config.SerializeToString(deterministic=True)
        labels = classification.read_labels(config, model_dir)
        _latency_target_ms(config)  # refused before anything is loaded
        cfg.complete_backend(config, cfg.model_file(config, model_dir / str(version)))  # first: it sets default counts
        placement = cfg.instance_placement(config)
        gates = rate_limiter.register([(device, group.rate_limiter) for device, group in placement]) if rate_limiter else None
        try:
            loaded = loading.load_instances(config, model_dir, version, [device for device, _ in placement])
        except BaseException:
            if gates:
                rate_limiter.unregister(gates)
            raise
        try:
            served = cls(config, version, loaded, source, labels, gates)
        except BaseException:
            loaded.close()
            if gates:
                rate_limiter.unregister(gates)
            raise
        try:
            served.warm_up(loaded.samples)
        except BaseException:
            served.close()
            raise
        return served

    def warm_up(self, samples: list) -> None:
        """Runs every sample on every instance (in parallel, each on its own thread); ModelLoadError if one fails
        or outlives the execution timeout."""
        if not samples:
            return
        timeout = self.execution_timeout_s
        start = time.perf_counter()
        for sample in samples:
            for _ in range(sample.count):
                runs = [
                    thread.submit(loading.run_sample, instance, sample, f"device {instance.runtime.device_id}")
                    for instance, thread in zip(self.instances, self.threads)
                ]
                _, hung = concurrent.futures.wait(runs, timeout)
                for thread, run in zip(self.threads, runs):
                    if run in hung:
                        thread.abandon()  # stuck in a device call: releasing its instance will not wait for it
                for instance, run in zip(self.instances, runs):
                    if run in hung:
                        raise ModelLoadError(
                            f"warmup sample '{sample.name}' on device {instance.runtime.device_id} did not finish"
                            f" within execution_timeout_ms {timeout * 1000:g}"
                        )
                    if run.exception() is not None:
                        raise run.exception()
        self.warmup_ms = (time.perf_counter() - start) * 1000
        for instance in self.instances:
            instance.padding_rows = 0  # statistics count requests only, as Triton's do
        log.info(
            "model '%s' version %d warmed up in %.0f ms: %d samples on %d instances",
            self.name, self.version, self.warmup_ms, len(samples), len(self.instances),
        )

    def accept(self, inputs: Tensors, options: RequestOptions) -> tuple[int, Tensors]:
        return loading.accept(self.signature, self._prepare_request, inputs, options.parameters)

    def unchanged(self, source: bytes, model_dir: Path) -> bool:
        try:
            path = cfg.model_file(mc.ModelConfig.FromString(source), model_dir / str(self.version))
        except ModelLoadError:
            return False
        return source == self.source and path == self.path and loading.file_stamp(path) == self.stamp

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
    def runtime_info(self) -> dict[str, str]:
        """What the runtime chose, the device of every instance in order, what batches go through, the warmup."""
        info = dict(self.instances[0].runtime.info)
        info.pop("device_id", None)
        info["device_ids"] = ",".join(str(i.runtime.device_id) for i in self.instances)
        info["sha256"] = self.sha256
        info.update(self.instances[0].parameters)
        if self.warmup_ms is not None:
            info["warmup_ms"] = f"{self.warmup_ms:.0f}"
        info["memory_bytes"] = str(sum(self.memory.values()))
        info["memory_source"] = self.memory_source
        return info

    @property
    def padding_rows(self) -> int:
        return sum(instance.padding_rows for instance in self.instances)

    def health_snapshot(self) -> VersionHealth:
        health = self.scheduler.health
        return VersionHealth(
            queued=self.scheduler.queued,
            padding_rows=self.padding_rows,
            instances=tuple(
                InstanceHealth(
                    device_id=instance.runtime.device_id,
                    out_of_rotation=health[index],
                    degraded=instance.runtime.info.get("degraded") == "true",
                    utilization=instance.runtime.utilization(),
                )
                for index, instance in enumerate(self.instances)
            ),
        )

    def abandon(self, reason: Exception) -> None:
        """Fails every request it holds with `reason`; an instance still executing is not waited for when the
        version is released."""
        self.scheduler.close(reason)
        for index in self.scheduler.abandon(reason):
            self.threads[index].abandon()

    def release(self) -> None:
        """Closes each runtime on its thread after the batch it may be running; an instance stuck in a
        device call is not waited for (its runtime closes if the call ever returns). First the instances
        leave the rate limiter: what they hold goes to the others, one still waiting there goes on."""
        if self.gates:
            self.gates[0].limiter.unregister(self.gates)
        for instance, thread in zip(self.instances, self.threads):
            closing = thread.submit(instance.runtime.close)
            if not thread.abandoned:
                try:
                    closing.result()
                except Exception as error:  # a device that failed may fail its release too: the others go on
                    log.warning("model '%s' version %d: releasing device %d: %s", self.name, self.version, instance.runtime.device_id, error)
            thread.shutdown()


def _latency_target_ms(config: mc.ModelConfig) -> float:
    """`parameters { key: "latency_target_ms" }`: turns on adaptive batching (0: off)."""
    value = parameter(config, "latency_target_ms", "0")
    try:
        target = float(value)
    except ValueError:
        raise ModelLoadError(f"parameter latency_target_ms must be a number of milliseconds, got {value!r}") from None
    if target < 0:
        raise ModelLoadError("parameter latency_target_ms must not be negative")
    return target

"""Prometheus metrics of the KServe server, read from the repository when scraped.

Every number comes from a served version's `VersionStats` (what the statistics extension
reports) or its scheduler, so the hot path pays nothing for metrics and `/metrics` agrees
with `/v2/models/stats` by construction. A version's counters start at zero when it is
(re)loaded, as in Triton.

Two vocabularies over the same numbers, labelled `model` and `version`:
- Triton's (`nv_inference_*`), so Triton's dashboards work unchanged;
- the CANN design's: `infer_request_count`, `infer_request_failure_count`,
  `inference_latency_seconds`, `batch_size_distribution`, `inference_queue_depth`, and
  `npu_utilization_percent{device}` where the runtime can read it from the device.

And this server's own, prefixed `ascend_` as Triton prefixes its own `nv_`:
`ascend_batch_padding_rows` (zero rows added to fill batches up to a size the model file
takes; the statistics extension's `batch_padding_rows`), and per instance, labelled also
`instance` (its index in the version) and `device`, `ascend_instance_healthy` (0 once it is
out of rotation) and `ascend_runtime_degraded` (1 when its runtime serves below what the
config asked, e.g. on the CPU instead of the CANN execution provider).

KServe serves `prometheus_client.REGISTRY` at `/metrics` of the HTTP port; `register`
adds the repository to it and, with `--metrics_port`, serves it on that port too.

With `--workers N` the engine process holds the repository, so it holds the metrics:
`engine_registry` gathers the repository's, the engine process's own and KServe's of
every frontend (its V1 latency histograms, summed over the frontends by prometheus_client's
multiprocess mode), and serves them on `--metrics_port`; a frontend answers `/metrics`
on the HTTP port with the same families, asked of the engine at scrape time
(`serve_from_engine`), so both ports show one set of numbers.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from ..core.model import ModelVersion
from ..core.repository import Repository
from ..core.stats import FAILURE_REASONS, LATENCY_BUCKETS_S
from . import ports

LABELS = ("model", "version")

#: Upper bounds of the batch size histogram (rows per execution). Exact sizes are in the
#: statistics extension's `batch_stats`; fixed bounds let dashboards sum across models.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Counters are exposed untyped: prometheus_client writes a counter's samples as
# `<name>_total`, and the names to match (Triton's, the CANN design's) have no suffix.
_COUNTER = UnknownMetricFamily

#: (family, name, help, value of a version) of every per-version number but the histograms.
_PER_VERSION: tuple[tuple[type, str, str, Callable[[ModelVersion], float]], ...] = (
    (_COUNTER, "nv_inference_request_success", "Successful inference requests, whatever their batch size",
     lambda v: v.stats.success.count),
    (_COUNTER, "nv_inference_count", "Inferences performed: batch rows of successful executions",
     lambda v: v.stats.inference_count),
    (_COUNTER, "nv_inference_exec_count", "Model executions performed",
     lambda v: v.stats.execution_count),
    (_COUNTER, "nv_inference_request_duration_us", "Cumulative duration of successful requests in microseconds, queue included",
     lambda v: v.stats.success.ns // 1000),
    (_COUNTER, "nv_inference_queue_duration_us", "Cumulative time successful requests waited in the queue, in microseconds",
     lambda v: v.stats.queue.ns // 1000),
    # Triton's three compute counters, with what the statistics extension's compute_* measure (core/stats.py).
    (_COUNTER, "nv_inference_compute_input_duration_us", "Cumulative time requests spend processing inference inputs, in microseconds",
     lambda v: v.stats.compute.input.ns // 1000),
    (_COUNTER, "nv_inference_compute_infer_duration_us", "Cumulative time requests spend executing the inference model, in microseconds",
     lambda v: v.stats.compute.infer.ns // 1000),
    (_COUNTER, "nv_inference_compute_output_duration_us", "Cumulative time requests spend processing inference outputs, in microseconds",
     lambda v: v.stats.compute.output.ns // 1000),
    (GaugeMetricFamily, "nv_inference_pending_request_count", "Requests waiting in the queue for an execution",
     lambda v: v.scheduler.queued),
    (_COUNTER, "infer_request_count", "Inference requests that reached the model, successful or failed",
     lambda v: v.stats.success.count + v.stats.fail.count),
    (GaugeMetricFamily, "inference_queue_depth", "Requests waiting in the queue for an execution",
     lambda v: v.scheduler.queued),
    (_COUNTER, "ascend_batch_padding_rows", "Zero rows added to batches to reach a batch size the model file takes",
     lambda v: v.padding_rows),
)

INSTANCE_LABELS = (*LABELS, "instance", "device")

#: (name, help, value of one instance of a version) of every per-instance gauge.
_PER_INSTANCE: tuple[tuple[str, str, Callable[[ModelVersion, int], float]], ...] = (
    ("ascend_instance_healthy", "1 while the instance is in rotation, 0 once a device fault or an execution timeout took it out",
     lambda v, i: 0 if v.scheduler.health[i] else 1),
    ("ascend_runtime_degraded", "1 when the instance's runtime serves below what the config asked (see model metadata)",
     lambda v, i: 1 if v.instances[i].runtime.info.get("degraded") == "true" else 0),
)

#: The failure counters: Triton's and the CANN design's names, labelled with the reason.
_FAILURES = (
    ("nv_inference_request_failure", "Failed inference requests by reason, whatever their batch size"),
    ("infer_request_failure_count", "Failed inference requests by reason (REJECTED, CANCELED, BACKEND, OTHER)"),
)


class RepositoryCollector(Collector):
    """Yields the metrics of every version the repository serves, at scrape time.

    Runs on the event loop (the HTTP port's `/metrics`) or on the metrics port's thread;
    it only copies containers and reads numbers, never holding the loop for long.
    """

    def __init__(self, repository: Repository):
        self.repository = repository

    def collect(self) -> Iterator[Metric]:
        # list(...) of a dict's values is atomic: a model loading meanwhile is seen whole or not at all.
        versions = [v for model in list(self.repository.models.values()) for v in list(model.versions.values())]
        for family, name, documentation, value in _PER_VERSION:
            metric = family(name, documentation, labels=LABELS)
            for version in versions:
                metric.add_metric(_labels(version), value(version))
            yield metric
        for name, documentation, value in _PER_INSTANCE:
            metric = GaugeMetricFamily(name, documentation, labels=INSTANCE_LABELS)
            for version in versions:
                for index, instance in enumerate(version.instances):
                    metric.add_metric([*_labels(version), str(index), str(instance.runtime.device_id)], value(version, index))
            yield metric
        yield from _failures(versions)
        yield _latency(versions)
        yield _batch_sizes(versions)
        utilization = _utilization(versions)
        if utilization.samples:  # absent, not zero, where no runtime can read its device
            yield utilization


def _labels(version: ModelVersion) -> list[str]:
    return [version.name, str(version.version)]


def _failures(versions: list[ModelVersion]) -> Iterator[Metric]:
    counts = [(_labels(v), dict(v.stats.failures)) for v in versions]
    for name, documentation in _FAILURES:
        metric = _COUNTER(name, documentation, labels=(*LABELS, "reason"))
        for labels, failures in counts:
            for reason in FAILURE_REASONS:
                metric.add_metric([*labels, reason], failures[reason])
        yield metric


def _latency(versions: list[ModelVersion]) -> HistogramMetricFamily:
    metric = HistogramMetricFamily(
        "inference_latency_seconds",
        "Latency of successful requests, from entering the queue to their result",
        labels=LABELS,
    )
    bounds = [floatToGoString(b) for b in (*LATENCY_BUCKETS_S, float("inf"))]
    for version in versions:
        cumulative = itertools.accumulate(list(version.stats.latency_counts))
        metric.add_metric(_labels(version), list(zip(bounds, cumulative)), version.stats.success.ns / 1e9)
    return metric


def _batch_sizes(versions: list[ModelVersion]) -> HistogramMetricFamily:
    metric = HistogramMetricFamily("batch_size_distribution", "Rows per model execution", labels=LABELS)
    bounds = (*BATCH_BUCKETS, float("inf"))
    for version in versions:
        executions = [(size, batch.infer.count) for size, batch in list(version.stats.batches.items())]
        buckets = [(floatToGoString(b), sum(n for size, n in executions if size <= b)) for b in bounds]
        metric.add_metric(_labels(version), buckets, sum(size * n for size, n in executions))
    return metric


def _utilization(versions: list[ModelVersion]) -> GaugeMetricFamily:
    """One sample per device: the first of its runtimes that can read the device answers."""
    metric = GaugeMetricFamily("npu_utilization_percent", "AI Core utilization of the NPU, percent", labels=("device",))
    answered: set[int] = set()
    for runtime in (instance.runtime for version in versions for instance in version.instances):
        if runtime.device_id in answered:
            continue
        percent = runtime.utilization()
        if percent is not None:
            answered.add(runtime.device_id)
            metric.add_metric([str(runtime.device_id)], percent)
    return metric


def register(repository: Repository, port: int = 0) -> None:
    """Adds the repository's metrics to prometheus_client's registry; serves it on `port` too (0: no)."""
    REGISTRY.register(RepositoryCollector(repository))
    if port:
        serve(port, REGISTRY)


def serve(port: int, registry: CollectorRegistry) -> None:
    """Serves `registry` on `port`, or exits naming the port (main checked it was free: another process took it since)."""
    try:
        # A daemon thread of prometheus_client's: scrapes never wait for, nor hold, the event loop.
        start_http_server(port, registry=registry)
    except OSError as error:
        ports.refuse(port, ports.METRICS, error)


# ---------------------------------------------------------------- --workers N


def engine_registry(repository: Repository, frontends_dir: str, port: int = 0) -> CollectorRegistry:
    """The engine's metrics: the repository's, its own process's, and what KServe counts in the frontends
    (which write them to `frontends_dir`, their PROMETHEUS_MULTIPROC_DIR); served on `port` too (0: no)."""
    registry = CollectorRegistry()
    registry.register(RepositoryCollector(repository))
    MultiProcessCollector(registry, frontends_dir)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    if port:
        serve(port, registry)
    return registry


def families(registry: CollectorRegistry) -> list:
    """The registry's metric families as JSON (for a frontend to serve): [name, help, type, unit, samples]."""
    return [
        [m.name, m.documentation, m.type, m.unit, [[s.name, s.labels, _number(s.value), s.timestamp] for s in m.samples]]
        for m in registry.collect()
    ]


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # JSON has no infinities


class EngineCollector(Collector):
    """A frontend's metrics: the engine's families, asked of it at scrape time (`fetch`)."""

    def __init__(self, fetch: Callable[[], list]):
        self.fetch = fetch

    def collect(self) -> Iterator[Metric]:
        for name, documentation, kind, unit, samples in self.fetch():
            metric = Metric(name, documentation, kind, unit)
            for sample, labels, value, timestamp in samples:
                metric.add_sample(sample, labels, float(value) if isinstance(value, str) else value, timestamp)
            yield metric


def serve_from_engine(fetch: Callable[[], list]) -> None:
    """In a frontend: `/metrics` on the HTTP port serves the engine's families, and nothing of this process.

    The process's own collectors go (the engine's describe the process that serves the
    models), as do KServe's histograms: they still count here, in prometheus_client's
    multiprocess files, and reach `/metrics` through the engine's sum of every frontend.
    """
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR, *_kserve_metrics()):
        REGISTRY.unregister(collector)
    REGISTRY.register(EngineCollector(fetch))


def _kserve_metrics() -> list:
    from kserve import metrics

    return [metrics.PRE_HIST_TIME, metrics.POST_HIST_TIME, metrics.PREDICT_HIST_TIME, metrics.EXPLAIN_HIST_TIME]

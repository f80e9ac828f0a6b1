"""Prometheus metrics of the KServe server, read from the repository when scraped.

Every number comes from a served version's `VersionStats` (what the statistics extension
reports) or its health snapshot (`ServedVersion.health_snapshot`), so the hot path pays nothing
for metrics and `/metrics` agrees with `/v2/models/stats` by construction. A version's counters start at zero when it is
(re)loaded, as in Triton.

Two vocabularies over the same numbers, labelled `model` and `version`:
- Triton's (`nv_inference_*`), so Triton's dashboards work unchanged;
- the CANN design's: `infer_request_count`, `infer_request_failure_count`,
  `inference_latency_seconds`, `batch_size_distribution`, `inference_queue_depth`, and
  `npu_utilization_percent{device}` where the runtime can read it from the device.

With `--cache_config`, Triton's response cache metrics: `nv_cache_num_hits_per_model` and the other
per-model counters for the versions whose config enables the cache, and the cache's own gauges
(`nv_cache_num_entries`, `nv_cache_util`, ...), unlabelled as Triton's local cache writes them.

And this server's own, prefixed `ascend_` as Triton prefixes its own `nv_`:
`ascend_batch_padding_rows` (zero rows added to fill batches up to a size the model file
takes; the statistics extension's `batch_padding_rows`), and per instance, labelled also
`instance` (its index in the version) and `device`, `ascend_instance_healthy` (0 once it is
out of rotation) and `ascend_runtime_degraded` (1 when its runtime serves below what the
config asked, e.g. on the CPU instead of the CANN execution provider).

Memory (issue 30, `core.models.memory`): per device `ascend_device_memory_used_bytes`,
`ascend_device_memory_total_bytes` (pyACL's `acl.rt.get_mem_info` where pyACL is present, else the
host's: MemTotal and MemTotal - MemAvailable) and `ascend_device_memory_budget_bytes` (absent where
unlimited); per loaded version `ascend_model_memory_bytes`; per model `ascend_model_loads{reason}`
(startup, explicit, on_demand, poll), `ascend_model_evictions` and the histogram
`ascend_model_load_wait_seconds` of the time requests waited for its load on demand.

Where the Ascend driver's DCMI library is present, each NPU's temperature, power and health too
(`ascend_npu_temperature_celsius`, `ascend_npu_power_watts`, `ascend_npu_health`, labelled
`device`; npu_telemetry.py), read at scrape by the process that holds the registry.

The data plane renders a registry at `/metrics` of the HTTP port, and `--metrics_port` serves
the same registry: in one process `prometheus_client.REGISTRY`, to which `register` adds the
repository. With `--workers N` the engine process holds the repository, so it holds the
metrics: `engine_registry` gathers the repository's, the engine process's own and KServe's of
every frontend (its V1 latency histograms, summed over the frontends by prometheus_client's
multiprocess mode); a frontend's `/metrics` asks the engine's data plane, so both ports show
one set of numbers.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from ...core.cache import ResponseCache
from ...core.contracts import InstanceHealth, ServedVersion, VersionHealth
from ...core.execution import memory_meter
from ...core.models.memory import WAIT_BUCKETS_S, Ledger
from ...core.models.repository import Repository
from ...core.stats import FAILURE_REASONS, LATENCY_BUCKETS_S
from .. import ports
from . import npu_telemetry

#: A served version and its health snapshot, taken once per scrape.
Seen = tuple[ServedVersion, VersionHealth]

LABELS = ("model", "version")

#: Upper bounds of the batch size histogram (rows per execution). Exact sizes are in the
#: statistics extension's `batch_stats`; fixed bounds let dashboards sum across models.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Counters are exposed untyped: prometheus_client writes a counter's samples as
# `<name>_total`, and the names to match (Triton's, the CANN design's) have no suffix.
_COUNTER = UnknownMetricFamily

#: (family, name, help, value of a version) of every per-version number but the histograms.
_PER_VERSION: tuple[tuple[type, str, str, Callable[[ServedVersion, VersionHealth], float]], ...] = (
    (_COUNTER, "nv_inference_request_success", "Successful inference requests, whatever their batch size",
     lambda v, h: v.stats.success.count),
    (_COUNTER, "nv_inference_count", "Inferences performed: batch rows of successful executions",
     lambda v, h: v.stats.inference_count),
    (_COUNTER, "nv_inference_exec_count", "Model executions performed",
     lambda v, h: v.stats.execution_count),
    (_COUNTER, "nv_inference_request_duration_us", "Cumulative duration of successful requests in microseconds, queue included",
     lambda v, h: v.stats.success.ns // 1000),
    (_COUNTER, "nv_inference_queue_duration_us", "Cumulative time successful requests waited in the queue, in microseconds",
     lambda v, h: v.stats.queue.ns // 1000),
    # Triton's three compute counters, with what the statistics extension's compute_* measure (core/stats.py).
    (_COUNTER, "nv_inference_compute_input_duration_us", "Cumulative time requests spend processing inference inputs, in microseconds",
     lambda v, h: v.stats.compute.input.ns // 1000),
    (_COUNTER, "nv_inference_compute_infer_duration_us", "Cumulative time requests spend executing the inference model, in microseconds",
     lambda v, h: v.stats.compute.infer.ns // 1000),
    (_COUNTER, "nv_inference_compute_output_duration_us", "Cumulative time requests spend processing inference outputs, in microseconds",
     lambda v, h: v.stats.compute.output.ns // 1000),
    (GaugeMetricFamily, "nv_inference_pending_request_count", "Requests waiting in the queue for an execution",
     lambda v, h: h.queued),
    (_COUNTER, "infer_request_count", "Inference requests that reached the model, successful or failed",
     lambda v, h: v.stats.success.count + v.stats.fail.count),
    (GaugeMetricFamily, "inference_queue_depth", "Requests waiting in the queue for an execution",
     lambda v, h: h.queued),
    (_COUNTER, "ascend_batch_padding_rows", "Zero rows added to batches to reach a batch size the model file takes",
     lambda v, h: h.padding_rows),
)

#: Triton's per-model response cache counters (core's metrics.cc), for the versions whose config enables
#: the cache (whether or not the server has one, as Triton shows them).
_PER_CACHED_VERSION: tuple[tuple[str, str, Callable[[ServedVersion], float]], ...] = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", lambda v: v.stats.cache_hit.count),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     lambda v: v.stats.cache_hit.ns // 1000),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", lambda v: v.stats.cache_miss.count),
    ("nv_cache_miss_duration_per_model", "Total cache miss (insert+lookup) duration per model, in microseconds",
     lambda v: v.stats.cache_miss.ns // 1000),
)

#: Triton's local cache gauges, server-wide and unlabelled (local_cache's LocalCache::InitMetrics).
_CACHE: tuple[tuple[str, str, Callable[[ResponseCache], float]], ...] = (
    ("nv_cache_util", "Cache utilization [0.0 - 1.0]", lambda c: c.used / c.size),
    ("nv_cache_num_entries", "Number of responses stored in response cache", lambda c: c.entries),
    ("nv_cache_num_hits", "Number of cache hits in response cache", lambda c: c.hits),
    ("nv_cache_num_misses", "Number of cache misses in response cache", lambda c: c.misses),
    ("nv_cache_num_lookups", "Number of cache lookups in response cache", lambda c: c.lookups),
    ("nv_cache_num_evictions", "Number of cache evictions in response cache", lambda c: c.evictions),
    ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds", lambda c: c.lookup_us),
    ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds", lambda c: c.insertion_us),
)

INSTANCE_LABELS = (*LABELS, "instance", "device")

#: (name, help, value of one instance) of every per-instance gauge.
_PER_INSTANCE: tuple[tuple[str, str, Callable[[InstanceHealth], float]], ...] = (
    ("ascend_instance_healthy", "1 while the instance is in rotation, 0 once a device fault or an execution timeout took it out",
     lambda i: 0 if i.out_of_rotation else 1),
    ("ascend_runtime_degraded", "1 when the instance's runtime serves below what the config asked (see model metadata)",
     lambda i: 1 if i.degraded else 0),
)

#: The failure counters: Triton's and the CANN design's names, labelled with the reason.
_FAILURES = (
    ("nv_inference_request_failure", "Failed inference requests by reason, whatever their batch size"),
    ("infer_request_failure_count", "Failed inference requests by reason (REJECTED, CANCELED, BACKEND, OTHER)"),
)


class RepositoryCollector(Collector):
    """Yields the metrics of every version the repository serves, at scrape time.

    Runs off the event loop, on another thread than the one changing what it reads: the HTTP port's `/metrics`
    renders the registry through asyncio.to_thread (so does the engine's when a frontend of `--workers N` asks it),
    the metrics port on prometheus_client's server thread; so it only copies containers and reads numbers.
    """

    def __init__(self, repository: Repository):
        self.repository = repository

    def collect(self) -> Iterator[Metric]:
        # list(...) of a dict's values is atomic: a model loading meanwhile is seen whole or not at all.
        seen = [(v, v.health_snapshot()) for model in list(self.repository.models.values()) for v in list(model.versions.values())]
        for family, name, documentation, value in _PER_VERSION:
            metric = family(name, documentation, labels=LABELS)
            for version, health in seen:
                metric.add_metric(_labels(version), value(version, health))
            yield metric
        for name, documentation, value in _PER_INSTANCE:
            metric = GaugeMetricFamily(name, documentation, labels=INSTANCE_LABELS)
            for version, health in seen:
                for index, instance in enumerate(health.instances):
                    metric.add_metric([*_labels(version), str(index), str(instance.device_id)], value(instance))
            yield metric
        versions = [version for version, _ in seen]
        cached = [version for version in versions if version.config.response_cache.enable]
        for name, documentation, value in _PER_CACHED_VERSION:
            metric = _COUNTER(name, documentation, labels=LABELS)
            for version in cached:
                metric.add_metric(_labels(version), value(version))
            yield metric
        if (cache := self.repository.cache) is not None:
            for name, documentation, value in _CACHE:
                yield GaugeMetricFamily(name, documentation, value=value(cache))
        yield from _failures(versions)
        yield _latency(versions)
        yield _batch_sizes(versions)
        utilization = _utilization(seen)
        if utilization.samples:  # absent, not zero, where no runtime can read its device
            yield utilization
        yield from _memory(self.repository.memory, list(self.repository.models), versions)


def _labels(version: ServedVersion) -> list[str]:
    return [version.name, str(version.version)]


def _failures(versions: list[ServedVersion]) -> Iterator[Metric]:
    counts = [(_labels(v), dict(v.stats.failures)) for v in versions]
    for name, documentation in _FAILURES:
        metric = _COUNTER(name, documentation, labels=(*LABELS, "reason"))
        for labels, failures in counts:
            for reason in FAILURE_REASONS:
                metric.add_metric([*labels, reason], failures[reason])
        yield metric


def _latency(versions: list[ServedVersion]) -> HistogramMetricFamily:
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


def _batch_sizes(versions: list[ServedVersion]) -> HistogramMetricFamily:
    metric = HistogramMetricFamily("batch_size_distribution", "Rows per model execution", labels=LABELS)
    bounds = (*BATCH_BUCKETS, float("inf"))
    for version in versions:
        executions = [(size, batch.infer.count) for size, batch in list(version.stats.batches.items())]
        buckets = [(floatToGoString(b), sum(n for size, n in executions if size <= b)) for b in bounds]
        metric.add_metric(_labels(version), buckets, sum(size * n for size, n in executions))
    return metric


def _utilization(seen: list[Seen]) -> GaugeMetricFamily:
    """One sample per device: the first of its instances that can read the device answers."""
    metric = GaugeMetricFamily("npu_utilization_percent", "AI Core utilization of the NPU, percent", labels=("device",))
    answered: set[int] = set()
    for instance in (instance for _, health in seen for instance in health.instances):
        if instance.device_id not in answered and instance.utilization is not None:
            answered.add(instance.device_id)
            metric.add_metric([str(instance.device_id)], instance.utilization)
    return metric


def _memory(ledger: Ledger, models: list[str], versions: list[ServedVersion]) -> Iterator[Metric]:
    used = GaugeMetricFamily("ascend_device_memory_used_bytes", "Memory in use on the device (the host's without pyACL)", labels=("device",))
    total = GaugeMetricFamily("ascend_device_memory_total_bytes", "Memory of the device (the host's without pyACL)", labels=("device",))
    budget = GaugeMetricFamily("ascend_device_memory_budget_bytes", "Memory the models may take on the device", labels=("device",))
    for device in ledger.devices():
        reading = ledger.device_free(device)
        in_use, size = (reading[1] - reading[0], reading[1]) if reading is not None else memory_meter.host_memory()
        used.add_metric([str(device)], in_use)
        total.add_metric([str(device)], size)
        if (limit := ledger.budget(device)) is not None:
            budget.add_metric([str(device)], limit)
    yield from (used, total, budget)
    held = GaugeMetricFamily("ascend_model_memory_bytes", "Memory the loaded version holds, over its devices", labels=LABELS)
    for version in versions:
        if version.memory:
            held.add_metric(_labels(version), sum(version.memory.values()))
    yield held
    loads = _COUNTER("ascend_model_loads", "Loads of the model by reason: startup, explicit, on_demand, poll", labels=("model", "reason"))
    for (model, reason), count in list(ledger.loads.items()):
        loads.add_metric([model, reason], count)
    yield loads
    # Every model of the repository has its series from the start, at zero until it is evicted or waited for:
    # a dashboard's rate() and histogram_quantile() then show 0, not "no data" (Prometheus's advice on counters).
    evictions = _COUNTER("ascend_model_evictions", "Unloads of the model to make room for another (--load_on_demand)", labels=("model",))
    for model in models:
        evictions.add_metric([model], ledger.evictions.get(model, 0))
    yield evictions
    waits = HistogramMetricFamily(
        "ascend_model_load_wait_seconds", "Time requests waited for the model to load on demand", labels=("model",)
    )
    bounds = [floatToGoString(b) for b in (*WAIT_BUCKETS_S, float("inf"))]
    for model in models:
        counts, seconds = ledger.waits.get(model) or ([0] * len(bounds), 0.0)
        waits.add_metric([model], list(zip(bounds, itertools.accumulate(list(counts)))), seconds)
    yield waits


def register(repository: Repository, port: int = 0) -> None:
    """Adds the repository's metrics to prometheus_client's registry; serves it on `port` too (0: no)."""
    REGISTRY.register(RepositoryCollector(repository))
    _register_npu_telemetry(REGISTRY)
    if port:
        serve(port, REGISTRY)


def _register_npu_telemetry(registry: CollectorRegistry) -> None:
    if (telemetry := npu_telemetry.open_collector()) is not None:
        registry.register(telemetry)


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
    _register_npu_telemetry(registry)
    MultiProcessCollector(registry, frontends_dir)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    if port:
        serve(port, registry)
    return registry

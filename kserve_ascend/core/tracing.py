"""OpenTelemetry spans of a request's life: `infer` at the edge, `queue` until its batch starts, `execute`.

A batch serves several requests, so its `execute` span is a root of its own, linked to
the `queue` span of every request it serves (OpenTelemetry's shape for batch work).

Off by default. While off, the hot path pays checks of `enabled` (and enters one shared
no-op context manager per request and per batch): no span objects, not even no-op ones,
no context propagation, and opentelemetry-sdk is never imported.
"""

from __future__ import annotations

import contextlib
import os
import time
from importlib.metadata import entry_points
from typing import Callable, Iterator, Mapping, Sequence

from opentelemetry import context, propagate, trace
from opentelemetry.trace import Span

from .. import __version__

enabled = False

MODEL_NAME = "model.name"
MODEL_VERSION = "model.version"
REQUEST_ID = "request.id"
DEVICE_ID = "device.id"
BATCH_SIZE = "batch.size"  # rows, as max_batch_size counts them
BATCH_REQUESTS = "batch.requests"

SERVICE_NAME = "kserve-ascend"

_tracer: trace.Tracer = trace.NoOpTracer()
_OFF = contextlib.nullcontext()
_BATCH_ROOT = context.Context()  # no parent: a batch belongs to none of its requests' traces alone


def enable() -> None:
    """Exports spans with opentelemetry-sdk to the exporters `OTEL_TRACES_EXPORTER` names (OTLP/gRPC by default).

    The rest of the standard environment applies as usual: `OTEL_EXPORTER_OTLP_ENDPOINT`,
    `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`, `OTEL_SERVICE_NAME` (default `kserve-ascend`),
    `OTEL_RESOURCE_ATTRIBUTES`. Spans leave through a BatchSpanProcessor's own thread,
    never the event loop; the provider flushes them at exit.
    """
    global enabled, _tracer
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    default_name = {} if "OTEL_SERVICE_NAME" in os.environ else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(default_name))
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("kserve_ascend", __version__)
    enabled = True


def _exporters() -> list:
    """The exporters of `OTEL_TRACES_EXPORTER`, by the entry points exporter packages register."""
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip() not in ("", "none")]
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    exporters = []
    for name in names:
        if name == "otlp":  # as the SDK's own configurator resolves it
            name = "otlp_proto_http" if protocol.startswith("http") else "otlp_proto_grpc"
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            available = sorted(e.name for e in entry_points(group="opentelemetry_traces_exporter"))
            raise SystemExit(f"kserve-ascend: trace exporter '{name}' (OTEL_TRACES_EXPORTER) is not installed: {available} are")
        exporters.append(next(iter(found)).load()())
    return exporters


def infer_span(model: str, carrier: Mapping[str, str] | None, request_id: Callable[[], str | None]):
    """The `infer` span of one request at the edge, made current so its `queue` span is its child.

    `carrier`: the request's headers (or gRPC metadata), whose W3C `traceparent` makes the
    span a child of the client's. `request_id` is read when the span ends, once the edge
    has decoded the id the client gave. Yields None while tracing is off.
    """
    if not enabled:
        return _OFF
    return _infer_span(model, carrier, request_id)


@contextlib.contextmanager
def _infer_span(model: str, carrier: Mapping[str, str] | None, request_id: Callable[[], str | None]) -> Iterator[Span]:
    parent = propagate.extract(carrier) if carrier is not None else None
    with _tracer.start_as_current_span("infer", parent, trace.SpanKind.SERVER, {MODEL_NAME: model}) as span:
        try:
            yield span
        finally:
            if (rid := request_id()) is not None:
                span.set_attribute(REQUEST_ID, rid)


def start_queue() -> Span:
    """A request enters the queue: its `queue` span, child of the current (`infer`) span."""
    return _tracer.start_span("queue")


def leave_queue(span: Span) -> None:
    """Ends a `queue` span whose request left without a batch (rejected on timeout, cancelled, unloaded)."""
    if span.is_recording():
        span.set_status(trace.StatusCode.ERROR, "left the queue without being executed")
        span.end()


def instance_attributes(model: str, version: int, device_id: int) -> dict[str, object]:
    """What every `execute` span of one instance says about where it ran."""
    return {MODEL_NAME: model, MODEL_VERSION: version, DEVICE_ID: device_id}


def execution(batch: Sequence, attributes: Mapping[str, object]):
    """The `execute` span of one batch (its Pending requests) on the instance `attributes` describe.

    Ends the requests' `queue` spans at its start and links to them. A context manager;
    while tracing is off, a shared no-op one.
    """
    if not enabled:
        return _OFF
    start = time.time_ns()
    for pending in batch:
        if pending.span.is_recording():  # not if its caller left in the meantime
            pending.span.end(start)
    return _tracer.start_as_current_span(
        "execute",
        _BATCH_ROOT,
        attributes={**attributes, BATCH_SIZE: sum(p.rows for p in batch), BATCH_REQUESTS: len(batch)},
        links=[trace.Link(p.span.get_span_context()) for p in batch],
        start_time=start,
    )

"""Logs that name their request (`--log_format json`, text) and OpenTelemetry spans (`--enable_tracing`).

Spans go over real OTLP/gRPC to a collector this test runs (opentelemetry-proto's
TraceService), as they would to an OpenTelemetry Collector or Jaeger.
"""

from __future__ import annotations

import json
import threading
from concurrent import futures

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from tritonclient.utils import InferenceServerException

from conftest import attributes, copy_model, otel_env, start_server, stop_server, wait_for

WRONG_SHAPE = {"name": "INPUT0", "shape": [1, 5], "datatype": "FP32", "data": [1, 2, 3, 4, 5]}  # sim takes [-1, 4]
ROW = {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}


@pytest.fixture(scope="module")
def sim_repository(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    copy_model("sim", repository)
    return repository


def grpc_wrong_shape(server, **kwargs) -> None:
    client = grpcclient.InferenceServerClient(server.grpc)
    tensor = grpcclient.InferInput("INPUT0", [1, 5], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 5), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer("sim", [tensor], **kwargs)


def log_lines(server) -> list[str]:
    return [line for line in server.output().splitlines() if line.strip()]


# ---------------------------------------------------------------- logs


def test_json_logs_are_one_object_per_line_naming_the_request(sim_repository, tmp_path):
    server = start_server(sim_repository, tmp_path / "server.log", "--log_format", "json", "--enable_access_log")
    try:
        assert requests.post(f"{server.url}/v2/models/sim/infer", json={"id": "oip-1", "inputs": [WRONG_SHAPE]}).status_code == 400
        # The OIP id names a request ahead of its x-request-id header.
        both = {"id": "oip-2", "inputs": [WRONG_SHAPE]}
        assert requests.post(f"{server.url}/v2/models/sim/infer", json=both, headers={"x-request-id": "hdr-0"}).status_code == 400
        assert requests.get(f"{server.url}/v2/models/nosuch", headers={"x-request-id": "hdr-1"}).status_code == 404
        assert requests.post(f"{server.url}/v2/models/sim/infer", json={"inputs": [WRONG_SHAPE]}).status_code == 400
        grpc_wrong_shape(server, request_id="grpc-1")
        grpc_wrong_shape(server, headers={"x-request-id": "grpc-hdr-1"})
        assert requests.post(f"{server.url}/v2/models/sim/infer", json={"id": "ok-1", "inputs": [ROW]}).status_code == 200
    finally:
        stop_server(server)

    records = [json.loads(line) for line in log_lines(server)]  # every line, start-up to shutdown
    assert all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    by_id: dict[str, list[dict]] = {}
    for record in records:
        by_id.setdefault(record.get("request_id"), []).append(record)

    def loggers(request_id: str) -> set[str]:
        return {record["logger"] for record in by_id.get(request_id, [])}

    # The edge's line about the mistake and uvicorn's access line both carry the request's id.
    assert loggers("oip-1") == {"kserve_ascend.server.edges.rest", "uvicorn.access"}
    assert "has shape [1, 5]" in by_id["oip-1"][0]["message"]
    assert loggers("oip-2") == {"kserve_ascend.server.edges.rest", "uvicorn.access"} and "hdr-0" not in by_id
    assert loggers("hdr-1") == {"kserve_ascend.server.edges.rest", "uvicorn.access"}
    assert loggers("grpc-1") == {"kserve_ascend.server.edges.grpc"}
    assert loggers("grpc-hdr-1") == {"kserve_ascend.server.edges.grpc"}
    assert loggers("ok-1") == {"uvicorn.access"}
    # A request without an id gets a fresh one, the same on each of its lines.
    mistakes = {r["request_id"] for r in records if r["logger"] == "kserve_ascend.server.edges.rest" and "has shape" in r["message"]}
    (fresh,) = mistakes - {"oip-1", "oip-2"}
    assert loggers(fresh) == {"kserve_ascend.server.edges.rest", "uvicorn.access"} and len(by_id[fresh]) == 2
    # Lines outside any request (start-up, shutdown) have none.
    assert any("repository loaded" in record["message"] for record in by_id[None])


def test_text_logs_keep_kserves_look_and_add_the_request_id(sim_repository, tmp_path):
    server = start_server(sim_repository, tmp_path / "server.log")
    try:
        assert requests.post(f"{server.url}/v2/models/sim/infer", json={"id": "oip-7", "inputs": [WRONG_SHAPE]}).status_code == 400
    finally:
        stop_server(server)
    lines = [line for line in log_lines(server) if "request_id=oip-7" in line]
    assert len(lines) == 1  # the edge's line: no access line unless --enable_access_log, as in Triton
    assert "kserve_ascend.server.edges.rest INFO" in lines[0]
    assert lines[0].endswith("has shape [1, 5], the model expects [-1, 4] request_id=oip-7")
    assert not any("uvicorn.access" in line or '"POST /v2/models/sim/infer' in line for line in log_lines(server))
    assert not any("request_id=" in line for line in log_lines(server) if "repository loaded" in line)


# ---------------------------------------------------------------- traces


def concurrent_sim_requests(server, count: int, traceparent: str) -> None:
    """`count` one-row requests at once, half over REST and half over gRPC; the first continues a client trace."""
    start = threading.Barrier(count)

    def send(i: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc) if i % 2 else None
        start.wait()
        if client is None:
            headers = {"traceparent": traceparent} if i == 0 else {}
            response = requests.post(f"{server.url}/v2/models/sim/infer", json={"id": f"req-{i}", "inputs": [ROW]}, headers=headers)
            assert response.status_code == 200
        else:
            tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
            client.infer("sim", [tensor], request_id=f"req-{i}")

    with futures.ThreadPoolExecutor(count) as pool:
        list(pool.map(send, range(count)))


def test_tracing_exports_infer_queue_and_execute_spans(sim_repository, tmp_path, collector):
    collector.clear()
    count = 16
    client_trace, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    server = start_server(sim_repository, tmp_path / "server.log", "--enable_tracing", env=otel_env(collector))
    try:
        concurrent_sim_requests(server, count, f"00-{client_trace}-{client_span}-01")
        wait_for(lambda: len(collector.named("infer")) >= count, "every infer span exported", server=server)
    finally:
        stop_server(server)  # flushes whatever is left
    assert collector.services == {"kserve-ascend"}

    infers = {attributes(span)["request.id"]: span for span in collector.named("infer")}
    assert sorted(infers) == sorted(f"req-{i}" for i in range(count))
    for span in infers.values():
        assert span.kind == Span.SPAN_KIND_SERVER
        assert (attributes(span)["model.name"], attributes(span)["model.version"]) == ("sim", 1)
    # The client's W3C trace context makes its request's span a child of the client's.
    assert infers["req-0"].trace_id.hex() == client_trace and infers["req-0"].parent_span_id.hex() == client_span
    assert not infers["req-2"].parent_span_id

    # Each request waited in one `queue` span, the child of its `infer` span.
    queues = {(span.trace_id, span.parent_span_id): span for span in collector.named("queue")}
    assert len(queues) == count
    queue_of = {rid: queues[(span.trace_id, span.span_id)] for rid, span in infers.items()}

    # Each `execute` span is a root linked to the queue spans of the requests its batch served,
    # every request in exactly one batch; a queue span ends as its batch starts.
    executes = collector.named("execute")
    linked = [(link.trace_id, link.span_id) for span in executes for link in span.links]
    assert sorted(linked) == sorted((q.trace_id, q.span_id) for q in queue_of.values())
    queue_by_id = {(q.trace_id, q.span_id): q for q in queue_of.values()}
    for span in executes:
        assert not span.parent_span_id
        assert attributes(span) == {
            "model.name": "sim", "model.version": 1, "device.id": 0,
            "batch.size": len(span.links), "batch.requests": len(span.links),
        }
        assert all(queue_by_id[(link.trace_id, link.span_id)].end_time_unix_nano == span.start_time_unix_nano for link in span.links)
    assert max(len(span.links) for span in executes) > 1  # dynamic batching served several at once


def test_without_the_flag_no_span_is_exported(sim_repository, tmp_path, collector):
    collector.clear()
    server = start_server(sim_repository, tmp_path / "server.log", env=otel_env(collector))
    try:
        concurrent_sim_requests(server, 4, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    finally:
        stop_server(server)  # an SDK, had one started, would flush its spans at exit
    assert collector.spans == []

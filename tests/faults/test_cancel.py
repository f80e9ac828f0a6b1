"""Cancellation: a request whose client leaves before its answer (issue 18, item 2).

- HTTP client disconnects while its request is queued -> the request leaves the queue, never runs, and is
  counted a failure with reason CANCELED (statistics `fail`, nv_inference_request_failure{reason="CANCELED"})
- gRPC call cancelled by its client while queued -> the same
- gRPC call whose deadline passes while queued -> the same (its client sees DEADLINE_EXCEEDED)
- the client leaves while its request executes -> the execution finishes without error, its answer is
  dropped; counted CANCELED
- then -> the server goes on serving: the next request is answered

Each runs on the one-process server and with `--workers 2`, where the frontend tells the engine to cancel.
Executions are held in a device call (the FAKE pyACL's hang on acl.rt.set_context, released by the test),
so which requests are queued and which executes is known without timing anything.
"""

from __future__ import annotations

import queue
import socket
import threading

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient

from conftest import (
    fake_acl_env,
    hold_executions,
    load_fake_acl,
    pending,
    post_infer,
    release_executions,
    scrape,
    start_server,
    statistics,
    stop_server,
    wait_for,
    write_faults,
)

MODEL = "held"
ACL_FLOAT = 0
#: Requests a test cancels: one of them executes (held), the others are queued behind it.
CANCELLED = 3


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def server(request, tmp_path_factory):
    fake_acl = load_fake_acl()
    root = tmp_path_factory.mktemp("cancel_repo")
    (root / MODEL / "1").mkdir(parents=True)
    fake_acl.fake_write_om(root / MODEL / "1" / "model.om", [("INPUT0", ACL_FLOAT, [1, 4])])
    # One request per execution, one instance: while one executes, the others wait in the queue.
    (root / MODEL / "config.pbtxt").write_text(f'name: "{MODEL}"\nbackend: "ascend"\nmax_batch_size: 1\n')
    faults = root.parent / "cancel_faults.json"
    write_faults(faults, [])
    env = fake_acl_env(faults)
    srv = start_server(root, root.parent / "cancel.log", env=env, workers=request.param)
    srv.faults = faults
    yield srv
    stop_server(srv)


# ---------------------------------------------------------------- the server's side


def counts(server) -> dict[str, int]:
    """What the statistics and metrics count of the model's requests so far."""
    stats = statistics(server, MODEL)
    failures = scrape(server).by("reason", "nv_inference_request_failure", model=MODEL)
    return {
        "executions": stats["execution_count"],
        "success": stats["inference_stats"]["success"]["count"],
        "fail": stats["inference_stats"]["fail"]["count"],
        **{reason: int(failures[reason]) for reason in ("CANCELED", "BACKEND", "OTHER")},
    }


def cancelled_alone(server, before: dict, after: dict, cancelled: int) -> None:
    """Only the cancelled requests failed, as CANCELED; one of them executed (held), then the survivor."""
    delta = {key: after[key] - before[key] for key in before}
    assert delta == {"executions": 2, "success": 1, "fail": cancelled, "CANCELED": cancelled, "BACKEND": 0, "OTHER": 0}


def no_errors_logged(server) -> None:
    lines = [line for line in server.output().splitlines() if "ERROR" in line or "Traceback" in line]
    assert not lines, "\n".join(lines)


# ---------------------------------------------------------------- the clients


def body(value: float) -> bytes:
    return orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]})


def http_sent(server, value: float) -> socket.socket:
    """A connection that has sent a whole inference request, and reads nothing back."""
    data = body(value)
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.sendall(
        b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (MODEL.encode(), len(data), data)
    )
    return sock


def grpc_inputs(value: float) -> list:
    tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [tensor]


class Answers:
    """tritonclient's async_infer callbacks: (result, error) per request, in the order they come."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()

    def __call__(self, result, error):
        self.queue.put((result, error))

    def next(self):
        return self.queue.get(timeout=15)


# ---------------------------------------------------------------- the tests


def test_http_client_leaving_cancels_its_request(server):
    before = counts(server)
    hold_executions(server)
    try:
        clients = [http_sent(server, value) for value in range(CANCELLED)]
        wait_for(lambda: pending(server, MODEL) == CANCELLED - 1, "one executing, the others queued")
        for sock in clients:
            sock.close()  # the queued ones leave the queue; the executing one runs to its end
        wait_for(lambda: counts(server)["CANCELED"] - before["CANCELED"] == CANCELLED, "counted CANCELED")
        assert pending(server, MODEL) == 0
        survivor = {}
        thread = threading.Thread(
            target=lambda: survivor.update(answer=post_infer(server, MODEL, body(7)))
        )
        thread.start()
        wait_for(lambda: pending(server, MODEL) == 1, "queued behind the held execution")
    finally:
        release_executions(server)
    thread.join(timeout=30)
    answer = survivor["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [7.0] * 4
    cancelled_alone(server, before, counts(server), CANCELLED)
    no_errors_logged(server)


def test_grpc_cancel_and_deadline_cancel_the_request(server):
    client = grpcclient.InferenceServerClient(server.grpc)
    answers = Answers()
    before = counts(server)
    hold_executions(server)
    try:
        calls = [client.async_infer(MODEL, grpc_inputs(value), answers) for value in range(CANCELLED)]
        wait_for(lambda: pending(server, MODEL) == CANCELLED - 1, "one executing, the others queued")
        for call in calls:
            call.cancel()
        for _ in calls:
            result, error = answers.next()
            assert result is None and "CANCELLED" in str(error.status())
        # A deadline that passes while the request waits cancels it as well.
        client.async_infer(MODEL, grpc_inputs(5), answers, client_timeout=0.5)
        result, error = answers.next()
        assert result is None and error.status() == "StatusCode.DEADLINE_EXCEEDED"
        wait_for(lambda: counts(server)["CANCELED"] - before["CANCELED"] == CANCELLED + 1, "counted CANCELED")
        assert pending(server, MODEL) == 0
        client.async_infer(MODEL, grpc_inputs(7), answers)
        wait_for(lambda: pending(server, MODEL) == 1, "queued behind the held execution")
    finally:
        release_executions(server)
    result, error = answers.next()
    assert error is None, error
    assert result.as_numpy("INPUT0_out").tolist() == [[7.0] * 4]
    cancelled_alone(server, before, counts(server), CANCELLED + 1)
    no_errors_logged(server)
    client.close()

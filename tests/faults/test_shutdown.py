"""Faults at shutdown, with one process and with --workers 2 (an engine and two frontends): fault -> answer.

- SIGTERM under a closed loop of 32 clients (REST and gRPC) -> at once unready (REST, gRPC, the models) and
  still live; a new request refused, 503 {"error": "...shutting down..."} / UNAVAILABLE, or its connection
  refused once the ports have closed; every request accepted before answered 200; the process exits 0.
- SIGTERM under 32 clients that open a connection per request -> every connection the kernel accepted is
  answered, 200 or 503, or refused before it is accepted: none is reset when the HTTP port closes.
- a request still executing, or queued, at --shutdown_timeout_s -> failed 503 / UNAVAILABLE "...not answered
  within the shutdown timeout"; the process exits 0, not held by the device call that never returns.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from urllib3.exceptions import NewConnectionError

from conftest import copy_model, pending, start_server, stop_server, wait_for

WORKERS = pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
#: Beyond --shutdown_timeout_s, what the process may take to exit (its interpreter's teardown): a bound that a
#: process held by a request or a thread exceeds by minutes, not a measurement.
EXIT_MARGIN_S = 10
CLIENTS = 32


def sim_model(repository: Path, name: str, max_batch_size: int, delay_us: int, fixed_ms: float) -> None:
    """A `sim` model (output = input) batching up to `max_batch_size` rows, waiting up to `delay_us` for them."""
    copy_model("sim", repository, name)
    (repository / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: {max_batch_size}\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
        f'parameters {{ key: "sim_fixed_ms" value: {{ string_value: "{fixed_ms}" }} }}\n'
    )


def body(value: float) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]}).encode()


def grpc_input(value: float) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return tensor


def refused_connecting(error: requests.ConnectionError) -> bool:
    """Whether the connection was refused: the server no longer listened, the request never reached it."""
    reason = getattr(error.args[0], "reason", None) if error.args else None
    return isinstance(reason, NewConnectionError) and isinstance(reason.__cause__, ConnectionRefusedError)


def rest_outcome(call) -> tuple[str, dict | None]:
    """("answered", body) for a 200, ("refused", None) for a retryable refusal, else ("lost: ...", None)."""
    try:
        response = call()
    except requests.ConnectionError as error:
        return ("refused", None) if refused_connecting(error) else (f"lost: {error!r}", None)
    if response.status_code == 200:
        return "answered", response.json()
    if response.status_code == 503 and "shutting down" in response.json().get("error", ""):
        return "refused", None
    return f"lost: {response.status_code} {response.text}", None


def grpc_outcome(call) -> tuple[str, object]:
    """As `rest_outcome`: UNAVAILABLE is a refusal when the server says it is shutting down, or when the
    connection could not be made (no port any more); any other failure is a request lost."""
    try:
        return "answered", call()
    except InferenceServerException as error:
        message = error.message() or ""
        if error.status() == "StatusCode.UNAVAILABLE" and (
            "shutting down" in message or "failed to connect" in message.lower() or "Connection refused" in message
        ):
            return "refused", None
        return f"lost: {error.status()} {message}", None


def rest_client(url: str, value: float, answers: list[int], index: int, stop: threading.Event) -> str:
    """A closed loop over one kept-alive connection until its first refusal: what ended it."""
    with requests.Session() as session:
        while not stop.is_set():
            outcome, answer = rest_outcome(lambda: session.post(f"{url}/v2/models/sim/infer", data=body(value), timeout=30))
            if outcome != "answered":
                return outcome
            if answer["outputs"][0]["data"] != [value] * 4:
                return f"lost: answered {answer}"
            answers[index] += 1
    return "stopped by the test"


def grpc_client(address: str, value: float, answers: list[int], index: int, stop: threading.Event) -> str:
    client = grpcclient.InferenceServerClient(address)
    try:
        while not stop.is_set():
            outcome, result = grpc_outcome(lambda: client.infer("sim", [grpc_input(value)], client_timeout=30))
            if outcome != "answered":
                return outcome
            if not (result.as_numpy("OUTPUT0") == value).all():
                return f"lost: answered {result.as_numpy('OUTPUT0')}"
            answers[index] += 1
    finally:
        client.close()
    return "stopped by the test"


@WORKERS
def test_sigterm_under_load_answers_every_accepted_request_and_refuses_the_rest(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("sim", repository)  # 20 ms + 1 ms a row per batch of up to 8: requests queue while one executes
    # One request waits up to 3 s for a second row: it holds the drain open while the probes below ask.
    sim_model(repository, "held", max_batch_size=2, delay_us=3_000_000, fixed_ms=1)
    server = start_server(repository, tmp_path / "server.log", "--shutdown_timeout_s", "10", workers=workers)
    stop = threading.Event()
    answers = [0] * CLIENTS
    pool = futures.ThreadPoolExecutor(CLIENTS + 1)
    try:
        clients = [
            pool.submit(rest_client, server.url, float(i), answers, i, stop) if i % 2 == 0
            else pool.submit(grpc_client, server.grpc, float(i), answers, i, stop)
            for i in range(CLIENTS)
        ]
        wait_for(lambda: min(answers) >= 2, "every client answered twice")
        held = pool.submit(rest_outcome, lambda: requests.post(f"{server.url}/v2/models/held/infer", data=body(-1.0), timeout=30))
        wait_for(lambda: pending(server, "held") == 1, "the held request queued")
        server.process.send_signal(signal.SIGTERM)

        # Unready at once, while the held request is still to be answered; live all along.
        wait_for(lambda: requests.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 400, "readiness false")
        assert requests.get(f"{server.url}/ready", timeout=5).json() == {"ready": False}
        assert requests.get(f"{server.url}/v2/health/live", timeout=5).status_code == 200
        model_ready = requests.get(f"{server.url}/v2/models/sim/ready", timeout=5)
        assert model_ready.status_code == 400 and "shutting down" in model_ready.json()["error"]
        probe = grpcclient.InferenceServerClient(server.grpc)
        try:
            assert probe.is_server_live() and not probe.is_server_ready() and not probe.is_model_ready("sim")
            # A new request, REST or gRPC, is refused with the retryable status, not queued.
            with pytest.raises(InferenceServerException) as refusal:
                probe.infer("sim", [grpc_input(1.0)])
            assert refusal.value.status() == "StatusCode.UNAVAILABLE" and "shutting down" in refusal.value.message()
        finally:
            probe.close()
        refused = requests.post(f"{server.url}/v2/models/sim/infer", data=body(1.0), timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
        assert refused.headers["connection"] == "close"  # the client's next request goes elsewhere

        ends = [client.result(timeout=60) for client in clients]
        held_outcome, held_answer = held.result(timeout=60)
        assert server.process.wait(timeout=10 + EXIT_MARGIN_S) == 0
    finally:
        stop.set()
        stop_server(server)
        pool.shutdown()  # each client ends at its first refusal, or at `stop`
    assert [end for end in ends if end != "refused"] == []  # every client ran until refused, and lost nothing
    assert min(answers) >= 2
    assert held_outcome == "answered" and held_answer["outputs"][0]["data"] == [-1.0] * 4  # accepted before SIGTERM
    assert "Traceback" not in server.output()


def connecting_client(port: int, value: float, answers: list[int], index: int, stop: threading.Event) -> list[str]:
    """A closed loop of requests each on a new connection (http.client), until its connection is refused: the
    outcome of each after the first refusal by 503."""
    outcomes: list[str] = []
    while not stop.is_set():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("POST", "/v2/models/sim/infer", body(value), {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = json.loads(response.read())
        except ConnectionRefusedError:
            return [*outcomes, "refused"]
        except (OSError, http.client.HTTPException) as error:  # reset, broken pipe, an empty reply
            outcomes.append(f"lost: {error!r}")
            continue
        finally:
            connection.close()
        if response.status == 200 and answer["outputs"][0]["data"] == [value] * 4:
            answers[index] += 1
            if outcomes:
                outcomes.append("answered")
        elif response.status == 503 and "shutting down" in answer["error"]:
            outcomes.append("503")
        else:
            outcomes.append(f"lost: {response.status} {answer}")
    return [*outcomes, "stopped by the test"]


@WORKERS
def test_sigterm_resets_no_connection_of_clients_connecting_per_request(tmp_path, workers):
    """The kernel accepts connections into the HTTP port's queue until it closes, and resets those still
    queued then (each SO_REUSEPORT socket's own, with --workers): the server empties the queue first."""
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("sim", repository)
    server = start_server(repository, tmp_path / "server.log", "--shutdown_timeout_s", "10", workers=workers)
    stop = threading.Event()
    answers = [0] * CLIENTS
    pool = futures.ThreadPoolExecutor(CLIENTS)
    try:
        clients = [pool.submit(connecting_client, server.http_port, float(i), answers, i, stop) for i in range(CLIENTS)]
        wait_for(lambda: min(answers) >= 2, "every client answered twice")
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=10 + EXIT_MARGIN_S) == 0
        ends = [client.result(timeout=60) for client in clients]
    finally:
        stop.set()
        stop_server(server)
        pool.shutdown()
    # Each client went on connecting until refused, its requests answered or refused meanwhile: none lost.
    assert [outcome for outcomes in ends for outcome in outcomes if outcome.startswith("lost")] == []
    assert [outcomes[-1] for outcomes in ends] == ["refused"] * CLIENTS
    assert sum(outcomes.count("503") for outcomes in ends) > 0  # it connected while the server drained
    assert "Traceback" not in server.output()


@WORKERS
def test_requests_past_the_shutdown_timeout_fail_and_the_server_still_exits(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    # A batch of two rows forms only when both are there (it would wait 100 s for the second), then its
    # execution never ends in time (ten minutes): a device call that hangs.
    sim_model(repository, "stuck", max_batch_size=2, delay_us=100_000_000, fixed_ms=600_000)
    server = start_server(repository, tmp_path / "server.log", "--shutdown_timeout_s", "2", workers=workers)
    client = grpcclient.InferenceServerClient(server.grpc)
    url = f"{server.url}/v2/models/stuck/infer"

    def grpc_error() -> InferenceServerException:
        with pytest.raises(InferenceServerException) as failure:
            client.infer("stuck", [grpc_input(2.0)], client_timeout=60)
        return failure.value

    pool = futures.ThreadPoolExecutor(3)
    try:
        first = pool.submit(requests.post, url, data=body(1.0), timeout=60)
        wait_for(lambda: pending(server, "stuck") == 1, "the first request queued")
        second = pool.submit(grpc_error)
        wait_for(lambda: pending(server, "stuck") == 0, "the batch of both executing")
        third = pool.submit(requests.post, url, data=body(3.0), timeout=60)
        wait_for(lambda: pending(server, "stuck") == 1, "the third request queued behind it")
        server.process.send_signal(signal.SIGTERM)
        rest_answers, grpc_failure = [first.result(timeout=60), third.result(timeout=60)], second.result(timeout=60)
        assert server.process.wait(timeout=2 + EXIT_MARGIN_S) == 0
    finally:
        stop_server(server)
        pool.shutdown()
        client.close()
    unanswered = "the server is shutting down: the request was not answered within the shutdown timeout"
    assert [(answer.status_code, answer.json()) for answer in rest_answers] == [(503, {"error": unanswered})] * 2
    assert (grpc_failure.status(), grpc_failure.message()) == ("StatusCode.UNAVAILABLE", unanswered)
    output = server.output()
    assert "3 requests were not answered within the shutdown timeout" in output
    assert "Traceback" not in output

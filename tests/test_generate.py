"""The generate extension (`edges/generate.py`): the shapes and refusals the conformance models do not reach, and,
on kserve-ascend, kserve-ascend with --workers 2 and real Triton 2.51 side by side, what the wire cases of
conformance/cases/test_generate.py do not show: statistics, and a client leaving a stream."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from conftest import decoupled_repository, every_server, pending, statistics, wait_for
from kserve_ascend.core.errors import InvalidInput
from kserve_ascend.server.edges.generate import decode_generate, encode_generate, error_json

SIMPLE = {"INPUT0": list(range(16)), "INPUT1": [1] * 16}


def decoded(body: bytes, *inputs: tuple[str, str, list[int]]):
    return decode_generate(body, [{"name": n, "datatype": d, "shape": s} for n, d, s in inputs], "m", "", 0)


@pytest.mark.parametrize("shape, count, expected", [
    ([-1, 2], 6, (3, 2)),  # fixed dimensions take the elements first
    ([-1, -1, 4], 8, (1, 2, 4)),  # then the innermost variable one, the others 1
    ([3], 3, (3,)),
    ([-1], 0, (0,)),
    ([2, 2], 4, (2, 2)),
])
def test_values_are_shaped_as_triton_shapes_them(shape, count, expected):
    body = b'{"X": [%s]}' % b",".join(b"%d" % i for i in range(count))
    request = decoded(body, ("X", "INT16", shape))
    assert request.inputs["X"].shape == expected and request.inputs["X"].dtype == np.int16
    assert request.inputs["X"].ravel().tolist() == list(range(count))


@pytest.mark.parametrize("shape, count", [([2, -1], 5), ([4], 3), ([3], 1)])
def test_values_that_do_not_fill_the_shape_are_refused(shape, count):
    body = b'{"X": [%s]}' % b",".join(b"1" for _ in range(count))
    with pytest.raises(InvalidInput, match="The schema can not convert input 'X' to tensor with proper shape"):
        decoded(body, ("X", "INT32", shape))


def test_keys_under_parameters_are_read_like_the_others_and_an_input_given_twice_is_refused():
    request = decoded(b'{"parameters": {"X": "text", "temperature": 0.5}, "id": "i", "stop": true}', ("X", "BYTES", [1]))
    assert request.inputs["X"].tolist() == [b"text"] and request.id == "i"
    assert request.parameters == {"temperature": 0.5, "id": "i", "stop": True}
    with pytest.raises(InvalidInput, match="input 'X' appears twice"):
        decoded(b'{"X": "a", "parameters": {"X": "b"}}', ("X", "BYTES", [1]))
    with pytest.raises(InvalidInput, match="Keyword 'parameters' for nested schema also given as input tensor name"):
        decoded(b'{"parameters": {}}', ("parameters", "INT32", [1]))


def test_an_answer_has_its_keys_in_byte_order_and_a_lone_element_as_a_scalar():
    outputs = {"b": np.array([[1.5]], np.float32), "A": np.array([1, 2], np.int64), "text": np.array([b"hi"], object)}
    assert encode_generate("m", 3, "r", outputs) == (
        b'{"A":[1,2],"b":1.5,"id":"r","model_name":"m","model_version":"3","text":"hi"}'
    )
    with pytest.raises(InvalidInput, match="not UTF-8"):
        encode_generate("m", 1, "", {"text": np.array([b"\xff"], object)})


def test_an_error_within_an_answer_is_logged_as_the_edges_log_errors(caplog):
    """A stream's status is sent before the model fails: the log is where a server fault shows (with its trace)."""
    caplog.set_level("INFO", logger="kserve_ascend.server.edges.generate")
    assert error_json(RuntimeError("device lost")) == b'{"error":"RuntimeError: device lost"}'
    assert error_json(InvalidInput("no such output")) == b'{"error":"no such output"}'
    fault, refusal = caplog.records
    assert (fault.levelname, fault.exc_info[0]) == ("ERROR", RuntimeError)
    assert (refusal.levelname, refusal.getMessage()) == ("INFO", "generate: no such output")


# ---------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    yield from every_server(decoupled_repository(tmp_path_factory.mktemp("generate_repo")), tmp_path_factory)


def test_generate_requests_count_in_statistics_as_in_triton(servers):
    """The same generate requests on every server: each counts one request (a decoupled one, one execution)."""
    changes = {}
    for name, target in servers.items():
        before = {model: statistics(target, model) for model in ("simple", "repeat_int32")}
        assert requests.post(f"{target.url}/v2/models/simple/generate", json=SIMPLE, timeout=10).status_code == 200
        assert requests.post(f"{target.url}/v2/models/simple/generate_stream", json=SIMPLE, timeout=10).status_code == 200
        repeat = {"IN": [1, 2], "DELAY": [0, 0], "WAIT": 0}
        assert requests.post(f"{target.url}/v2/models/repeat_int32/generate_stream", json=repeat, timeout=10).status_code == 200

        def counts(model: str) -> tuple:
            stats = statistics(target, model)
            return tuple(stats["inference_stats"][key]["count"] - before[model]["inference_stats"][key]["count"] for key in ("success", "fail"))

        wait_for(lambda: counts("repeat_int32")[0] == 1, f"{name} to count the stream", timeout=10)
        changes[name] = {model: counts(model) for model in ("simple", "repeat_int32")}
    assert changes == {name: {"simple": (2, 0), "repeat_int32": (1, 0)} for name in servers}


@pytest.mark.parametrize("name", ["kserve-ascend", "workers"])
def test_a_client_leaving_generate_stops_the_model(servers, name):
    """/generate of a decoupled model whose second response is two minutes away holds the model's one instance; a
    second request waits for it. The first client closes its connection without an answer: the model stops,
    and the second request is answered long before those two minutes."""
    target = servers[name]
    body = b'{"IN": [1, 2], "DELAY": [0, 120000], "WAIT": 0}'
    with ThreadPoolExecutor(1) as pool:
        with socket.create_connection((target.http.split(":")[0], target.http_port), timeout=20) as connection:
            connection.sendall(
                b"POST /v2/models/repeat_int32/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            waiting = pool.submit(
                requests.post, f"{target.url}/v2/models/repeat_int32/generate", json={"IN": [9], "DELAY": [0], "WAIT": 0}, timeout=30
            )
            # One request waits while the other runs: the quick one cannot run long, so the long one runs.
            wait_for(lambda: pending(target, "repeat_int32") == 1 and not waiting.done(), "the second request to wait for the first")
        assert waiting.result().json()["OUT"] == 9


@pytest.mark.parametrize("name", ["kserve-ascend", "workers"])
def test_a_client_leaving_a_generate_stream_stops_the_model(servers, name):
    """The first event comes while the second response is two minutes away; the client then closes its connection,
    and the model's execution ends long before that (its request is recorded), freeing the instance."""
    target = servers[name]
    before = statistics(target, "repeat_int32")["execution_count"]
    body = b'{"IN": [1, 2], "DELAY": [0, 120000], "WAIT": 0}'
    with socket.create_connection((target.http.split(":")[0], target.http_port), timeout=20) as connection:
        connection.sendall(
            b"POST /v2/models/repeat_int32/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        while b'data: {"IDX":0' not in received:
            chunk = connection.recv(4096)
            assert chunk, received
            received += chunk
    assert b"200 OK" in received and b"text/event-stream" in received
    wait_for(lambda: statistics(target, "repeat_int32")["execution_count"] == before + 1, "the model to stop", timeout=20)
    again = requests.post(f"{target.url}/v2/models/repeat_int32/generate", json={"IN": [9], "DELAY": [0], "WAIT": 0}, timeout=20)
    assert again.json()["OUT"] == 9

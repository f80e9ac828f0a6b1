"""`--workers N`: one engine process owns the models, N frontend processes serve the ports.

What only several processes can get wrong: requests of both frontends batched together,
a shared memory region registered through one frontend and used through another,
statistics and metrics summed over the frontends, SIGTERM with requests in flight, a
frontend killed and replaced, tensors crossing in shared memory and never in messages.
Each test knows which frontend serves each of its HTTP connections: the process that
holds the server's end of it (/proc/net/tcp and /proc/<pid>/fd).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import (
    REPOSITORY, ROOT, alive, copy_model, descendants, free_port, pending, post_infer, scrape, sim_body, sim_model, start_server,
    stop_server, until, wait_for,
)

SIMPLE = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]
}
SUM = [i + 1 for i in range(16)]


# ---------------------------------------------------------------- which frontend serves a connection


def frontends(server) -> list[int]:
    """The engine's frontend processes (multiprocessing's spawned children; not its resource tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server.process.pid and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def serving_process(server, connection: http.client.HTTPConnection) -> int:
    """The frontend that holds the server's end of an open connection."""
    client_port = connection.sock.getsockname()[1]
    wanted = f"0100007F:{server.http_port:04X} 0100007F:{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if f"{fields[1]} {fields[2]}" == wanted:
            inode = fields[9]
            break
    else:
        raise AssertionError(f"no server end for client port {client_port}")
    for pid in frontends(server):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no frontend holds the connection from port {client_port}")


def post(connection: http.client.HTTPConnection, path: str, body: bytes | dict) -> tuple[int, dict]:
    connection.request("POST", path, body if isinstance(body, bytes) else json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    payload = response.read()
    return response.status, json.loads(payload) if payload else {}


def get(connection: http.client.HTTPConnection, path: str) -> tuple[int, dict]:
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def connections(server, per_frontend: int) -> dict[int, list[http.client.HTTPConnection]]:
    """`per_frontend` open connections served by each frontend (the kernel spreads new ones over them)."""
    found: dict[int, list] = {pid: [] for pid in frontends(server)}
    for _ in range(200):
        if all(len(held) >= per_frontend for held in found.values()):
            return found
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        assert get(connection, "/v2/health/live")[0] == 200  # accepted: its server end is a frontend's now
        held = found[serving_process(server, connection)]
        if len(held) < per_frontend:
            held.append(connection)
        else:
            connection.close()
    raise AssertionError(f"connections did not reach every frontend: {[len(held) for held in found.values()]}")


def statistics(connection, model: str) -> dict:
    return get(connection, f"/v2/models/{model}/stats")[1]["model_stats"][0]


# ---------------------------------------------------------------- one engine, two frontends


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    repository = tmp_path_factory.mktemp("workers")
    copy_model("simple", repository)
    # Four rows make a batch; it waits up to 10 s for them, so only rows from both frontends can fill it.
    sim_model(repository, "gather", max_batch_size=4, delay_us=10_000_000, fixed_ms=1)
    return repository


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    srv = start_server(repository, tmp_path_factory.mktemp("logs") / "server.log", workers=2)
    yield srv
    stop_server(srv)


def test_two_frontends_serve_the_ports_and_one_engine_the_models(server):
    pids = frontends(server)
    assert len(pids) == 2 and server.process.pid not in pids
    by_frontend = connections(server, per_frontend=1)
    for (held,) in by_frontend.values():
        status, answer = post(held, "/v2/models/simple/infer", SIMPLE)
        assert status == 200 and answer["outputs"][0]["data"] == SUM
    # Only the engine loaded the model: no frontend has onnxruntime in memory.
    for pid in pids:
        assert "onnxruntime" not in Path(f"/proc/{pid}/maps").read_text()
    assert "onnxruntime" in Path(f"/proc/{server.process.pid}/maps").read_text()


def test_requests_from_both_frontends_batch_together(server):
    by_frontend = connections(server, per_frontend=2)
    held = [connection for pair in by_frontend.values() for connection in pair]
    before = statistics(held[0], "gather")
    with futures.ThreadPoolExecutor(len(held)) as pool:
        answers = list(pool.map(lambda pair: post(pair[1], "/v2/models/gather/infer", sim_body(pair[0])), enumerate(held)))
    assert [status for status, _ in answers] == [200] * 4
    assert [answer["outputs"][0]["data"] for _, answer in answers] == [[float(i)] * 4 for i in range(4)]
    after = statistics(held[0], "gather")
    # One execution of four rows, two from each frontend (each waited for the others: nothing else fills the batch).
    assert after["execution_count"] - before["execution_count"] == 1
    assert after["inference_count"] - before["inference_count"] == 4
    batches = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert batches.get(4, 0) - {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}.get(4, 0) == 1


def test_statistics_and_metrics_sum_over_the_frontends(server):
    (first, *_), (second, *_) = connections(server, per_frontend=1).values()
    before = statistics(first, "simple")["inference_stats"]
    before_v1 = scrape(server).values("request_predict_seconds_count", model_name="simple")
    for connection, count in ((first, 3), (second, 2)):
        for _ in range(count):
            assert post(connection, "/v2/models/simple/infer", SIMPLE)[0] == 200
        # KServe's V1 route: its latency histogram is counted in the frontend, summed by the engine.
        status, answer = post(connection, "/v1/models/simple:predict", {"instances": [{"INPUT0": list(range(16)), "INPUT1": [1] * 16}]})
        assert status == 200 and answer["predictions"][0]["OUTPUT0"] == SUM
    for connection in (first, second):  # either frontend answers for both
        stats = statistics(connection, "simple")["inference_stats"]
        assert stats["success"]["count"] - before["success"]["count"] == 7
        assert {stats[key]["count"] for key in ("success", "compute_input", "compute_infer", "compute_output")} == {stats["success"]["count"]}
    http_port, metrics_port = scrape(server, server.http_port), scrape(server)
    for metrics in (http_port, metrics_port):
        assert metrics.values("nv_inference_request_success", model="simple") == [stats["success"]["count"]]
    after_v1 = metrics_port.values("request_predict_seconds_count", model_name="simple")
    assert after_v1[0] - (before_v1[0] if before_v1 else 0) == 2
    assert http_port.values("request_predict_seconds_count", model_name="simple") == after_v1


def test_a_shared_memory_region_registered_through_one_frontend_serves_through_another(server):
    (first, *_), (second, *_) = connections(server, per_frontend=1).values()
    key_in, key_out = f"/kserve_ascend_workers_{os.getpid()}_in", f"/kserve_ascend_workers_{os.getpid()}_out"
    inputs = np.arange(32, dtype=np.int32).reshape(2, 16)
    region_in = shm.create_shared_memory_region("in", key_in, 128, create_only=True)
    region_out = shm.create_shared_memory_region("out", key_out, 128, create_only=True)
    try:
        shm.set_shared_memory_region(region_in, [inputs])
        for name, key in (("in", key_in), ("out", key_out)):
            assert post(first, f"/v2/systemsharedmemory/region/{name}/register", {"key": key, "byte_size": 128})[0] == 200
        body = {
            "inputs": [
                {"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32",
                 "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": 64, "shared_memory_offset": 64 * i}}
                for i in range(2)
            ],
            "outputs": [
                {"name": f"OUTPUT{i}", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 64, "shared_memory_offset": 64 * i}}
                for i in range(2)
            ],
        }
        status, answer = post(second, "/v2/models/simple/infer", body)
        assert status == 200, answer
        written = shm.get_contents_as_numpy(region_out, np.int32, [2, 16]).copy()
        np.testing.assert_array_equal(written, [inputs[0] + inputs[1], inputs[0] - inputs[1]])
        assert {region["name"] for region in get(second, "/v2/systemsharedmemory/status")[1]} == {"in", "out"}

        # Registered again under the same name and key, the region is another object: every frontend maps the new one.
        assert post(second, "/v2/systemsharedmemory/region/in/unregister", b"")[0] == 200
        shm.destroy_shared_memory_region(region_in)
        region_in = shm.create_shared_memory_region("in", key_in, 128, create_only=True)
        shm.set_shared_memory_region(region_in, [inputs * 10])
        assert post(second, "/v2/systemsharedmemory/region/in/register", {"key": key_in, "byte_size": 128})[0] == 200
        assert post(first, "/v2/models/simple/infer", body)[0] == 200
        written = shm.get_contents_as_numpy(region_out, np.int32, [2, 16]).copy()
        np.testing.assert_array_equal(written, [(inputs[0] + inputs[1]) * 10, (inputs[0] - inputs[1]) * 10])

        assert post(second, "/v2/systemsharedmemory/unregister", b"")[0] == 200
        assert get(first, "/v2/systemsharedmemory/status")[1] == []
        status, answer = post(first, "/v2/models/simple/infer", body)
        assert status == 400 and "not registered" in answer["error"]
    finally:
        post(first, "/v2/systemsharedmemory/unregister", b"")
        shm.destroy_shared_memory_region(region_in)
        shm.destroy_shared_memory_region(region_out)
    # Unregistered: no process of the server maps the client's objects any more.
    def unmapped() -> bool:
        assert post(first, "/v2/models/simple/infer", SIMPLE)[0] == 200  # the last batch over them goes
        return not any(mapping(pid, key_in) or mapping(pid, key_out) for pid in [server.process.pid, *frontends(server)])

    wait_for(unmapped, "every process of the server to unmap the regions", timeout=10)


def mapping(pid: int, key: str) -> bool:
    return f"/dev/shm{key}" in Path(f"/proc/{pid}/maps").read_text()


# ---------------------------------------------------------------- stopping and restarting


def test_what_a_frontend_caches_of_a_model_goes_when_the_model_reloads(tmp_path):
    """Frontends cache model metadata and configurations until the repository changes: a reload through one
    frontend (a load with another config, an unload) shows at once through every frontend, and a model unloaded
    answers as unloaded there too."""
    repository = tmp_path / "repository"
    repository.mkdir()
    sim_model(repository, "sim", max_batch_size=4, delay_us=0, fixed_ms=0)
    server = start_server(repository, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "sim", workers=2)
    try:
        held = [connection for pair in connections(server, per_frontend=1).values() for connection in pair]
        for connection in held:  # cached by each frontend
            assert get(connection, "/v2/models/sim/config")[1]["max_batch_size"] == 4
            assert get(connection, "/v2/models/sim")[1]["versions"] == ["1"]
        for max_batch_size in (2, 3):
            config = (repository / "sim" / "config.pbtxt").read_text().replace("max_batch_size: 4", f"max_batch_size: {max_batch_size}")
            override = json_format.MessageToJson(text_format.Parse(config, mc.ModelConfig()))
            loader, *others = held if max_batch_size == 2 else held[::-1]
            status, _ = post(loader, "/v2/repository/models/sim/load", {"parameters": {"config": override}})
            assert status == 200
            for connection in held:
                assert get(connection, "/v2/models/sim/config")[1]["max_batch_size"] == max_batch_size
        assert post(held[0], "/v2/repository/models/sim/unload", {})[0] == 200
        for connection in held:
            status, answer = get(connection, "/v2/models/sim/config")
            assert status == 400 and "is not ready" in answer["error"], answer
    finally:
        stop_server(server)


def test_sigterm_answers_every_request_in_flight_then_exits(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    # Requests wait up to 5 s for a batch of 8: SIGTERM comes while all of them are held.
    sim_model(repository, "held", max_batch_size=8, delay_us=5_000_000, fixed_ms=200)
    server = start_server(repository, tmp_path / "server.log", workers=2)
    try:
        held = [connection for pair in connections(server, per_frontend=2).values() for connection in pair]
        grpc_client = grpcclient.InferenceServerClient(server.grpc)
        tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.full((1, 4), 9, np.float32))
        with futures.ThreadPoolExecutor(6) as pool:
            rest = [pool.submit(post, connection, "/v2/models/held/infer", sim_body(i)) for i, connection in enumerate(held)]
            grpc = [pool.submit(grpc_client.infer, "held", [tensor]) for _ in range(2)]
            wait_for(lambda: pending(server, "held") == 6, "every request to reach the engine", timeout=10)
            server.process.send_signal(signal.SIGTERM)
            answers = [future.result(timeout=30) for future in rest]
            grpc_answers = [future.result(timeout=30).as_numpy("OUTPUT0") for future in grpc]
        assert server.process.wait(timeout=30) == 0
    finally:
        stop_server(server)
    assert [status for status, _ in answers] == [200] * 4
    assert [answer["outputs"][0]["data"] for _, answer in answers] == [[float(i)] * 4 for i in range(4)]
    assert all((output == 9).all() for output in grpc_answers)
    assert "engine stopped" in server.output()


def test_a_killed_frontend_is_replaced_while_the_other_serves_on(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    server = start_server(repository, tmp_path / "server.log", workers=2)
    try:
        (victim, (lost, *_)), (survivor, (kept, *_)) = connections(server, per_frontend=1).items()
        os.kill(victim, signal.SIGKILL)
        assert post(kept, "/v2/models/simple/infer", SIMPLE)[0] == 200  # the other frontend serves on
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            post(lost, "/v2/models/simple/infer", SIMPLE)  # the killed one's clients lose their connection
        wait_for(lambda: len(re.findall(r"frontend \d \(pid \d+\) serving", server.output())) >= 3, "a frontend to replace the killed one", timeout=60)
        replacement = set(frontends(server)) - {survivor}
        assert len(replacement) == 1 and victim not in replacement
        # New connections reach both frontends again, and every one is served.
        by_frontend = connections(server, per_frontend=2)
        assert set(by_frontend) == replacement | {survivor}
        for held in by_frontend.values():
            for connection in held:
                status, answer = post(connection, "/v2/models/simple/infer", SIMPLE)
                assert status == 200 and answer["outputs"][0]["data"] == SUM
    finally:
        stop_server(server)
    assert "exited with code -9" in server.output()


def test_frontends_end_when_their_engine_is_killed(tmp_path):
    """A crashed engine (OOM-killed, SIGKILL) leaves no frontend serving, nor any codec process, behind."""
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("yolov8n", repository)
    server = start_server(repository, tmp_path / "server.log", workers=2)
    big = {"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 3, 640, 640], "data": [0.5] * (3 * 640 * 640)}]}
    body = orjson.dumps(big)
    for _ in range(4):  # with both frontends' codec processes started (by the first large body each gets)
        assert post_infer(server, "yolov8n", body, timeout=60).status_code == 200
    started = descendants(server.process.pid)
    assert len(started) >= 2
    server.process.kill()
    server.process.wait()
    try:
        wait_for(lambda: not any(alive(pid) for pid in started), "every process to end with its engine", timeout=15)
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_frontend_that_cannot_start_stops_the_server(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kserve_ascend", "--model_dir", str(REPOSITORY), "--workers", "2",
         "--http_port", str(free_port()), "--grpc_port", str(free_port()), "--metrics_port", "0",
         "--ssl_certfile", str(tmp_path / "missing.pem"), "--ssl_keyfile", str(tmp_path / "missing.key")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 1
    assert "could not start: stopping the server" in result.stderr


def test_a_port_in_use_is_refused_before_any_frontend_starts():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kserve_ascend", "--model_dir", str(REPOSITORY), "--workers", "2",
             "--http_port", str(free_port()), "--grpc_port", str(port), "--metrics_port", "0"],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )
    assert result.returncode != 0
    assert f"the gRPC port {port} is in use" in result.stderr
    assert "frontend 0 started" not in result.stderr


# ---------------------------------------------------------------- what crosses between the processes


class Linked:
    """The engine's end of a frontend's channel (over a data plane of `repository`) and the frontend's data plane, in
    one process and on one loop, as `--workers N` connects them; each message each way recorded with its size."""

    def __init__(self, repository):
        from prometheus_client import CollectorRegistry

        from kserve_ascend.server.dataplane.local import LocalDataPlane
        from kserve_ascend.server.workers import messages
        from kserve_ascend.server.workers.control import ControlPage
        from kserve_ascend.server.workers.link import FrontendLink
        from kserve_ascend.server.workers.remote import RemoteDataPlane

        self.dataplane = LocalDataPlane(repository, False, CollectorRegistry())
        engine_end, frontend_end = socket.socketpair()
        self.link = FrontendLink(self.dataplane, engine_end, lambda: None)
        self.frontend = RemoteDataPlane(frontend_end, lambda now: None)
        self.sent: dict[str, list] = {"to engine": [], "to frontend": []}
        for channel, direction in ((self.link.channel, "to engine"), (self.frontend.channel, "to frontend")):
            handle = channel.on_message
            channel.on_message = lambda message, handle=handle, direction=direction: (
                self.sent[direction].append((message, len(messages.encoder.encode(message)))), handle(message)
            )
        page = ControlPage.create()
        self.link.start([(messages.Control(page.SIZE), page.share())])
        self.frontend.start()

    def close(self) -> None:
        self.link.close()
        self.frontend.close()


def test_tensors_cross_in_shared_memory_and_messages_stay_small(tmp_path):
    """The messages of a 4 MiB request and answer are the size of a 16 B one's, and the answer carries the request's
    bytes (the sim model echoes)."""
    from kserve_ascend.core.models.repository import Repository
    from kserve_ascend.server.dataplane import InferRequest

    sim_model(tmp_path, "small", max_batch_size=1, delay_us=0, fixed_ms=0, dims=4)
    sim_model(tmp_path, "large", max_batch_size=1, delay_us=0, fixed_ms=0, dims=2**20)

    async def scenario() -> dict[str, list[int]]:
        repository = Repository(tmp_path)
        for name in ("small", "large"):
            await repository.load(name)
        linked = Linked(repository)
        answers = {}
        for name, size in (("small", 4), ("large", 2**20)):
            data = np.random.default_rng(size).random((1, size), dtype=np.float32)
            before = {direction: len(seen) for direction, seen in linked.sent.items()}
            result = await linked.frontend.infer(InferRequest(name, {"INPUT0": data}))
            with result.answering():
                np.testing.assert_array_equal(result.outputs["OUTPUT0"], data)
            del result

            def kinds(direction: str) -> set[str]:
                return {type(message).__name__ for message, _ in linked.sent[direction][before[direction]:]}

            # What follows the answer: the frontend reports it done and frees the engine's outputs, the engine frees its inputs.
            await until(lambda: {"Done", "Free"} <= kinds("to engine") and "Free" in kinds("to frontend"), "the frees and the done report")
            answers[name] = [max(size for _, size in seen[before[direction]:]) for direction, seen in linked.sent.items()]
        statistics = (await linked.dataplane.statistics("large"))["model_stats"][0]["inference_stats"]
        linked.close()
        repository.models["small"].close()
        repository.models["large"].close()
        return answers, statistics

    answers, statistics = asyncio.run(scenario())
    small, large = answers["small"], answers["large"]
    # 4 MiB each way, yet no message reaches 256 bytes: it differs from the 16 B request's by the digits of its
    # shape, size and place in the arena.
    assert max(large) < 256, answers
    assert all(0 <= b - a < 32 for a, b in zip(small, large)), answers
    # The frontend's encoding came back to the engine: the request is counted, compute_output included.
    assert statistics["success"]["count"] == 1 and statistics["compute_output"]["count"] == 1


def test_the_frontend_forwards_every_method_of_the_data_plane():
    """The data-plane interface is written once: the frontend's data plane has every method of it, with its
    signature, and the engine's end serves exactly those (a method added to `DataPlane` is one edit)."""
    import inspect

    from kserve_ascend.server.dataplane import DataPlane
    from kserve_ascend.server.dataplane.local import LocalDataPlane
    from kserve_ascend.server.workers.remote import FORWARDED, RemoteDataPlane

    methods = {name for name, _ in inspect.getmembers(DataPlane, inspect.isfunction) if not name.startswith("_")}
    assert methods == FORWARDED | {"infer", "model_names"}
    def parameters(method) -> list:
        return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]

    for implementation in (RemoteDataPlane, LocalDataPlane):
        for name in methods:
            assert parameters(getattr(implementation, name)) == parameters(getattr(DataPlane, name)), (implementation, name)


def test_an_engine_and_a_frontend_of_different_versions_refuse_each_other(tmp_path, caplog):
    """A frontend restarted from a package upgraded in place speaks another version of the messages: the engine's
    end refuses it, saying so, and the frontend finds the engine gone (its requests answer 503)."""
    from kserve_ascend.core.models.repository import Repository
    from kserve_ascend.server.dataplane import InferRequest
    from kserve_ascend.server.workers import messages

    sim_model(tmp_path, "small", max_batch_size=1, delay_us=0, fixed_ms=0, dims=4)

    async def scenario():
        linked = Linked(Repository(tmp_path))
        linked.frontend.channel.send(messages.Hello(messages.VERSION + 1))
        await until(lambda: linked.link.channel.closed, "the engine's end to refuse the frontend")
        try:
            await linked.frontend.infer(InferRequest("small", {"INPUT0": np.zeros((1, 4), np.float32)}))
        finally:
            linked.close()

    with pytest.raises(Exception) as raised:
        asyncio.run(scenario())
    assert type(raised.value).__name__ == "ChannelClosed" and "engine process is gone" in str(raised.value)
    assert f"the frontend speaks version {messages.VERSION + 1} of the messages, this process {messages.VERSION}" in caplog.text

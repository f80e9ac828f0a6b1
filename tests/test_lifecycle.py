"""Model lifecycle: poll and explicit control, hot reload under load, A/B weights, file integrity."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
import requests
import tritonclient.grpc as grpcclient
from prometheus_client import CollectorRegistry
from tritonclient.utils import InferenceServerException

from conftest import REPOSITORY, copy_model, post_infer, start_server, stop_server, wait_for
from kserve_ascend.core.models.repository import Repository
from kserve_ascend.server.dataplane.local import LocalDataPlane
from kserve_ascend.server.lifecycle import Lifecycle

SIMPLE_BODY = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
        ]
    }
).encode()
EXPECTED_SUM = [i + 1 for i in range(16)]
SIMPLE_ONNX = REPOSITORY / "simple" / "1" / "model.onnx"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def index(url: str) -> dict[tuple[str, str], dict]:
    return {(e["name"], e.get("version", "")): e for e in requests.post(f"{url}/v2/repository/index").json()}


class Load:
    """`concurrency` clients in a closed loop on one model: every answer's status, body and serving version."""

    def __init__(self, server, concurrency: int, model: str = "simple"):
        self.server, self.model = server, model
        self.results: list[tuple[float, str]] = []  # (when the request was sent, the version that answered)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(concurrency)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _client(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    response = post_infer(self.server, self.model, SIMPLE_BODY, session=session)
                    body = response.json()
                except Exception as error:  # a dropped connection is a lost request too
                    with self._lock:
                        self.failures.append(repr(error))
                    continue
                with self._lock:
                    if response.status_code != 200 or body["outputs"][0]["data"] != EXPECTED_SUM:
                        self.failures.append(f"{response.status_code} {body}")
                    self.results.append((sent, body.get("model_version", "")))

    def versions_sent(self, after: float, before: float = float("inf")) -> Counter:
        with self._lock:
            return Counter(version for sent, version in self.results if after < sent < before)

    def __len__(self) -> int:
        with self._lock:
            return len(self.results)


def copy_slowly(source: Path, target: Path) -> None:
    """Copies a file in two halves with a pause, as a slow `cp` or `scp` would: the half must never serve."""
    data = source.read_bytes()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        out.write(data[: len(data) // 2])
        out.flush()
        time.sleep(0.5)
        out.write(data[len(data) // 2 :])


# ---------------------------------------------------------------- poll


#: The one-process server, and an engine with two frontends (`--workers 2`): each polls, loads and answers alike.
WORKERS = pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])


@pytest.fixture
def workers(request) -> int:
    return getattr(request, "param", 1)


@pytest.fixture
def poll_server(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    server = start_server(repository, tmp_path / "server.log", "--model_control_mode", "poll", workers=workers)
    yield server, repository
    stop_server(server)


@WORKERS
def test_poll_moves_to_a_new_version_and_back_under_load_with_no_failed_request(poll_server):
    """The source design's seamless upgrade: drop in version 2, then take it away, at concurrency 32."""
    server, repository = poll_server
    model = repository / "simple"
    with Load(server, concurrency=32) as load:
        wait_for(lambda: len(load) > 50, what="load to start")
        copy_slowly(model / "1" / "model.onnx", model / "2" / "model.onnx")
        wait_for(lambda: set(index(server.url)) == {("simple", "2")}, what="version 2 to replace version 1")
        # Requests in flight on version 1 at the switch finish there; every later one goes to 2.
        switched = time.monotonic()
        wait_for(lambda: sum(load.versions_sent(switched).values()) > 50, what="requests after the switch")

        removed = time.monotonic()
        shutil.rmtree(model / "2")
        wait_for(lambda: set(index(server.url)) == {("simple", "1")}, what="version 1 to serve again")
        back = time.monotonic()
        wait_for(lambda: sum(load.versions_sent(back).values()) > 50, what="requests after the removal")
    assert load.failures == []
    assert set(load.versions_sent(switched, removed)) == {"2"}, load.versions_sent(switched, removed)
    assert set(load.versions_sent(back)) == {"1"}, load.versions_sent(back)
    assert len(load) > 300


def test_poll_reloads_a_changed_config_and_keeps_serving_when_the_new_one_is_broken(poll_server):
    server, repository = poll_server
    config = repository / "simple" / "config.pbtxt"
    original = config.read_text()
    config.write_text(original.replace("max_batch_size: 8", "max_batch_size: 2"))
    wait_for(
        lambda: requests.get(f"{server.url}/v2/models/simple/config").json()["max_batch_size"] == 2,
        what="the changed config to load",
    )
    config.write_text("name: this is not a ModelConfig")
    wait_for(lambda: "reload failed" in index(server.url)[("simple", "1")]["reason"], what="the failed reload")
    entry = index(server.url)[("simple", "1")]
    assert entry["state"] == "READY", entry
    assert post_infer(server, "simple", SIMPLE_BODY).status_code == 200  # what served before serves on
    config.write_text(original)
    wait_for(lambda: index(server.url)[("simple", "1")]["reason"] == "", what="the repaired config")
    assert requests.get(f"{server.url}/v2/models/simple/config").json()["max_batch_size"] == 8


@WORKERS
def test_poll_picks_up_new_models_and_drops_removed_ones(poll_server):
    server, repository = poll_server
    copy_model("simple", repository, "simple_copy")
    wait_for(lambda: ("simple_copy", "1") in index(server.url), what="the new model")
    assert post_infer(server, "simple_copy", SIMPLE_BODY).status_code == 200
    assert requests.get(f"{server.url}/v2/health/ready").status_code == 200
    shutil.rmtree(repository / "simple_copy")
    wait_for(lambda: not any(name == "simple_copy" for name, _ in index(server.url)), what="the model to go")
    response = post_infer(server, "simple_copy", SIMPLE_BODY)
    assert response.status_code == 404, response.text
    assert post_infer(server, "simple", SIMPLE_BODY).status_code == 200


def test_poll_sees_a_model_copied_in_before_the_edges_are_all_listening(tmp_path):
    """The watch starts before the ready line: with `--workers N` one frontend may answer ready (and a client
    copy a model in) while another still starts. Such a model was once never loaded."""
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)

    async def scenario() -> set[str]:
        dataplane = LocalDataPlane(Repository(repository), False, CollectorRegistry())
        lifecycle = Lifecycle(dataplane, "poll", [], shutdown_timeout_s=5)
        listening = asyncio.Event()
        running = asyncio.create_task(lifecycle.run(listening.wait()))
        while not dataplane.loaded:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(copy_model, "simple", repository, "simple_copy")
        listening.set()
        try:
            while "simple_copy" not in dataplane.repository.models or not dataplane.repository.models["simple_copy"].ready:
                await asyncio.sleep(0.05)
            return set(dataplane.repository.models)
        finally:
            running.cancel()  # as the server does once it stopped
            await asyncio.gather(running, return_exceptions=True)
            lifecycle.close()

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == {"simple", "simple_copy"}


@WORKERS
def test_a_polling_server_stops_on_sigterm(poll_server):
    server, _ = poll_server
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=15) == 0  # the watch ends with the servers, nothing holds the exit


def test_load_and_unload_are_refused_unless_control_is_explicit(poll_server):
    server, _ = poll_server
    response = requests.post(f"{server.url}/v2/repository/models/simple/unload")
    assert response.status_code == 400
    assert "--model_control_mode explicit" in response.json()["error"]
    assert post_infer(server, "simple", SIMPLE_BODY).status_code == 200


# ---------------------------------------------------------------- explicit


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def explicit_server(tmp_path_factory, request):
    """With 2 workers, successive calls of a test land on either frontend: each sees what another loaded."""
    repository = tmp_path_factory.mktemp("explicit")
    copy_model("simple", repository)
    copy_model("simple", repository, "second")
    shutil.copytree(repository / "simple" / "1", repository / "simple" / "2")
    server = start_server(
        repository, repository / "server.log", "--model_control_mode", "explicit", "--load_model", "simple", workers=request.param
    )
    yield server, repository
    stop_server(server)


def test_explicit_loads_only_the_startup_models(explicit_server):
    server, _ = explicit_server
    entries = index(server.url)
    assert entries[("simple", "2")]["state"] == "READY"
    assert entries[("second", "")]["state"] == "UNAVAILABLE"
    # Triton's strict readiness counts the models asked for, not every directory.
    assert requests.get(f"{server.url}/v2/health/ready").status_code == 200


def test_explicit_load_and_unload_over_rest_and_grpc(explicit_server):
    server, _ = explicit_server
    assert requests.post(f"{server.url}/v2/repository/models/second/load").status_code == 200
    assert post_infer(server, "second", SIMPLE_BODY).status_code == 200
    assert requests.post(f"{server.url}/v2/repository/models/second/unload").status_code == 200
    response = post_infer(server, "second", SIMPLE_BODY)
    assert response.status_code == 400 and "not ready" in response.json()["error"]

    client = grpcclient.InferenceServerClient(server.grpc)
    client.load_model("second")
    assert client.is_model_ready("second")
    client.unload_model("second")
    assert not client.is_model_ready("second")
    with pytest.raises(InferenceServerException) as error:
        client.load_model("no_such_model")
    assert error.value.status() == "StatusCode.NOT_FOUND"


def test_explicit_load_with_a_config_override(explicit_server):
    server, _ = explicit_server
    override = json.dumps({"name": "second", "max_batch_size": 8, "backend": "ascend", "version_policy": {"all": {}}})
    response = requests.post(f"{server.url}/v2/repository/models/second/load", json={"parameters": {"config": override}})
    assert response.status_code == 200, response.text
    assert requests.get(f"{server.url}/v2/models/second").json()["versions"] == ["1"]  # second has one version
    client = grpcclient.InferenceServerClient(server.grpc)
    client.load_model("simple", config=json.dumps({"name": "simple", "backend": "ascend", "max_batch_size": 8, "version_policy": {"all": {}}}))
    assert client.get_model_metadata("simple").versions == ["1", "2"]
    client.load_model("simple")  # back to config.pbtxt: the latest version only
    assert client.get_model_metadata("simple").versions == ["2"]


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "JSON"),
        (json.dumps({"parameters": {"config": 5}}), "must be a string"),
        (json.dumps({"parameters": {"config": "{\"max_batch_size\": \"many\"}"}}), "not a ModelConfig"),
        (json.dumps({"parameters": {"config": "{\"name\": \"other\"}"}}), "names the model 'other'"),
        (json.dumps({"parameters": {"file:1/model.onnx": "AAAA"}}), "file overrides"),
        (json.dumps({"parameters": "config"}), "'parameters' must be an object"),
    ],
)
def test_bad_load_requests_are_client_errors(explicit_server, body, message):
    server, _ = explicit_server
    response = requests.post(f"{server.url}/v2/repository/models/simple/load", data=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]
    assert post_infer(server, "simple", SIMPLE_BODY).status_code == 200


def test_grpc_bad_load_requests_are_invalid_argument(explicit_server):
    server, _ = explicit_server
    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as error:
        client.load_model("simple", config="{\"max_batch_size\": \"many\"}")
    assert error.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(InferenceServerException) as error:
        client.load_model("simple", files={"file:1/model.onnx": b"\0"})
    assert error.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert client.is_model_ready("simple")


# ---------------------------------------------------------------- A/B and integrity


def write_two_version_model(repository: Path, name: str, extra: str) -> Path:
    model = copy_model("simple", repository, name)
    shutil.copytree(model / "1", model / "2")
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy: { all: {} }\n" + extra)
    return model


@WORKERS
def test_version_weights_split_traffic_and_every_response_names_its_version(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    write_two_version_model(repository, "ab", 'parameters { key: "version_weights" value: { string_value: "1:80,2:20" } }\n')
    server = start_server(repository, tmp_path / "server.log", workers=workers)
    try:
        with requests.Session() as session:
            versions = Counter(post_infer(server, "ab", SIMPLE_BODY, session=session).json()["model_version"] for _ in range(1000))
            # A named version is served by that version, whatever the weights.
            named = post_infer(server, "ab", SIMPLE_BODY, version="2", session=session).json()
    finally:
        stop_server(server)
    assert set(versions) == {"1", "2"}
    # 1000 draws at p = 0.2: the standard deviation is 12.6, so ±6 sd is ±76.
    assert abs(versions["2"] - 200) < 76, versions
    assert named["model_version"] == "2"


def test_bad_version_weights_fail_the_model_with_a_reason(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    write_two_version_model(repository, "ab", 'parameters { key: "version_weights" value: { string_value: "1:lots" } }\n')
    copy_model("simple", repository)
    server = start_server(repository, tmp_path / "server.log", wait="loaded")
    try:
        assert "version_weights" in index(server.url)[("ab", "")]["reason"]
        assert post_infer(server, "simple", SIMPLE_BODY).status_code == 200
    finally:
        stop_server(server)


def test_sha256_is_shown_and_a_mismatch_is_refused_while_the_old_version_serves(tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    model = copy_model("simple", repository)
    digest = sha256(SIMPLE_ONNX)
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + f'parameters {{ key: "sha256" value: {{ string_value: "{digest}" }} }}\n')
    server = start_server(repository, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "*")
    try:
        assert index(server.url)[("simple", "1")]["sha256"] == digest
        assert requests.get(f"{server.url}/v2/models/simple").json()["parameters"]["sha256"] == digest

        # Version 2 arrives with other bytes (a valid model: an unknown protobuf field appended)
        # than the config expects of every version.
        (model / "2").mkdir()
        (model / "2" / "model.onnx").write_bytes(SIMPLE_ONNX.read_bytes() + b"\x98\x06\x01")
        response = requests.post(f"{server.url}/v2/repository/models/simple/load")
        assert response.status_code == 400
        assert f"but the config expects {digest}" in response.json()["error"]
        entry = index(server.url)[("simple", "1")]
        assert entry["state"] == "READY" and "sha256" in entry["reason"], entry
        assert post_infer(server, "simple", SIMPLE_BODY).json()["model_version"] == "1"

        # Per-version digests: version 2's own digest lets it in.
        config.write_text(
            config.read_text().replace(digest, f"1:{digest},2:{sha256(model / '2' / 'model.onnx')}")
        )
        assert requests.post(f"{server.url}/v2/repository/models/simple/load").status_code == 200
        assert post_infer(server, "simple", SIMPLE_BODY).json()["model_version"] == "2"
    finally:
        stop_server(server)

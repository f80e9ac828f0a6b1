"""model_repository(unload_dependents): unloading a model with the models loaded along with it.

conformance/models/ensemble_chain runs chain_first then chain_second. The server loads every model
at start-up, so each case first makes the steps ones that the ensemble's load brought in (as a
client loading only the ensemble does), and leaves every model loaded again.
"""

import json
import subprocess

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from conformance.harness import wait_for

ENSEMBLE, STEPS = "ensemble_chain", ("chain_first", "chain_second")


def _state(url: str, name: str) -> str:
    index = requests.post(f"{url}/v2/repository/index", json={}).json()
    return next(e.get("state", "") for e in index if e["name"] == name)


def _loaded_along(http) -> None:
    """The steps unloaded (which takes the ensemble with them), then the ensemble loaded: it loads them."""
    for step in STEPS:
        http.unload_model(step)
    http.load_model(ENSEMBLE)
    assert all(http.is_model_ready(m) for m in (ENSEMBLE, *STEPS))


def _serves(http) -> None:
    data = np.arange(4, dtype=np.int32).reshape(1, 4)
    tensor = httpclient.InferInput("IN", [1, 4], "INT32")
    tensor.set_data_from_numpy(data)
    np.testing.assert_array_equal(http.infer(ENSEMBLE, [tensor]).as_numpy("OUT"), data)


@pytest.fixture
def restored(http):
    """Every model of the chain loaded again after the case, whatever it did."""
    yield
    for name in (*STEPS, ENSEMBLE):
        http.load_model(name)


@pytest.mark.spec("Triton extension_model_repository.md §Unload: 'unload_dependents'")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unload_dependents_unloads_the_models_loaded_along(url, target, http, protocol, requires, restored):
    requires("model_repository(unload_dependents)")
    _loaded_along(http)
    _serves(http)
    if protocol == "http":
        http.unload_model(ENSEMBLE, unload_dependents=True)  # {"parameters": {"unload_dependents": true}}
    else:
        with grpcclient.InferenceServerClient(target.grpc) as client:
            client.unload_model(ENSEMBLE, unload_dependents=True)
    assert not http.is_model_ready(ENSEMBLE)
    # Triton answers while the steps still unload (state UNLOADING); then they are unavailable.
    for step in STEPS:
        wait_for(lambda: _state(url, step) == "UNAVAILABLE", f"{step} unloaded with {ENSEMBLE}", timeout=20)


@pytest.mark.spec("Triton extension_model_repository.md §Unload: without 'unload_dependents' only the model goes")
def test_unload_without_dependents_leaves_the_steps(url, http, requires, restored):
    requires("model_repository(unload_dependents)")
    _loaded_along(http)
    http.unload_model(ENSEMBLE, unload_dependents=False)  # {"parameters": {"unload_dependents": false}}
    assert not http.is_model_ready(ENSEMBLE)
    assert all(http.is_model_ready(step) for step in STEPS)


@pytest.mark.spec("Triton extension_model_repository.md §Unload: a step model loaded by name stays")
def test_unload_dependents_keeps_steps_loaded_by_name(url, http, requires, restored):
    requires("model_repository(unload_dependents)")
    for step in STEPS:  # takes the ensemble with them
        http.unload_model(step)
    for name in (*STEPS, ENSEMBLE):
        http.load_model(name)
    http.unload_model(ENSEMBLE, unload_dependents=True)
    assert not http.is_model_ready(ENSEMBLE)
    assert all(http.is_model_ready(step) for step in STEPS)


@pytest.mark.spec("Triton grpc_server.cc RepositoryModelUnload: 'unload_dependents' must be a bool_param")
def test_unload_dependents_of_another_type_is_invalid_argument(target, http, requires, restored):
    requires("model_repository(unload_dependents)")
    parameter = pb.ModelRepositoryParameter(string_param="yes")  # tritonclient sends only bool_param
    with grpc.insecure_channel(target.grpc) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name=ENSEMBLE, parameters={"unload_dependents": parameter})
            )
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "invalid value type for 'unload_dependents' parameter, expected bool_param."
    assert http.is_model_ready(ENSEMBLE)  # refused: nothing was unloaded


@pytest.mark.spec("Triton http_server.cc HandleRepositoryControl: \"Unable to parse 'unload_dependents'\"")
def test_unload_dependents_of_another_type_is_4xx(url, http, requires, restored):
    requires("model_repository(unload_dependents)")
    # curl, not requests: after a request of `requests` to this endpoint, Triton 2.51 counts an HTTP
    # connection open at shutdown and waits 30 s for it (seen with any unload body; not with curl).
    answer = subprocess.run(
        ["curl", "-s", "-w", "\\n%{http_code}", "-X", "POST", "-d", '{"parameters": {"unload_dependents": "yes"}}',
         f"{url}/v2/repository/models/{ENSEMBLE}/unload"], capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    text, status = answer.rsplit("\n", 1)
    assert 400 <= int(status) < 500, f"{status}: {text}"
    assert "Unable to parse 'unload_dependents'" in json.loads(text)["error"]
    assert http.is_model_ready(ENSEMBLE)

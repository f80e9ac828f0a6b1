"""The Triton protocol extensions a server declares in its metadata; each case is skipped when not declared."""

import os

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient

from conformance.harness import wait_for
from conftest import assert_serves, simple_body


@pytest.mark.spec("Triton extension_model_repository.md §Index")
def test_repository_index(url, grpc, requires):
    requires("model_repository")
    index = requests.post(f"{url}/v2/repository/index", json={}).json()
    entry = next(e for e in index if e["name"] == "simple")
    assert entry["state"] == "READY" and entry.get("version") == "1"
    assert "simple" in {m.name for m in grpc.get_model_repository_index().models}


@pytest.mark.spec("Triton extension_model_repository.md §Load, §Unload")
def test_repository_unload_then_load(http, requires):
    requires("model_repository")
    http.unload_model("identity_int8")
    assert not http.is_model_ready("identity_int8")
    http.load_model("identity_int8")
    assert http.is_model_ready("identity_int8")


#: Load requests that fail: a model the repository does not hold, a config override that is no ModelConfig.
BAD_LOADS = {
    "unknown_model": ("no_such_model", None),
    "bad_config_override": ("identity_int16", '{"max_batch_size": "many"}'),
}


@pytest.mark.spec("Triton client examples (simple_http_model_control.py, simple_grpc_model_control.py): 'failed to load'")
@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_repository_load_failure_says_failed_to_load(target, http, case, requires):
    requires("model_repository")
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    name, config = BAD_LOADS[case]
    with grpcclient.InferenceServerClient(target.grpc) as grpc_client:
        for client in (http, grpc_client):
            with pytest.raises(InferenceServerException) as raised:
                client.load_model(name, config=config)
            assert "failed to load" in raised.value.message()
    if name != "no_such_model":
        assert http.is_model_ready(name)  # a failed reload leaves the model serving what it served


@pytest.mark.spec("Triton extension_model_repository.md §Load: a failed load is an HTTP error status (typically 400)")
@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_repository_load_failure_is_4xx(url, case, requires):
    requires("model_repository")
    name, config = BAD_LOADS[case]
    body = {"parameters": {"config": config}} if config else {}
    response = requests.post(f"{url}/v2/repository/models/{name}/load", json=body)
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text}"
    assert "failed to load" in response.json()["error"]


@pytest.mark.spec("Triton extension_statistics.md")
def test_statistics_count_inferences(url, http, grpc, requires):
    requires("statistics")

    def statistics() -> dict:
        return http.get_inference_statistics("simple", "1")["model_stats"][0]

    before = statistics()
    assert_serves(url)  # one inference, answered correctly

    def counted() -> dict | None:  # Triton records a request once its response is out: a moment after the answer
        now = statistics()
        return now if now["inference_stats"]["success"]["count"] > before["inference_stats"]["success"]["count"] else None

    after = wait_for(counted, "the inference counted", timeout=10)
    assert (after["name"], after["version"]) == ("simple", "1")
    assert after["inference_count"] == before["inference_count"] + 1
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert set(after["inference_stats"][key]) == {"count", "ns"}
    assert grpc.get_inference_statistics("simple").model_stats[0].name == "simple"


@pytest.mark.spec("Triton extension_model_configuration.md")
def test_model_configuration(http, grpc, requires):
    requires("model_configuration")
    config = http.get_model_config("simple")
    assert config["name"] == "simple" and config["max_batch_size"] == 8
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert config["input"][0]["dims"] == [16]
    # Written as Triton writes it: defaults included, enums by name.
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["input"][0]["data_type"] == "TYPE_INT32" and config["input"][0]["format"] == "FORMAT_NONE"
    assert config["input"][0]["optional"] is False and config["output"][0]["label_filename"] == ""
    assert config["model_warmup"] == [] and config["batch_input"] == []
    assert grpc.get_model_config("simple").config.max_batch_size == 8


@pytest.mark.spec("Triton extension_parameters.md (request parameters are accepted)")
def test_request_parameters_are_accepted(url, requires):
    requires("parameters")
    response = requests.post(f"{url}/v2/models/simple/infer", json=simple_body(parameters={"custom": "value", "n": 3}))
    assert response.status_code == 200, response.text


@pytest.mark.spec("Triton extension_shared_memory.md §System Shared Memory")
def test_system_shared_memory_inference(target, requires):
    requires("system_shared_memory")
    import tritonclient.utils.shared_memory as shm

    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    name = f"conformance_{target.name}_{os.getpid()}"  # two runs at once (against two servers) use two regions
    handle = shm.create_shared_memory_region(name, f"/{name}", 3 * 64)
    try:
        shm.set_shared_memory_region(handle, [data, data])
        with httpclient.InferenceServerClient(target.http) as client:
            client.unregister_system_shared_memory(name)
            client.register_system_shared_memory(name, f"/{name}", 3 * 64)
            assert name in {r["name"] for r in client.get_system_shared_memory_status()}
            inputs = []
            for index, tensor_name in enumerate(("INPUT0", "INPUT1")):
                tensor = httpclient.InferInput(tensor_name, [1, 16], "INT32")
                tensor.set_shared_memory(name, 64, offset=64 * index)
                inputs.append(tensor)
            output = httpclient.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory(name, 64, offset=128)
            client.infer("simple", inputs, outputs=[output])
            result = shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128)
            np.testing.assert_array_equal(result, data * 2)
            client.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)

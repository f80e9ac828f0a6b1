"""Repositories other than model_repository/: broken models beside good ones, version policies, placement."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import copy_model, start_server, stop_server

SIMPLE_BODY = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]
}

BROKEN = {
    "bad_config": lambda d: (d / "config.pbtxt").write_text('name: "bad_config"\nmax_batch_size: "eight"\n'),
    "missing_file": lambda d: (d / "1" / "model.onnx").unlink(),
    "corrupt_file": lambda d: (d / "1" / "model.onnx").write_bytes(b"this is not an onnx graph"),
    "wrong_tensor": lambda d: (d / "config.pbtxt").write_text(
        (d / "config.pbtxt").read_text().replace('name: "OUTPUT1"', 'name: "OUTPUT9"')
    ),
    "no_versions": lambda d: shutil.rmtree(d / "1"),
    "om_without_acl": lambda d: (d / "1" / "model.onnx").rename(d / "1" / "model.om"),
    "decoupled_sequence": lambda d: (d / "config.pbtxt").write_text(
        (d / "config.pbtxt").read_text() + "model_transaction_policy { decoupled: true }\nsequence_batching { }\n"
    ),
}
REASONS = {
    "bad_config": "not a valid ModelConfig",
    "missing_file": "has no model file",
    "corrupt_file": "onnxruntime cannot load model.onnx",
    "wrong_tensor": "config.pbtxt declares 'OUTPUT9'",
    "no_versions": "no version directory",
    "om_without_acl": "pyACL",
    "decoupled_sequence": "model_transaction_policy.decoupled is not supported with sequence_batching",
}


@pytest.fixture(scope="module")
def broken_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("broken_repo")
    copy_model("simple", repository)
    for name, breakage in BROKEN.items():
        breakage(copy_model("simple", repository, name))
    server = start_server(repository, repository.parent / "broken.log", wait="loaded")
    yield server
    stop_server(server)


def test_broken_models_fail_with_reason_while_others_serve(broken_server):
    url = broken_server.url
    index = {entry["name"]: entry for entry in requests.post(f"{url}/v2/repository/index").json()}
    assert index["simple"]["state"] == "READY"
    for name, reason in REASONS.items():
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert reason in index[name]["reason"], index[name]
        ready = requests.get(f"{url}/v2/models/{name}/ready")
        assert ready.status_code == 400 and reason in ready.json()["error"]
        infer = requests.post(f"{url}/v2/models/{name}/infer", json=SIMPLE_BODY)
        assert infer.status_code == 400 and "is not ready" in infer.json()["error"]
    # Triton's strict readiness: the server is live but not ready while any model is unavailable.
    assert requests.get(f"{url}/v2/health/live").status_code == 200
    assert requests.get(f"{url}/v2/health/ready").status_code == 400
    response = requests.post(f"{url}/v2/models/simple/infer", json=SIMPLE_BODY)
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == list(range(1, 17))
    with grpcclient.InferenceServerClient(broken_server.grpc) as client:
        assert not client.is_server_ready()
        assert client.is_model_ready("simple") and not client.is_model_ready("corrupt_file")
        states = {m.name: m.state for m in client.get_model_repository_index().models}
        assert states["corrupt_file"] == "UNAVAILABLE" and states["simple"] == "READY"


@pytest.fixture(scope="module")
def versioned_server(tmp_path_factory):
    """`simple` in versions 1..3 under three policies; version v of `offset` adds v to OUTPUT0."""
    repository = tmp_path_factory.mktemp("versions_repo")
    for name, policy in {
        "latest_two": "version_policy: { latest: { num_versions: 2 } }",
        "all_versions": "version_policy: { all: {} }",
        "specific": "version_policy: { specific: { versions: [1, 3] } }",
        "default_policy": "",
    }.items():
        model = copy_model("simple", repository, name)
        config = model / "config.pbtxt"
        config.write_text(config.read_text() + policy + "\n")
        for version in (2, 3):
            (model / str(version)).mkdir()
            (model / str(version) / "model.onnx").write_bytes((model / "1" / "model.onnx").read_bytes())
    server = start_server(repository, repository.parent / "versions.log")
    yield server
    stop_server(server)


@pytest.mark.parametrize(
    "model, served", [("latest_two", ["2", "3"]), ("all_versions", ["1", "2", "3"]), ("specific", ["1", "3"]), ("default_policy", ["3"])]
)
def test_version_policies(versioned_server, model, served):
    with httpclient.InferenceServerClient(versioned_server.http) as client:
        assert client.get_model_metadata(model)["versions"] == served
        for version in ("1", "2", "3"):
            assert (version in served) == (requests.get(f"{versioned_server.url}/v2/models/{model}/versions/{version}/ready").status_code == 200)
    response = requests.post(f"{versioned_server.url}/v2/models/{model}/infer", json=SIMPLE_BODY).json()
    assert response["model_version"] == served[-1]
    response = requests.post(f"{versioned_server.url}/v2/models/{model}/versions/{served[0]}/infer", json=SIMPLE_BODY).json()
    assert response["model_version"] == served[0]


def test_grpc_named_version(versioned_server):
    with grpcclient.InferenceServerClient(versioned_server.grpc) as client:
        tensors = []
        for name in ("INPUT0", "INPUT1"):
            tensor = grpcclient.InferInput(name, [1, 16], "INT32")
            tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
            tensors.append(tensor)
        assert client.infer("all_versions", tensors, model_version="2").get_response().model_version == "2"
        with pytest.raises(Exception, match="'specific' version 2 is not found"):
            client.infer("specific", tensors, model_version="2")


def test_instances_are_placed_over_device_ids(tmp_path):
    model = copy_model("sim", tmp_path)
    config = model / "config.pbtxt"
    config.write_text(
        config.read_text().replace("instance_group [ { kind: KIND_MODEL count: 1 } ]", "instance_group [ { kind: KIND_MODEL count: 4 } ]")
        + 'parameters { key: "device_ids" value: { string_value: "2,3" } }\n'
    )
    server = start_server(tmp_path, tmp_path / "placement.log")
    try:
        metadata = requests.get(f"{server.url}/v2/models/sim").json()
        log = server.output()
    finally:
        stop_server(server)
    assert metadata["parameters"]["device_ids"] == "2,3,2,3"
    assert "model 'sim' is READY with versions [1]" in log

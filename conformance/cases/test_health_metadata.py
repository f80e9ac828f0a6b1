"""Health, server metadata and model metadata."""

import pytest
import requests

from conftest import DATATYPES, identity

OIP = "OIP v2 required_api.md"


@pytest.mark.spec(f"{OIP} §Health (server live, server ready)")
def test_server_live_and_ready(url, grpc):
    assert requests.get(f"{url}/v2/health/live").status_code == 200
    assert requests.get(f"{url}/v2/health/ready").status_code == 200
    assert grpc.is_server_live() and grpc.is_server_ready()


@pytest.mark.spec(f"{OIP} §Health (model ready, with and without version)")
def test_model_ready_per_model_and_version(url, grpc):
    for path in ("/v2/models/simple/ready", "/v2/models/simple/versions/1/ready"):
        assert requests.get(url + path).status_code == 200, path
    assert grpc.is_model_ready("simple") and grpc.is_model_ready("simple", "1")


@pytest.mark.spec(f"{OIP} §Health: 4xx indicates false")
@pytest.mark.parametrize("path", ["/v2/models/no_such_model/ready", "/v2/models/simple/versions/999/ready"])
def test_ready_of_unknown_model_or_version_is_4xx(url, http, path):
    response = requests.get(url + path)
    assert 400 <= response.status_code < 500 and response.json()["error"]
    assert http.is_model_ready("no_such_model") is False and http.is_model_ready("simple", "999") is False


@pytest.mark.spec(f"{OIP} §Health over GRPC (ModelReadyResponse): Triton answers ready false for an unknown model or version")
def test_grpc_ready_of_unknown_model_or_version_is_false(grpc):
    assert grpc.is_model_ready("no_such_model") is False  # tritonclient raises if the call fails
    assert grpc.is_model_ready("simple", "999") is False


@pytest.mark.spec(f"{OIP} §Server Metadata ($metadata_server_response)")
def test_server_metadata_shape(url, grpc):
    metadata = requests.get(f"{url}/v2").json()
    assert isinstance(metadata["name"], str) and metadata["name"]
    assert isinstance(metadata["version"], str)
    assert isinstance(metadata["extensions"], list) and all(isinstance(e, str) for e in metadata["extensions"])
    grpc_metadata = grpc.get_server_metadata()
    assert grpc_metadata.name == metadata["name"] and list(grpc_metadata.extensions) == metadata["extensions"]


@pytest.mark.spec(f"{OIP} §Model Metadata ($metadata_model_response)")
def test_model_metadata_shape(url):
    for path in ("/v2/models/simple", "/v2/models/simple/versions/1"):
        metadata = requests.get(url + path).json()
        assert metadata["name"] == "simple"
        assert "1" in metadata["versions"] and all(isinstance(v, str) for v in metadata["versions"])
        assert isinstance(metadata["platform"], str)
        assert [t["name"] for t in metadata["inputs"]] == ["INPUT0", "INPUT1"]
        for tensor in metadata["inputs"] + metadata["outputs"]:
            assert tensor["datatype"] == "INT32" and tensor["shape"] == [-1, 16]


@pytest.mark.spec(f"{OIP} §Model Metadata over GRPC (ModelMetadataResponse)")
def test_model_metadata_over_grpc(grpc):
    metadata = grpc.get_model_metadata("simple", "1")
    assert metadata.name == "simple" and "1" in metadata.versions
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("OUTPUT0", "INT32", [-1, 16]),
        ("OUTPUT1", "INT32", [-1, 16]),
    ]


@pytest.mark.spec(f"{OIP} §Tensor Data Types: every datatype in model metadata")
@pytest.mark.parametrize("datatype", DATATYPES)
def test_metadata_names_each_datatype(url, datatype):
    metadata = requests.get(f"{url}/v2/models/{identity(datatype)}").json()
    assert metadata["inputs"] == [{"name": "INPUT0", "datatype": datatype, "shape": [-1, -1]}]

"""Error semantics: every client mistake is a 4xx with {"error": "<message>"} (gRPC: its status code),
and the server goes on serving correctly after each one."""

import numpy as np
import pytest
import requests
import grpc as grpclib
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from conftest import assert_serves, simple_body

ERROR = "OIP v2 required_api.md §Inference Response JSON Error Object; §HTTP/REST status codes"


@pytest.fixture(autouse=True)
def still_serves(url):
    yield
    assert_serves(url)


def first_input(**changes) -> dict:
    body = simple_body()
    body["inputs"][0].update(changes)
    return body


CASES = {
    "unknown_model": ("/v2/models/no_such_model/infer", simple_body()),
    "unknown_version": ("/v2/models/simple/versions/999/infer", simple_body()),
    "malformed_json": ("/v2/models/simple/infer", b'{"inputs": ['),
    "inputs_not_a_list": ("/v2/models/simple/infer", {"inputs": {"INPUT0": [1]}}),
    "data_shorter_than_shape": ("/v2/models/simple/infer", first_input(data=list(range(15)))),
    "datatype_mismatch": ("/v2/models/simple/infer", first_input(datatype="FP32", data=[0.5] * 16)),
    "json_values_of_wrong_type": ("/v2/models/simple/infer", first_input(data=["x"] * 16)),
    "wrong_rank": ("/v2/models/simple/infer", first_input(shape=[16])),
    "wrong_dims": ("/v2/models/simple/infer", first_input(shape=[2, 8])),
    "unknown_input": ("/v2/models/simple/infer", {"inputs": simple_body()["inputs"] + [dict(simple_body()["inputs"][0], name="NOPE")]}),
    "missing_input": ("/v2/models/simple/infer", {"inputs": simple_body()["inputs"][:1]}),
    "unknown_requested_output": ("/v2/models/simple/infer", simple_body(outputs=[{"name": "NOPE"}])),
    "batch_over_max_batch_size": (
        "/v2/models/simple/infer",
        {"inputs": [dict(i, shape=[9, 16], data=[1] * 144) for i in simple_body()["inputs"]]},
    ),
}


@pytest.mark.spec(ERROR)
@pytest.mark.parametrize("case", list(CASES))
def test_rest_client_mistake_is_4xx_with_error_body(url, case):
    path, body = CASES[case]
    response = requests.post(url + path, **({"data": body} if isinstance(body, bytes) else {"json": body}))
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text}"
    error = response.json()["error"]
    assert isinstance(error, str) and error


@pytest.mark.spec("Triton extension_binary_data.md (binary_data_size beyond the body)")
def test_binary_size_beyond_the_body_is_4xx(url):
    header = b'{"inputs":[{"name":"INPUT0","shape":[1,3],"datatype":"INT32","parameters":{"binary_data_size":12}}]}'
    response = requests.post(
        f"{url}/v2/models/identity_int32/infer", data=header + bytes(8), headers={"Inference-Header-Content-Length": str(len(header))}
    )
    assert 400 <= response.status_code < 500
    assert response.json()["error"]


@pytest.fixture(scope="module")
def stub(target):
    with grpclib.insecure_channel(target.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def grpc_request(model="simple", version="", shape=(1, 16), count=16, datatype="INT32", names=("INPUT0", "INPUT1")):
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for name in names:
        request.inputs.add(name=name, datatype=datatype, shape=list(shape))
        request.raw_input_contents.append(np.zeros(count, np.int32).tobytes())
    return request


GRPC_CASES = {
    "unknown_model": (grpc_request(model="no_such_model"), {grpclib.StatusCode.NOT_FOUND, grpclib.StatusCode.INVALID_ARGUMENT}),
    "unknown_version": (grpc_request(version="999"), {grpclib.StatusCode.NOT_FOUND, grpclib.StatusCode.INVALID_ARGUMENT}),
    "raw_size_mismatch": (grpc_request(count=15), {grpclib.StatusCode.INVALID_ARGUMENT}),
    "wrong_rank": (grpc_request(shape=(16,)), {grpclib.StatusCode.INVALID_ARGUMENT}),
    "missing_input": (grpc_request(names=("INPUT0",)), {grpclib.StatusCode.INVALID_ARGUMENT}),
    "batch_over_max_batch_size": (grpc_request(shape=(9, 16), count=144), {grpclib.StatusCode.INVALID_ARGUMENT}),
}


@pytest.mark.spec("OIP v2 required_api.md §GRPC (status codes of failed calls)")
@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_client_mistake_has_its_status_code(stub, case):
    request, codes = GRPC_CASES[case]
    with pytest.raises(grpclib.RpcError) as raised:
        stub.ModelInfer(request)
    assert raised.value.code() in codes, f"{raised.value.code()}: {raised.value.details()}"
    assert raised.value.details()


# ---- error texts Triton's clients and examples match on ------------------------------------------

TRITON_EXAMPLES = "Triton client examples (simple_http_infer_client.py, simple_grpc_health_metadata.py): error texts"


@pytest.mark.spec(TRITON_EXAMPLES)
@pytest.mark.parametrize("path", ["/v2/models/no_such_model", "/v2/models/no_such_model/infer", "/v2/models/simple/versions/999/infer"])
def test_rest_unknown_model_error_says_request_for_unknown_model(url, path):
    response = requests.post(url + path, json=simple_body()) if path.endswith("infer") else requests.get(url + path)
    assert response.status_code == 404
    assert response.json()["error"].startswith("Request for unknown model")


@pytest.mark.spec(TRITON_EXAMPLES)
@pytest.mark.parametrize("rpc", ["ModelMetadata", "ModelConfig", "ModelInfer"])
@pytest.mark.parametrize("version", ["", "999"])
def test_grpc_unknown_model_error_says_request_for_unknown_model(stub, rpc, version):
    model = "simple" if version else "no_such_model"
    request = {
        "ModelMetadata": pb.ModelMetadataRequest(name=model, version=version),
        "ModelConfig": pb.ModelConfigRequest(name=model, version=version),
        "ModelInfer": grpc_request(model=model, version=version),
    }[rpc]
    with pytest.raises(grpclib.RpcError) as raised:
        getattr(stub, rpc)(request)
    assert raised.value.code() == grpclib.StatusCode.NOT_FOUND
    assert raised.value.details().startswith("Request for unknown model")


@pytest.mark.spec("Triton's GetModelVersionFromString: a version string that is no number is INVALID_ARGUMENT")
@pytest.mark.parametrize("rpc", ["ModelReady", "ModelMetadata", "ModelInfer"])
def test_grpc_bad_version_string_is_invalid_argument(stub, rpc):
    request = {
        "ModelReady": pb.ModelReadyRequest(name="simple", version="abc"),
        "ModelMetadata": pb.ModelMetadataRequest(name="simple", version="abc"),
        "ModelInfer": grpc_request(version="abc"),
    }[rpc]
    with pytest.raises(grpclib.RpcError) as raised:
        getattr(stub, rpc)(request)
    assert raised.value.code() == grpclib.StatusCode.INVALID_ARGUMENT
    assert "failed to get model version from specified version string 'abc'" in raised.value.details()


@pytest.mark.spec(ERROR)
@pytest.mark.parametrize("path", ["/v2/models/simple/versions/abc/infer", "/v2/models/simple/versions/abc"])
def test_rest_bad_version_string_is_4xx(url, path):
    response = requests.post(url + path, json=simple_body()) if path.endswith("infer") else requests.get(url + path)
    assert 400 <= response.status_code < 500
    assert response.json()["error"]


#: One mistake in INPUT1 (INPUT0 is right): the message names the input (and both datatypes).
NAMED_MISTAKES = {
    "missing_input": ({"inputs": simple_body()["inputs"][:1]}, ["INPUT1"]),
    "wrong_datatype": (
        {"inputs": [simple_body()["inputs"][0], dict(simple_body()["inputs"][1], datatype="FP32", data=[0.5] * 16)]},
        ["INPUT1", "FP32", "INT32"],
    ),
    "wrong_shape": ({"inputs": [simple_body()["inputs"][0], dict(simple_body()["inputs"][1], shape=[1, 8], data=[1] * 8)]}, ["INPUT1"]),
    "unknown_requested_output": (simple_body(outputs=[{"name": "NOPE"}]), ["NOPE"]),
}


@pytest.mark.spec(ERROR)
@pytest.mark.parametrize("case", list(NAMED_MISTAKES))
def test_rest_input_mistake_is_400_naming_the_tensor(url, case):
    body, words = NAMED_MISTAKES[case]
    response = requests.post(f"{url}/v2/models/simple/infer", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert all(word in error for word in words), error

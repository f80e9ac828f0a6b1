"""Every client mistake answers 4xx with {"error": ...} (gRPC: its status code), and the server goes on serving.

Status codes follow the OIP v2 specification (required_api.md: "HTTP Status Codes" and the
error response `{"error": <error message string>}`), and Triton's behaviour where the
specification leaves a choice (an existing but unavailable model is 400).
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
import grpc as grpclib

GOOD = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]
}


def with_input(**changes):
    body = {"inputs": [dict(GOOD["inputs"][0], **changes), GOOD["inputs"][1]]}
    return body


def assert_still_serves(server):
    response = requests.post(f"{server.url}/v2/models/simple/infer", json=GOOD)
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [i + 1 for i in range(16)]


REST_CASES = {
    "unknown model": ("/v2/models/nope/infer", GOOD, 404, "Request for unknown model: 'nope' is not found"),
    "unknown version": ("/v2/models/simple/versions/9/infer", GOOD, 404, "'simple' version 9 is not found"),
    "non-numeric version": ("/v2/models/simple/versions/x/infer", GOOD, 400, "failed to get model version from specified version string 'x'"),
    "malformed JSON": ("/v2/models/simple/infer", b'{"inputs": [', 400, "malformed JSON"),
    "empty body": ("/v2/models/simple/infer", b"", 400, "malformed JSON"),
    "body not an object": ("/v2/models/simple/infer", b"[1, 2]", 400, "must be a JSON object"),
    "inputs not a list": ("/v2/models/simple/infer", {"inputs": {"INPUT0": 1}}, 400, "'inputs' of the request must be list"),
    "no inputs": ("/v2/models/simple/infer", {"id": "x"}, 400, "has no 'inputs'"),
    "input not an object": ("/v2/models/simple/infer", {"inputs": [3]}, 400, "must be a JSON object"),
    "input without name": ("/v2/models/simple/infer", {"inputs": [{"shape": [1], "datatype": "INT32", "data": [1]}]}, 400, "has no 'name'"),
    "bad shape": ("/v2/models/simple/infer", with_input(shape=[1, "16"]), 400, "'shape' of input 'INPUT0'"),
    "negative shape": ("/v2/models/simple/infer", with_input(shape=[-1, 16]), 400, "'shape' of input 'INPUT0'"),
    # Past numpy's limits (found by test_fuzz.py): the codec must refuse them before reshaping.
    "rank past numpy's": ("/v2/models/simple/infer", with_input(shape=[1] * 33, data=[1]), 400, "33 dimensions"),
    "empty but too large": ("/v2/models/simple/infer", with_input(shape=[0, 2**62, 2**62], data=[]), 400, "larger than a tensor"),
    "unknown datatype": ("/v2/models/simple/infer", with_input(datatype="INT33"), 400, "'datatype' of input 'INPUT0'"),
    "wrong datatype": ("/v2/models/simple/infer", with_input(datatype="FP32"), 400, "has datatype FP32, the model expects INT32"),
    "floats for INT32": ("/v2/models/simple/infer", with_input(data=[0.5] * 16), 400, "not INT32"),
    "strings for INT32": ("/v2/models/simple/infer", with_input(data=["a"] * 16), 400, "not INT32"),
    "out of INT32 range": ("/v2/models/simple/infer", with_input(data=[2**40] * 16), 400, "out of the range of INT32"),
    "ragged data": ("/v2/models/simple/infer", with_input(data=[[1, 2], [3]]), 400, "not a regular array"),
    "data shorter than shape": ("/v2/models/simple/infer", with_input(data=[1] * 15), 400, "has 15 elements in 'data'"),
    "wrong rank": ("/v2/models/simple/infer", with_input(shape=[16], data=[1] * 16), 400, "the model expects [-1, 16]"),
    "wrong dims": ("/v2/models/simple/infer", with_input(shape=[2, 8]), 400, "the model expects [-1, 16]"),
    "missing input": ("/v2/models/simple/infer", {"inputs": GOOD["inputs"][:1]}, 400, "missing input 'INPUT1'"),
    "unknown input": ("/v2/models/simple/infer", {"inputs": GOOD["inputs"] + [dict(GOOD["inputs"][0], name="X")]}, 400, "unexpected input 'X'"),
    "duplicate input": ("/v2/models/simple/infer", {"inputs": GOOD["inputs"] + GOOD["inputs"][:1]}, 400, "appears twice"),
    "no data": ("/v2/models/simple/infer", with_input(data=None), 400, "neither 'data' nor"),
    "unknown requested output": ("/v2/models/simple/infer", dict(GOOD, outputs=[{"name": "OUT9"}]), 400, "unknown requested output 'OUT9'"),
    "oversized batch": (
        "/v2/models/simple/infer",
        {"inputs": [dict(i, shape=[9, 16], data=[1] * 144) for i in GOOD["inputs"]]},
        400,
        "batch size 9 is outside 1..8",
    ),
    "mismatched batch sizes": (
        "/v2/models/simple/infer",
        {"inputs": [dict(GOOD["inputs"][0], shape=[2, 16], data=[1] * 32), GOOD["inputs"][1]]},
        400,
        "has batch size",
    ),
}


@pytest.mark.parametrize("case", REST_CASES, ids=list(REST_CASES))
def test_rest_client_mistakes(server, case):
    path, body, status, message = REST_CASES[case]
    response = requests.post(server.url + path, **({"data": body} if isinstance(body, bytes) else {"json": body}))
    assert response.status_code == status, response.text
    assert message in response.json()["error"]
    assert_still_serves(server)


BINARY_CASES = {
    "header length not a number": ({"Inference-Header-Content-Length": "abc"}, b"{}", "must be an integer"),
    "header length past the body": ({"Inference-Header-Content-Length": "999"}, b"{}", "outside the body"),
    "binary data too short": (None, 60, "only 60 remain"),
    "binary data too long": (None, 68, "no input claims"),
}


def binary_body(available: int) -> tuple[dict, bytes]:
    header = (
        b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32","parameters":{"binary_data_size":64}},'
        b'{"name":"INPUT1","shape":[1,16],"datatype":"INT32","data":[' + b",".join([b"1"] * 16) + b"]}]}"
    )
    return {"Inference-Header-Content-Length": str(len(header))}, header + bytes(available)


@pytest.mark.parametrize("case", BINARY_CASES, ids=list(BINARY_CASES))
def test_binary_extension_mistakes(server, case):
    headers, body, message = BINARY_CASES[case]
    if headers is None:
        headers, body = binary_body(body)
    response = requests.post(f"{server.url}/v2/models/simple/infer", data=body, headers=headers)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]
    assert_still_serves(server)


def test_binary_size_that_does_not_match_shape(server):
    header = b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32","parameters":{"binary_data_size":8}}]}'
    response = requests.post(
        f"{server.url}/v2/models/simple/infer",
        data=header + bytes(8),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 400
    assert "has 8 bytes of binary data but shape [1, 16] of INT32 needs 64" in response.json()["error"]


def test_unknown_routes_and_methods_answer_in_oip_error_shape(server):
    missing = requests.get(f"{server.url}/v2/nothing/here")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = requests.get(f"{server.url}/v2/models/simple/infer")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_health_of_unknown_model_and_version(server):
    # Not ready, as Triton answers (400, tests/test_errors.py holds it to Triton); other requests: unknown.
    assert requests.get(f"{server.url}/v2/models/nope/ready").status_code == 400
    assert requests.get(f"{server.url}/v2/models/simple/versions/4/ready").status_code == 400
    assert requests.get(f"{server.url}/v2/models/nope").json() == {"error": "Request for unknown model: 'nope' is not found"}


def grpc_request(**changes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    for key, value in changes.items():
        setattr(request, key, value) if not callable(value) else value(request)
    return request


def _drop_raw(request):
    del request.raw_input_contents[1]


def _wrong_type(request):
    request.inputs[0].datatype = "FP32"


def _short_raw(request):
    request.raw_input_contents[0] = b"\0" * 10


def _typed_and_raw(request):
    request.inputs[0].contents.int_contents.extend([1] * 16)


def _typed_wrong_count(request):
    del request.raw_input_contents[:]
    for tensor in request.inputs:
        tensor.contents.int_contents.extend([1] * 15)


def _rank_past_numpy(request):
    request.inputs[0].shape[:] = [1] * 33
    request.raw_input_contents[0] = bytes(4)


def _empty_but_too_large(request):
    request.inputs[0].shape[:] = [0, 2**62, 2**62]
    request.raw_input_contents[0] = b""


def _unknown_output(request):
    request.outputs.add(name="NOPE")


def _oversized(request):
    for index, tensor in enumerate(request.inputs):
        tensor.shape[:] = [9, 16]
        request.raw_input_contents[index] = np.zeros((9, 16), np.int32).tobytes()


GRPC_CASES = {
    "unknown model": ({"model_name": "nope"}, grpclib.StatusCode.NOT_FOUND),
    "unknown version": ({"model_version": "5"}, grpclib.StatusCode.NOT_FOUND),
    "raw count mismatch": ({"x": _drop_raw}, grpclib.StatusCode.INVALID_ARGUMENT),
    "wrong datatype": ({"x": _wrong_type}, grpclib.StatusCode.INVALID_ARGUMENT),
    "short raw contents": ({"x": _short_raw}, grpclib.StatusCode.INVALID_ARGUMENT),
    "typed and raw contents": ({"x": _typed_and_raw}, grpclib.StatusCode.INVALID_ARGUMENT),
    "typed contents count": ({"x": _typed_wrong_count}, grpclib.StatusCode.INVALID_ARGUMENT),
    "rank past numpy's": ({"x": _rank_past_numpy}, grpclib.StatusCode.INVALID_ARGUMENT),
    "empty but too large": ({"x": _empty_but_too_large}, grpclib.StatusCode.INVALID_ARGUMENT),
    "unknown requested output": ({"x": _unknown_output}, grpclib.StatusCode.INVALID_ARGUMENT),
    "oversized batch": ({"x": _oversized}, grpclib.StatusCode.INVALID_ARGUMENT),
}


@pytest.fixture(scope="module")
def stub(server):
    with grpclib.insecure_channel(server.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.parametrize("case", GRPC_CASES, ids=list(GRPC_CASES))
def test_grpc_client_mistakes(server, stub, case):
    changes, code = GRPC_CASES[case]
    request = grpc_request(**{k: v for k, v in changes.items() if k != "x"})
    if "x" in changes:
        changes["x"](request)
    with pytest.raises(grpclib.RpcError) as raised:
        stub.ModelInfer(request)
    assert raised.value.code() == code, raised.value.details()
    assert raised.value.details()
    good = stub.ModelInfer(grpc_request())
    np.testing.assert_array_equal(np.frombuffer(good.raw_output_contents[0], np.int32), np.arange(16) * 2)


def test_grpc_typed_contents_past_a_narrow_type_are_refused_not_wrapped(stub):
    request = grpc_request()
    del request.raw_input_contents[:]
    for tensor in request.inputs:
        tensor.datatype = "INT8"
        tensor.contents.int_contents.extend([1000] * 16)  # int_contents is 32-bit: 1000 would wrap to -24
    with pytest.raises(grpclib.RpcError) as raised:
        stub.ModelInfer(request)
    assert raised.value.code() == grpclib.StatusCode.INVALID_ARGUMENT
    assert "out of the range of INT8" in raised.value.details()


def test_grpc_typed_contents_are_accepted(stub):
    request = grpc_request()
    del request.raw_input_contents[:]
    for tensor in request.inputs:
        tensor.contents.int_contents.extend(range(16))
    response = stub.ModelInfer(request)
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[1], np.int32), np.zeros(16))


def test_grpc_metadata_of_unknown_model(stub):
    with pytest.raises(grpclib.RpcError) as raised:
        stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"))
    assert raised.value.code() == grpclib.StatusCode.NOT_FOUND


def test_kserve_v1_predict_is_a_client_error_not_a_crash(server):
    response = requests.post(f"{server.url}/v1/models/simple:predict", json={"instances": [[1, 2]]})
    assert response.status_code == 400
    assert "must name its inputs" in response.json()["error"]
    assert_still_serves(server)


def test_shared_memory_key_with_nul_is_a_client_error(server, stub):
    # Found by test_fuzz.py: the NUL reached os.open, whose ValueError answered 500 / UNKNOWN.
    url = f"{server.url}/v2/systemsharedmemory/region/r/register"
    response = requests.post(url, json={"key": "/a\0b", "byte_size": 8})
    assert response.status_code == 400, response.text
    assert "'key' of shared memory region 'r'" in response.json()["error"]
    with pytest.raises(grpclib.RpcError) as raised:
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(name="r", key="/a\0b", byte_size=8))
    assert raised.value.code() == grpclib.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert_still_serves(server)

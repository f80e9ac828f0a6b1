"""Failures in the protocols' error shapes: an unexpected exception of a runtime answers 500 JSON / INTERNAL,
logged and counted, the server serving on; readiness and version errors as real Triton answers them."""

from __future__ import annotations

import queue

import grpc
import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import copy_model, scrape, start_server, statistics, stop_server

#: What onnxruntime's Gather raises (its own exception type, no AscendError) for an index past the table.
ORT_FAULT = "indices element out of data bounds"


def write_lookup_model(repository) -> None:
    """`lookup`: VALUE = TABLE[INDEX] for a table of 4; onnxruntime raises for an index past it."""
    table = numpy_helper.from_array(np.arange(4, dtype=np.float32) * 10, "TABLE")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["TABLE", "INDEX"], ["VALUE"])],
        "lookup",
        [helper.make_tensor_value_info("INDEX", TensorProto.INT64, [-1])],
        [helper.make_tensor_value_info("VALUE", TensorProto.FLOAT, [-1])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (repository / "lookup" / "1").mkdir(parents=True)
    onnx.save(model, repository / "lookup" / "1" / "model.onnx")
    (repository / "lookup" / "config.pbtxt").write_text(
        'name: "lookup"\nbackend: "ascend"\nmax_batch_size: 0\n'
        'input [ { name: "INDEX" data_type: TYPE_INT64 dims: [ -1 ] } ]\n'
        'output [ { name: "VALUE" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    )


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    repository = tmp_path_factory.mktemp("faulty")
    write_lookup_model(repository)
    copy_model("simple", repository)
    server = start_server(repository, repository.parent / "faulty.log")
    yield server
    stop_server(server)


def index_input(module, index: int):
    tensor = module.InferInput("INDEX", [1], "INT64")
    tensor.set_data_from_numpy(np.array([index], np.int64))
    return tensor


def failures(server) -> tuple[int, float]:
    """The lookup model's failed requests: by the statistics extension, and by the BACKEND failure metric."""
    failed = scrape(server)("nv_inference_request_failure", model="lookup", reason="BACKEND", version="1")
    return statistics(server, "lookup")["inference_stats"]["fail"]["count"], failed


def assert_serves(server) -> None:
    """The server answers the same model correctly after the fault."""
    with httpclient.InferenceServerClient(server.http) as client:
        result = client.infer("lookup", [index_input(httpclient, 2)])
    assert result.as_numpy("VALUE").tolist() == [20.0]


def test_a_runtime_exception_answers_500_json_over_rest(faulty):
    before = failures(faulty)
    body = {"inputs": [{"name": "INDEX", "shape": [1], "datatype": "INT64", "data": [7]}]}
    response = requests.post(f"{faulty.url}/v2/models/lookup/infer", json=body)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"].startswith("InvalidArgument: ") and ORT_FAULT in response.json()["error"]
    with httpclient.InferenceServerClient(faulty.http) as client, pytest.raises(InferenceServerException) as raised:
        client.infer("lookup", [index_input(httpclient, 9)])
    assert raised.value.status() == "500" and ORT_FAULT in raised.value.message()
    assert failures(faulty) == (before[0] + 2, before[1] + 2)
    assert_serves(faulty)


def test_a_runtime_exception_answers_internal_over_grpc_and_in_the_stream(faulty):
    before = failures(faulty)
    with grpcclient.InferenceServerClient(faulty.grpc) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.infer("lookup", [index_input(grpcclient, 7)])
        assert raised.value.status() == "StatusCode.INTERNAL" and ORT_FAULT in raised.value.message()
        answers = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("lookup", [index_input(grpcclient, 7)], request_id="bad")
        client.async_stream_infer("lookup", [index_input(grpcclient, 1)], request_id="good")
        (_, error), (result, no_error) = answers.get(timeout=30), answers.get(timeout=30)
        client.stop_stream()
    assert isinstance(error, InferenceServerException) and ORT_FAULT in error.message()
    assert no_error is None and result.as_numpy("VALUE").tolist() == [10.0]  # the stream goes on
    assert failures(faulty) == (before[0] + 2, before[1] + 2)
    assert_serves(faulty)


def test_a_runtime_exception_answers_500_json_over_v1(faulty):
    response = requests.post(f"{faulty.url}/v1/models/lookup:predict", json={"instances": [[7]]})
    assert response.status_code == 500
    assert ORT_FAULT in response.json()["error"]
    assert requests.post(f"{faulty.url}/v1/models/lookup:predict", json={"instances": [[3]]}).json() == {
        "predictions": [{"VALUE": [30.0]}]
    }


def test_a_runtime_exception_is_logged_with_its_traceback(faulty):
    requests.post(
        f"{faulty.url}/v2/models/lookup/infer",
        json={"inputs": [{"name": "INDEX", "shape": [1], "datatype": "INT64", "data": [5]}]},
        headers={"x-request-id": "fault-5"},
    )
    log = faulty.output()
    at = log.index("fault-5")
    entry = log[at - 300 : at + 5000]
    assert "POST /v2/models/lookup/infer: unexpected error" in entry
    assert "Traceback (most recent call last)" in entry and "onnxruntime" in entry and "idx=5" in entry


# ---- readiness and version errors, held to real Triton on model_repository/ ----------------------


@pytest.fixture(scope="module")
def stubs(server, triton):
    with grpc.insecure_channel(server.grpc) as ours, grpc.insecure_channel(triton.grpc) as theirs:
        yield {"kserve": service_pb2_grpc.GRPCInferenceServiceStub(ours), "triton": service_pb2_grpc.GRPCInferenceServiceStub(theirs)}


def grpc_answer(call):
    try:
        return "OK", call()
    except grpc.RpcError as error:
        return error.code().name, error.details()


@pytest.mark.parametrize("path", ["/v2/models/no_such_model/ready", "/v2/models/simple/versions/9/ready", "/v2/models/simple/versions/0/ready"])
def test_rest_readiness_of_unknown_models_and_versions_as_triton(server, triton, path):
    ours, theirs = requests.get(server.url + path), requests.get(triton.url + path)
    assert ours.status_code == theirs.status_code == 400
    assert ours.json()["error"].startswith(theirs.json()["error"])  # Triton's "Model version not ready", then why


@pytest.mark.parametrize(("name", "version"), [("no_such_model", ""), ("simple", "9"), ("simple", "0"), ("", ""), ("no_such_model", "3")])
def test_grpc_readiness_of_unknown_models_and_versions_is_false_as_in_triton(server, triton, stubs, name, version):
    request = pb.ModelReadyRequest(name=name, version=version)
    assert grpc_answer(lambda: stubs["kserve"].ModelReady(request)) == grpc_answer(lambda: stubs["triton"].ModelReady(request)) == (
        "OK",
        pb.ModelReadyResponse(ready=False),
    )
    for target in (server, triton):
        with grpcclient.InferenceServerClient(target.grpc) as client:
            assert client.is_model_ready(name, version) is False
        with httpclient.InferenceServerClient(target.http) as client:
            assert client.is_model_ready(name or "no_such_model", version) is False


#: Not "1.0": Triton's std::stol reads its "1" and ignores the rest; this server refuses it.
BAD_VERSIONS = ["abc", "-1", "99999999999999999999"]


@pytest.mark.parametrize("version", BAD_VERSIONS)
@pytest.mark.parametrize("rpc", ["ModelReady", "ModelMetadata", "ModelConfig", "ModelInfer"])
def test_grpc_bad_version_string_is_invalid_argument_as_in_triton(stubs, rpc, version):
    requests_of = {
        "ModelReady": pb.ModelReadyRequest(name="simple", version=version),
        "ModelMetadata": pb.ModelMetadataRequest(name="simple", version=version),
        "ModelConfig": pb.ModelConfigRequest(name="simple", version=version),
        "ModelInfer": pb.ModelInferRequest(model_name="simple", model_version=version),
    }
    ours, theirs = (grpc_answer(lambda: getattr(stubs[s], rpc)(requests_of[rpc])) for s in ("kserve", "triton"))
    assert ours[0] == theirs[0] == "INVALID_ARGUMENT"
    assert ours[1].endswith("version should be an integral value > 0") and theirs[1].endswith("version should be an integral value > 0")
    if version != "-1":  # Triton words a negative number apart ("invalid model version specified '-1'")
        assert ours[1].startswith(f"failed to get model version from specified version string '{version}'")
        assert theirs[1].startswith(f"failed to get model version from specified version string '{version}'")


def test_rest_bad_version_string_is_a_client_error(server):
    # Triton's REST routes take digits only, so it answers "Not Found" (404) to `/versions/abc/...`
    # and 400 to a number past int64; this server answers 400 with Triton's gRPC words for both.
    for version in ("abc", "99999999999999999999"):
        for path in ("/ready", "", "/config", "/stats"):
            response = requests.get(f"{server.url}/v2/models/simple/versions/{version}{path}")
            assert response.status_code == 400, path
            assert response.json()["error"].startswith(f"failed to get model version from specified version string '{version}'")


def simple_request(version="", model="simple", **changes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for name in ("INPUT0", "INPUT1"):
        tensor = {"name": name, "datatype": "INT32", "shape": [1, 16], **changes.get(name, {})}
        request.inputs.add(**tensor)
        request.raw_input_contents.append(np.zeros(int(np.prod(tensor["shape"])), np.int32).tobytes())
    return request


@pytest.mark.parametrize(
    "case",
    ["unknown_model", "unknown_version", "missing_input", "wrong_datatype", "wrong_shape", "unknown_output"],
)
def test_infer_mistakes_have_tritons_codes(stubs, case):
    request = {
        "unknown_model": simple_request(model="no_such_model"),
        "unknown_version": simple_request(version="9"),
        "wrong_datatype": simple_request(INPUT1={"datatype": "FP32"}),
        "wrong_shape": simple_request(INPUT1={"shape": [1, 8]}),
    }.get(case) or simple_request()
    if case == "missing_input":
        del request.inputs[1]
        del request.raw_input_contents[1]
    if case == "unknown_output":
        request.outputs.add(name="NOPE")
    ours, theirs = (grpc_answer(lambda: stubs[s].ModelInfer(request)) for s in ("kserve", "triton"))
    assert ours[0] == theirs[0] != "OK"
    if case.startswith("unknown_m") or case == "unknown_version":
        # Triton's words, which its client examples match on.
        assert ours[1].startswith("Request for unknown model") and theirs[1].startswith("Request for unknown model")
    else:
        assert ("NOPE" if case == "unknown_output" else "INPUT1") in ours[1]

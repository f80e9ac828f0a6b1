"""schedule_policy: a request's "priority" and "timeout" parameters (Triton's extension_schedule_policy.md).

conformance/models/scheduled batches dynamically with two priority levels (the default 2) and lets
a request set its own queue timeout. What the wire shows: both parameters are taken, over HTTP and
gRPC; a priority of 0 or beyond the model's levels is the default level (core's
InferenceRequest::SetPriority), not an error; a value that is no unsigned integer is refused.
"""

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

MODEL = "scheduled"
DATA = [3, 1, 4, 1]


def _body(parameters: dict) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "INT32", "data": DATA}], "parameters": parameters}


POLICIES = {
    "priority_1": {"priority": 1},
    "priority_2": {"priority": 2},
    "priority_0_is_the_default": {"priority": 0},
    "priority_beyond_the_levels_is_the_default": {"priority": 9},
    "timeout": {"timeout": 5_000_000},
    "both": {"priority": 1, "timeout": 5_000_000},
}


@pytest.mark.spec("Triton extension_schedule_policy.md §Dynamic Batcher")
@pytest.mark.parametrize("case", list(POLICIES))
def test_schedule_policy_over_http(url, case, requires):
    requires("schedule_policy")
    response = requests.post(f"{url}/v2/models/{MODEL}/infer", json=_body(POLICIES[case]))
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == DATA


@pytest.mark.spec("Triton extension_schedule_policy.md §Dynamic Batcher (tritonclient's priority= and timeout=)")
@pytest.mark.parametrize("case", list(POLICIES))
def test_schedule_policy_over_grpc(grpc, case, requires):
    requires("schedule_policy")
    tensor = grpcclient.InferInput("INPUT0", [1, 4], "INT32")
    tensor.set_data_from_numpy(np.array([DATA], np.int32))
    answer = grpc.infer(MODEL, [tensor], **POLICIES[case])
    np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), [DATA])


MALFORMED = {
    "negative_priority": {"priority": -1},
    "string_priority": {"priority": "high"},
    "fractional_priority": {"priority": 1.5},
    "negative_timeout": {"timeout": -1},
    "string_timeout": {"timeout": "soon"},
}


@pytest.mark.spec("Triton http_server.cc: \"Unable to parse 'priority'\" / 'timeout'; OIP: a client error is 4xx")
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_schedule_policy_is_4xx(url, case, requires):
    requires("schedule_policy")
    response = requests.post(f"{url}/v2/models/{MODEL}/infer", json=_body(MALFORMED[case]))
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text}"
    assert list(response.json()) == ["error"]


@pytest.mark.spec("Triton infer_handler.cc: 'priority' must be an int64_param >= 0 or a uint64_param")
@pytest.mark.parametrize(
    "parameter", [pb.InferParameter(int64_param=-1), pb.InferParameter(string_param="high")], ids=["negative", "string"]
)
def test_malformed_priority_over_grpc_is_invalid_argument(target, parameter, requires):
    requires("schedule_policy")
    request = pb.ModelInferRequest(model_name=MODEL, parameters={"priority": parameter})
    tensor = request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 4])
    tensor.contents.int_contents.extend(DATA)
    with grpc.insecure_channel(target.grpc) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()

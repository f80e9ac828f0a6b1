"""Decoupled models (`model_transaction_policy { decoupled: true }`): `repeat_int32`, Triton's `repeat` backend
example, answers one request with a response per element of IN over gRPC ModelStreamInfer, each marked
`triton_final_response: false`, then the final flag alone; the unary routes refuse it.

What Triton 2.51 sends, seen on the wire (2026-12-05, its `ascend` backend serving repeat_int32; the same
with a python-backend model written as repeat.cc behaves): server src/grpc/stream_infer_handler.cc for
the parameters, src/http_server.cc and src/grpc/infer_handler.cc for the refusals.
"""

import grpc as grpclib
import numpy as np
import pytest
import requests
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from conftest import simple_body
from conformance.harness import grpc_request, repeat_request, response_outputs, stream_infer

DECOUPLED = "Triton decoupled_models.md"
FINAL = "triton_final_response"


def final_flag(response: pb.ModelInferResponse) -> bool:
    assert response.parameters[FINAL].WhichOneof("parameter_choice") == "bool_param", response
    return response.parameters[FINAL].bool_param


@pytest.mark.spec(f"{DECOUPLED} §Decoupled backends and models; Triton repeat_backend README")
def test_a_decoupled_model_streams_a_response_per_element_then_the_final_flag_alone(target):
    responses = stream_infer(target, [repeat_request([7, 8, 9], id="r1")])
    assert [r.error_message for r in responses] == ["", "", ""]
    answers = [r.infer_response for r in responses]
    assert [(a.id, a.model_name, a.model_version, final_flag(a)) for a in answers] == [("r1", "repeat_int32", "1", False)] * 3
    outputs = [response_outputs(a) for a in answers]
    assert [(o["OUT"].tolist(), o["IDX"].tolist()) for o in outputs] == [([7], [0]), ([8], [1]), ([9], [2])]
    assert [o["IDX"].dtype for o in outputs] == [np.uint32] * 3


@pytest.mark.spec(f"{DECOUPLED} §Decoupled Responses (triton_enable_empty_final_response)")
def test_the_final_flag_comes_as_an_empty_response_when_the_request_asks(target):
    *answers, last = stream_infer(target, [repeat_request([5, 6], id="e", triton_enable_empty_final_response=True)])
    assert [final_flag(r.infer_response) for r in answers] == [False, False]
    assert (last.error_message, last.infer_response.id, last.infer_response.model_name) == ("", "e", "repeat_int32")
    assert final_flag(last.infer_response) and not last.infer_response.outputs and not last.infer_response.model_version
    # No element, no response: only the final flag, and only when asked for.
    assert stream_infer(target, [repeat_request([])]) == []
    (alone,) = stream_infer(target, [repeat_request([], triton_enable_empty_final_response=True)])
    assert final_flag(alone.infer_response) and not alone.infer_response.outputs


@pytest.mark.spec(f"{DECOUPLED} §Decoupled Responses (triton_enable_empty_final_response)")
def test_empty_final_response_must_be_a_bool_parameter(target):
    (response,) = stream_infer(target, [repeat_request([1], id="b", triton_enable_empty_final_response="yes")])
    assert response.error_message == "invalid value type for 'triton_enable_empty_final_response' parameter, expected bool_param."
    assert response.infer_response.id == "b"


@pytest.mark.spec(f"{DECOUPLED}; Triton repeat_backend src/repeat.cc (OUT, IDX as requested)")
def test_only_the_outputs_asked_for_are_streamed(target):
    responses = stream_infer(target, [repeat_request([3, 4], outputs=["OUT"])])
    assert [[o.name for o in r.infer_response.outputs] for r in responses] == [["OUT"], ["OUT"]]


@pytest.mark.spec(f"{DECOUPLED} §Decoupled Responses (an error ends the request: it is final)")
def test_an_error_of_the_model_is_a_final_response_with_the_error(target):
    (response,) = stream_infer(target, [repeat_request([1, 2], delays=[0, 0, 0], id="x")])
    assert response.error_message.startswith("expected IN and DELAY shape to match")
    assert (response.infer_response.id, response.infer_response.model_name) == ("x", "repeat_int32")
    assert final_flag(response.infer_response)


@pytest.mark.spec(f"{DECOUPLED}; Triton server src/grpc/stream_infer_handler.cc (an ordinary model's one response)")
def test_an_ordinary_model_on_the_stream_answers_once_marked_final(target):
    inputs = {"INPUT0": np.arange(16, dtype=np.int32).reshape(1, 16), "INPUT1": np.ones((1, 16), np.int32)}
    for empty_final in (False, True):
        (response,) = stream_infer(target, [grpc_request("simple", inputs, triton_enable_empty_final_response=empty_final)])
        assert final_flag(response.infer_response)
        assert response_outputs(response.infer_response)["OUTPUT0"].tolist() == [list(range(1, 17))]


@pytest.mark.spec(f"{DECOUPLED}; Triton server src/http_server.cc, src/grpc/infer_handler.cc")
def test_the_unary_routes_refuse_a_decoupled_model(target):
    body = {"inputs": [
        {"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]},
        {"name": "DELAY", "shape": [1], "datatype": "UINT32", "data": [0]},
        {"name": "WAIT", "shape": [1], "datatype": "UINT32", "data": [0]},
    ]}
    response = requests.post(f"{target.url}/v2/models/repeat_int32/infer", json=body)
    assert (response.status_code, response.json()) == (
        501, {"error": "HTTP end point doesn't support models with decoupled transaction policy"},
    )
    with grpclib.insecure_channel(target.grpc) as channel:
        with pytest.raises(grpclib.RpcError) as refused:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(repeat_request([1]))
    assert refused.value.code() == grpclib.StatusCode.UNIMPLEMENTED
    assert refused.value.details() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
    # An ordinary model beside it serves on.
    assert requests.post(f"{target.url}/v2/models/simple/infer", json=simple_body()).status_code == 200


@pytest.mark.spec(f"{DECOUPLED}; Triton server src/grpc/stream_infer_handler.cc (a refused request's error response)")
def test_a_request_refused_on_the_stream_is_an_error_response_naming_it(target):
    # Not a refused request of the decoupled model itself (an unknown output of repeat_int32): Triton 2.51 then
    # loses its error response now and then and never ends the stream (8 of 60 streams here), or aborts
    # (grpc proto_buffer_writer.h "ASSERTION FAILED: !byte_buffer->Valid()"). tests/test_decoupled.py checks
    # that refusal on kserve-ascend (test_a_refused_request_of_the_decoupled_model_is_an_error_response_naming_it).
    refused = [
        grpc_request("simple", {"INPUT0": np.ones((1, 16), np.int32)}, id="m"),  # missing INPUT1
        grpc_request("no_such_model", {"INPUT0": np.ones((1, 16), np.int32)}, id="u"),
    ]
    responses = {response.infer_response.id: response for response in stream_infer(target, refused)}
    assert sorted(responses) == ["m", "u"]
    for response in responses.values():
        assert response.error_message and not response.infer_response.outputs
        assert FINAL not in response.infer_response.parameters  # refused before any model: no flag

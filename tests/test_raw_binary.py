"""Raw binary requests (`Inference-Header-Content-Length: 0`): the shapes and refusals conformance/ does not
reach with its models, each as real Triton 2.51 answered the same body (2026-12-05, `ascend` backend)."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from kserve_ascend.core.errors import InvalidInput
from kserve_ascend.core.signature import Signature

FOUR_FLOATS = np.arange(4, dtype=np.float32).tobytes()


def signature(datatype: str, dims: str, max_batch_size: int = 8) -> Signature:
    config = f'name: "m" max_batch_size: {max_batch_size} input [ {{ name: "INPUT0" data_type: {datatype} dims: {dims} }} ]'
    return Signature(text_format.Parse(config, mc.ModelConfig()))


def raw(body: bytes) -> np.ndarray:
    return np.frombuffer(body, np.uint8)


@pytest.mark.parametrize(
    "datatype, dims, max_batch_size, body, shape",
    [
        ("TYPE_FP32", "[ 2, 2 ]", 8, FOUR_FLOATS, (1, 2, 2)),  # fixed dims: a batch of 1 before them
        ("TYPE_FP32", "[ 2, -1 ]", 0, FOUR_FLOATS, (2, 2)),  # no batching: the dims alone
        ("TYPE_FP32", "[ -1 ]", 8, b"", (1, 0)),  # an empty body: no element
    ],
)
def test_the_shape_is_deduced_as_triton_deduces_it(datatype, dims, max_batch_size, body, shape):
    inputs = signature(datatype, dims, max_batch_size).raw_input(raw(body), "m")
    assert inputs["INPUT0"].shape == shape
    assert inputs["INPUT0"].tobytes() == body


def test_a_bytes_input_of_dims_1_holds_the_whole_body_as_its_element():
    assert signature("TYPE_STRING", "[ 1 ]").raw_input(raw(b"hello"), "m")["INPUT0"].tolist() == [[b"hello"]]


@pytest.mark.parametrize(
    "dims, max_batch_size, body, message",
    [
        ("[ -1, -1 ]", 8, FOUR_FLOATS,
         "The shape of the raw input 'INPUT0' can not be deduced because there are more than one variable-sized dimension"),
        ("[ 2, -1 ]", 0, FOUR_FLOATS[:12], "input byte size mismatch for input 'raw_input' for model 'm'. Expected 8, got 12"),
        ("[ 2, 2 ]", 8, FOUR_FLOATS * 2, "input byte size mismatch for input 'raw_input' for model 'm'. Expected 16, got 32"),
    ],
)  # fmt: skip
def test_what_cannot_be_deduced_is_refused_in_tritons_words(dims, max_batch_size, body, message):
    with pytest.raises(InvalidInput) as refused:
        signature("TYPE_FP32", dims, max_batch_size).raw_input(raw(body), "m")
    assert str(refused.value) == message


def test_no_json_or_grpc_input_can_pass_for_a_raw_body():
    """The data plane takes an input named RAW_INPUT ("") for a raw body: the decoders refuse that name."""
    from tritonclient.grpc import service_pb2 as pb

    from kserve_ascend.server.dataplane import RAW_INPUT
    from kserve_ascend.server.dataplane.shm import SharedMemoryRegistry
    from kserve_ascend.server.edges.codec import decode_grpc, decode_rest

    body = b'{"inputs": [{"name": "", "shape": [1, 4], "datatype": "FP32", "data": [0, 1, 2, 3]}]}'
    request = pb.ModelInferRequest(model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor(name=RAW_INPUT, datatype="FP32", shape=[1, 4])])
    request.raw_input_contents.append(FOUR_FLOATS)
    for decode in (lambda: decode_rest(body, None, SharedMemoryRegistry(), "m", "", 0),
                   lambda: decode_grpc(request, SharedMemoryRegistry(), 0)):  # fmt: skip
        with pytest.raises(InvalidInput, match="an input has an empty 'name'"):
            decode()

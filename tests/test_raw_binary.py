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

"""The smallest useful ONNX model, y = Relu(x) with x and y FP32 [1, 4], as serialized bytes.

Written field by field in protobuf's wire format (field numbers from onnx/onnx.proto), so that
code which must make a session without the `onnx` package can: the host check
(tools/check_ascend_host.py) and the runtime that lets ONNX Runtime's CANN execution provider
initialise ACL (runtimes/onnx.py, initialise_acl).
"""

from __future__ import annotations


def relu_model() -> bytes:
    """A ModelProto: ir_version 8, opset 13 of the default domain, one Relu node."""
    shape = _message((1, _message((1, 1))), (1, _message((1, 4))))  # TensorShapeProto.dim: dim_value 1, 4
    fp32 = _message((1, _message((1, 1), (2, shape))))  # TypeProto.tensor_type: elem_type FLOAT, shape
    graph = _message(
        (1, _message((1, "x"), (2, "y"), (4, "Relu"))),  # NodeProto: input, output, op_type
        (2, "relu"),  # name
        (11, _message((1, "x"), (2, fp32))),  # input ValueInfoProto: name, type
        (12, _message((1, "y"), (2, fp32))),  # output
    )
    # ir_version, producer_name, graph, opset_import { version 13 }.
    return _message((1, 8), (2, "kserve-ascend"), (7, graph), (8, _message((2, 13))))


def _message(*fields: tuple[int, int | str | bytes]) -> bytes:
    """Protobuf wire format: integers as varints, strings and messages length-delimited."""
    out = b""
    for number, value in fields:
        if isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            data = value.encode() if isinstance(value, str) else value
            out += _varint(number << 3 | 2) + _varint(len(data)) + data
    return out


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)

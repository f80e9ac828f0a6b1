"""Writes conformance/models/simple_string/1/model.onnx: Triton's `simple_string` example as an ONNX graph.

INPUT0 and INPUT1 are BYTES [batch, 16] of integers written as text; OUTPUT0 is their sum
and OUTPUT1 their difference, written back as text: Cast string->int32, Add / Sub, Cast
int32->string. Rerun with `python tools/make_simple_string.py`; the output is deterministic.
"""

import argparse
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent


def build_simple_string() -> onnx.ModelProto:
    def text(name):
        return helper.make_tensor_value_info(name, TensorProto.STRING, ["batch", 16])

    def cast(source, target, to):
        return helper.make_node("Cast", [source], [target], to=to)

    graph = helper.make_graph(
        [
            cast("INPUT0", "a", TensorProto.INT32),
            cast("INPUT1", "b", TensorProto.INT32),
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Sub", ["a", "b"], ["difference"]),
            cast("sum", "OUTPUT0", TensorProto.STRING),
            cast("difference", "OUTPUT1", TensorProto.STRING),
        ],
        "simple_string",
        [text("INPUT0"), text("INPUT1")],
        [text("OUTPUT0"), text("OUTPUT1")],
    )
    # Opset 17 / IR 8 so that older onnxruntime builds (onnxruntime-cann) load it too.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="kserve-ascend")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "conformance/models/simple_string/1/model.onnx")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_simple_string(), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

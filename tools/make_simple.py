"""Writes model_repository/simple/1/model.onnx: Triton's `simple` example as an ONNX graph.

OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, INT32 [batch, 16].
Rerun with `python tools/make_simple.py`; the output is byte-for-byte deterministic.
"""

import argparse
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent


def build_simple() -> onnx.ModelProto:
    def tensor(name):
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [tensor("INPUT0"), tensor("INPUT1")],
        [tensor("OUTPUT0"), tensor("OUTPUT1")],
    )
    # Opset 17 / IR 8 so that older onnxruntime builds (onnxruntime-cann) load it too.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="kserve-ascend")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "model_repository/simple/1/model.onnx")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_simple(), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

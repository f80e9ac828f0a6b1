"""Writes the stateful models of model_repository/: Triton's sequence examples as ONNX graphs.

Triton's sequence client examples (`simple_{http,grpc}_sequence_sync_infer_client.py`,
`simple_grpc_sequence_stream_infer_client.py`, with `-d` for the "dyna" models) expect:

- `simple_sequence` (direct strategy): OUTPUT = READY * (INPUT + START), so the first
  request of a sequence answers its input plus one, the others their input. Stateless, as
  Triton's own docs/examples/model_repository/simple_sequence/1/model.onnx.
- `simple_dyna_sequence` (oldest strategy): OUTPUT = READY * (INPUT + START + END * CORRID),
  CORRID a UINT64: the last request also adds the sequence id. Stateless, as Triton's.
- `simple_string_dyna_sequence` (oldest, string CORRID): the running sum of the sequence's
  inputs, plus the id (decimal text) on its last request. Triton's QA serves it with a C++
  backend that keeps the sum; here the sum is implicit state (`sequence_batching.state`)
  that the server keeps: OUTPUT_STATE = INPUT + INPUT_STATE, reset to zero at START.
- `sequence_accumulator` (direct): the running sum with READY/START controls and implicit
  state without an initial_state: OUTPUT_STATE = INPUT + INPUT_STATE * (1 - START).

All tensors are INT32 [batch, 1] (CORRID UINT64 or STRING). `sequence_accumulator` is also the
conformance suite's sequence model (conformance/models). Rerun with
`python tools/make_sequence_models.py`; the output is byte-for-byte deterministic.
"""

import argparse
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE_MODEL = ROOT / "conformance" / "models" / "sequence_accumulator" / "1" / "model.onnx"


def _tensor(name: str, elem_type: int = TensorProto.INT32):
    return helper.make_tensor_value_info(name, elem_type, ["batch", 1])


def _model(name: str, nodes: list, inputs: list, outputs: list, initializers: list = ()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    # Opset 17 / IR 8 so that older onnxruntime builds (onnxruntime-cann) load it too.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="kserve-ascend")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build_simple_sequence() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["INPUT", "START"], ["started"]),
        helper.make_node("Mul", ["READY", "started"], ["OUTPUT"]),
    ]
    return _model("simple_sequence", nodes, [_tensor(n) for n in ("INPUT", "START", "READY")], [_tensor("OUTPUT")])


def build_simple_dyna_sequence() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=TensorProto.INT32),
        helper.make_node("Mul", ["END", "corrid"], ["ending"]),
        helper.make_node("Add", ["INPUT", "START"], ["started"]),
        helper.make_node("Add", ["started", "ending"], ["total"]),
        helper.make_node("Mul", ["READY", "total"], ["OUTPUT"]),
    ]
    inputs = [_tensor(n) for n in ("INPUT", "START", "END", "READY")] + [_tensor("CORRID", TensorProto.UINT64)]
    return _model("simple_dyna_sequence", nodes, inputs, [_tensor("OUTPUT")])


def build_simple_string_dyna_sequence() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["INPUT", "INPUT_STATE"], ["OUTPUT_STATE"]),
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=TensorProto.INT32),  # decimal text to a number
        helper.make_node("Mul", ["END", "corrid"], ["ending"]),
        helper.make_node("Add", ["OUTPUT_STATE", "ending"], ["total"]),
        helper.make_node("Mul", ["READY", "total"], ["OUTPUT"]),
    ]
    inputs = [_tensor(n) for n in ("INPUT", "END", "READY")] + [_tensor("CORRID", TensorProto.STRING), _tensor("INPUT_STATE")]
    return _model("simple_string_dyna_sequence", nodes, inputs, [_tensor("OUTPUT"), _tensor("OUTPUT_STATE")])


def build_sequence_accumulator() -> onnx.ModelProto:
    one = helper.make_tensor("one", TensorProto.INT32, [], [1])
    nodes = [
        helper.make_node("Sub", ["one", "START"], ["continuing"]),
        helper.make_node("Mul", ["INPUT_STATE", "continuing"], ["carried"]),
        helper.make_node("Add", ["INPUT", "carried"], ["OUTPUT_STATE"]),
        helper.make_node("Mul", ["READY", "OUTPUT_STATE"], ["OUTPUT"]),
    ]
    inputs = [_tensor(n) for n in ("INPUT", "START", "READY", "INPUT_STATE")]
    return _model("sequence_accumulator", nodes, inputs, [_tensor("OUTPUT"), _tensor("OUTPUT_STATE")], [one])


BUILDERS = {
    "simple_sequence": build_simple_sequence,
    "simple_dyna_sequence": build_simple_dyna_sequence,
    "simple_string_dyna_sequence": build_simple_string_dyna_sequence,
    "sequence_accumulator": build_sequence_accumulator,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args()
    outs = [(args.repository / name / "1" / "model.onnx", build) for name, build in BUILDERS.items()]
    outs.append((CONFORMANCE_MODEL, BUILDERS["sequence_accumulator"]))
    for out, build in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(build(), out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Build a YOLOv8n detection model as ONNX, with seeded random weights.

The graph is the ultralytics ``yolov8n.yaml`` architecture (80 classes, depth 0.33,
width 0.25) in the form ``yolo export format=onnx`` gives it: BatchNorm folded into
the conv biases, SiLU as Sigmoid*Mul, and the Detect head decoding boxes in the
graph, so ``output0`` is [N, 84, 8400] = (cx, cy, w, h in input pixels, 80 class
scores) for the 8400 anchors of the 80x80, 40x40 and 20x20 grids.

There is no torch or ultralytics here and no pretrained weights: the model is for
serving, load and latency tests, not for detecting anything. The same seed gives
the same bytes.

    python tools/make_yolov8n.py [--out model_repository/yolov8n/1/model.onnx] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # onnx 1.10+; older runtimes such as onnxruntime-cann refuse newer IR versions
IMGSZ = 640
NC = 80
REG_MAX = 16
STRIDES = (8, 16, 32)
# 1 / sqrt(E[silu(z)^2]) for z ~ N(0, 1): the weight gain that keeps unit variance through SiLU.
SILU_GAIN = 1.6765

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "model_repository" / "yolov8n" / "1" / "model.onnx"

COCO_NAMES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat",
    "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack",
    "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball",
    "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket",
    "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair",
    "couch", "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse",
    "remote", "keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier",
    "toothbrush",
)


class Graph:
    """Collects nodes and initializers; tensor names follow the ultralytics module path."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.params = 0  # learnable weights only, not anchors/shapes/scales

    def const(self, name: str, array: np.ndarray, param: bool = False) -> str:
        self.inits.append(numpy_helper.from_array(array, name))
        if param:
            self.params += array.size
        return name

    def op(self, op_type: str, inputs: list[str], name: str, n_out: int = 1,
           **attrs) -> str | list[str]:
        # torch.onnx style: node "/model.2/Split", outputs "/model.2/Split_output_0", ...
        outputs = [f"{name}_output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def conv2d(self, x: str, c1: int, c2: int, k: int, s: int, name: str,
               w_std: float | None = None, bias: np.ndarray | None = None) -> str:
        # Normal(0, gain^2 / fan_in) with the SiLU gain keeps pre-activations near unit
        # variance layer after layer, as the BatchNorm folded into a trained conv would.
        # (He's sqrt(2) is the ReLU gain; with SiLU it halves the variance per layer.)
        std = SILU_GAIN / math.sqrt(c1 * k * k) if w_std is None else w_std
        w = self.rng.normal(0.0, std, (c2, c1, k, k)).astype(np.float32)
        b = self.rng.normal(0.0, 0.01, c2).astype(np.float32) if bias is None else bias
        wn = self.const(f"{name}.weight", w, param=True)
        bn = self.const(f"{name}.bias", b, param=True)
        p = k // 2
        return self.op("Conv", [x, wn, bn], f"/{name}/Conv",
                       kernel_shape=[k, k], strides=[s, s], pads=[p, p, p, p])


def conv(g: Graph, x: str, c1: int, c2: int, k: int, s: int, name: str) -> str:
    """ultralytics Conv: Conv2d(pad=k//2) + BN (folded) + SiLU."""
    y = g.conv2d(x, c1, c2, k, s, f"{name}.conv")
    base = f"/{name}"
    sig = g.op("Sigmoid", [y], f"{base}/act/Sigmoid")
    return g.op("Mul", [y, sig], f"{base}/act/Mul")


def bottleneck(g: Graph, x: str, c: int, shortcut: bool, name: str) -> str:
    """Two 3x3 convs at constant width (e=1.0 inside C2f), residual add if shortcut."""
    y = conv(g, x, c, c, 3, 1, f"{name}.cv1")
    y = conv(g, y, c, c, 3, 1, f"{name}.cv2")
    return g.op("Add", [x, y], f"/{name}/Add") if shortcut else y


def c2f(g: Graph, x: str, c1: int, c2: int, n: int, shortcut: bool, name: str) -> str:
    """cv1 to 2c, split in halves, chain n bottlenecks on the second half keeping every
    intermediate, concat the (2 + n) pieces, cv2 back to c2."""
    c = c2 // 2
    base = f"/{name}"
    y = conv(g, x, c1, 2 * c, 1, 1, f"{name}.cv1")
    split = g.const(f"{name}.split", np.array([c, c], dtype=np.int64))
    parts = g.op("Split", [y, split], f"{base}/Split", n_out=2, axis=1)
    for i in range(n):
        parts.append(bottleneck(g, parts[-1], c, shortcut, f"{name}.m.{i}"))
    y = g.op("Concat", parts, f"{base}/Concat", axis=1)
    return conv(g, y, (2 + n) * c, c2, 1, 1, f"{name}.cv2")


def sppf(g: Graph, x: str, c1: int, c2: int, k: int, name: str) -> str:
    """Three chained k x k stride-1 max pools equal 5/9/13 SPP pools, more cheaply."""
    c_ = c1 // 2
    base = f"/{name}"
    parts = [conv(g, x, c1, c_, 1, 1, f"{name}.cv1")]
    for i in range(3):
        parts.append(g.op("MaxPool", [parts[-1]], f"{base}/m/MaxPool_{i}",
                          kernel_shape=[k, k], strides=[1, 1], pads=[k // 2] * 4))
    y = g.op("Concat", parts, f"{base}/Concat", axis=1)
    return conv(g, y, 4 * c_, c2, 1, 1, f"{name}.cv2")


def upsample(g: Graph, x: str, name: str) -> str:
    """nn.Upsample(scale_factor=2, mode='nearest') as torch exports it."""
    scales = g.const(f"{name}.scales", np.array([1, 1, 2, 2], dtype=np.float32))
    return g.op("Resize", [x, "", scales], f"/{name}/Resize",
                mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def make_anchors() -> tuple[np.ndarray, np.ndarray]:
    """Grid cell centres (x, y) in grid units, [1, 2, 8400], and per-anchor stride, [1, 1, 8400]."""
    points, strides = [], []
    for s in STRIDES:
        n = IMGSZ // s
        sy, sx = np.meshgrid(np.arange(n) + 0.5, np.arange(n) + 0.5, indexing="ij")
        points.append(np.stack([sx.ravel(), sy.ravel()]))
        strides.append(np.full(n * n, s))
    anchors = np.concatenate(points, axis=1)[None].astype(np.float32)
    stride = np.concatenate(strides)[None, None].astype(np.float32)
    return anchors, stride


def detect(g: Graph, feats: list[str], chs: tuple[int, ...], name: str) -> str:
    """Detect head: per level a box branch (4 x 16 DFL bins) and a class branch, then
    DFL expectation, dist2bbox to xywh pixels and class sigmoid."""
    c2 = max(16, chs[0] // 4, REG_MAX * 4)  # 64
    c3 = max(chs[0], min(NC, 100))  # 80
    no = 4 * REG_MAX + NC  # 144
    base = f"/{name}"
    flat_shape = g.const(f"{name}.flat_shape", np.array([0, no, -1], dtype=np.int64))
    levels = []
    for i, (x, ch) in enumerate(zip(feats, chs)):
        # Final 1x1 convs: biases as ultralytics Detect.bias_init (box logits 1.0, i.e. flat
        # DFL bins; class logits at a prior of ~5 objects per 640 image) and weights giving
        # unit-variance logits around them, so the untrained head's boxes stay plausible
        # while still depending on the input.
        box = conv(g, x, ch, c2, 3, 1, f"{name}.cv2.{i}.0")
        box = conv(g, box, c2, c2, 3, 1, f"{name}.cv2.{i}.1")
        box = g.conv2d(box, c2, 4 * REG_MAX, 1, 1, f"{name}.cv2.{i}.2", w_std=c2 ** -0.5,
                       bias=np.ones(4 * REG_MAX, dtype=np.float32))
        cls = conv(g, x, ch, c3, 3, 1, f"{name}.cv3.{i}.0")
        cls = conv(g, cls, c3, c3, 3, 1, f"{name}.cv3.{i}.1")
        prior = math.log(5 / NC / (IMGSZ / STRIDES[i]) ** 2)
        cls = g.conv2d(cls, c3, NC, 1, 1, f"{name}.cv3.{i}.2", w_std=c3 ** -0.5,
                       bias=np.full(NC, prior, dtype=np.float32))
        y = g.op("Concat", [box, cls], f"{base}/Concat_{i}", axis=1)
        levels.append(g.op("Reshape", [y, flat_shape], f"{base}/Reshape_{i}"))
    y = g.op("Concat", levels, f"{base}/Concat_3", axis=2)  # [N, 144, 8400]
    split = g.const(f"{name}.split", np.array([4 * REG_MAX, NC], dtype=np.int64))
    box, cls = g.op("Split", [y, split], f"{base}/Split", n_out=2, axis=1)

    # DFL: each box side is the expectation over 16 distance bins; a fixed 1x1 conv with
    # weights 0..15 computes it, exactly as the exported model does.
    dfl_shape = g.const(f"{name}.dfl.shape", np.array([0, 4, REG_MAX, -1], dtype=np.int64))
    d = g.op("Reshape", [box, dfl_shape], f"{base}/dfl/Reshape")
    d = g.op("Transpose", [d], f"{base}/dfl/Transpose", perm=[0, 2, 1, 3])  # [N, 16, 4, A]
    d = g.op("Softmax", [d], f"{base}/dfl/Softmax", axis=1)
    bins = g.const(f"{name}.dfl.conv.weight",
                   np.arange(REG_MAX, dtype=np.float32).reshape(1, REG_MAX, 1, 1), param=True)
    d = g.op("Conv", [d, bins], f"{base}/dfl/conv/Conv", kernel_shape=[1, 1])
    out_shape = g.const(f"{name}.dfl.out_shape", np.array([0, 4, -1], dtype=np.int64))
    d = g.op("Reshape", [d, out_shape], f"{base}/dfl/Reshape_1")  # [N, 4, A] = l, t, r, b

    # dist2bbox: (left, top, right, bottom) distances from the cell centre -> cx, cy, w, h.
    anchors_np, strides_np = make_anchors()
    anchors = g.const(f"{name}.anchors", anchors_np)
    strides = g.const(f"{name}.strides", strides_np)
    half = g.const(f"{name}.half", np.array(0.5, dtype=np.float32))
    two = g.const(f"{name}.lt_rb_split", np.array([2, 2], dtype=np.int64))
    lt, rb = g.op("Split", [d, two], f"{base}/Split_1", n_out=2, axis=1)
    x1y1 = g.op("Sub", [anchors, lt], f"{base}/Sub")
    x2y2 = g.op("Add", [anchors, rb], f"{base}/Add")
    cxy = g.op("Mul", [g.op("Add", [x1y1, x2y2], f"{base}/Add_1"), half], f"{base}/Mul")
    wh = g.op("Sub", [x2y2, x1y1], f"{base}/Sub_1")
    xywh = g.op("Concat", [cxy, wh], f"{base}/Concat_4", axis=1)
    dbox = g.op("Mul", [xywh, strides], f"{base}/Mul_1")  # grid units -> input pixels
    scores = g.op("Sigmoid", [cls], f"{base}/Sigmoid")
    g.nodes.append(helper.make_node("Concat", [dbox, scores], ["output0"],
                                    name=f"{base}/Concat_5", axis=1))
    return "output0"


def build_yolov8n(seed: int = 0) -> onnx.ModelProto:
    g = Graph(seed)
    # Backbone. Channels are yolov8.yaml's times width 0.25; repeats 3/6/6/3 times depth 0.33.
    x = conv(g, "images", 3, 16, 3, 2, "model.0")  # P1/2
    x = conv(g, x, 16, 32, 3, 2, "model.1")  # P2/4
    x = c2f(g, x, 32, 32, 1, True, "model.2")
    x = conv(g, x, 32, 64, 3, 2, "model.3")  # P3/8
    p3 = c2f(g, x, 64, 64, 2, True, "model.4")
    x = conv(g, p3, 64, 128, 3, 2, "model.5")  # P4/16
    p4 = c2f(g, x, 128, 128, 2, True, "model.6")
    x = conv(g, p4, 128, 256, 3, 2, "model.7")  # P5/32
    x = c2f(g, x, 256, 256, 1, True, "model.8")
    p5 = sppf(g, x, 256, 256, 5, "model.9")

    # PAN head: top-down (upsample + concat), then bottom-up (stride-2 conv + concat).
    x = upsample(g, p5, "model.10")
    x = g.op("Concat", [x, p4], "/model.11/Concat", axis=1)
    h4 = c2f(g, x, 384, 128, 1, False, "model.12")
    x = upsample(g, h4, "model.13")
    x = g.op("Concat", [x, p3], "/model.14/Concat", axis=1)
    out3 = c2f(g, x, 192, 64, 1, False, "model.15")  # P3/8 out
    x = conv(g, out3, 64, 64, 3, 2, "model.16")
    x = g.op("Concat", [x, h4], "/model.17/Concat", axis=1)
    out4 = c2f(g, x, 192, 128, 1, False, "model.18")  # P4/16 out
    x = conv(g, out4, 128, 128, 3, 2, "model.19")
    x = g.op("Concat", [x, p5], "/model.20/Concat", axis=1)
    out5 = c2f(g, x, 384, 256, 1, False, "model.21")  # P5/32 out
    detect(g, [out3, out4, out5], (64, 128, 256), "model.22")

    graph = helper.make_graph(
        g.nodes, "yolov8n",
        inputs=[helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMGSZ, IMGSZ])],
        outputs=[helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 4 + NC, 8400])],
        initializer=g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="kserve-ascend tools/make_yolov8n.py",
                              doc_string=f"YOLOv8n architecture with RANDOM weights (seed {seed}); "
                                         "not a trained detector.")
    model.ir_version = IR_VERSION
    meta = {
        "description": f"YOLOv8n (random weights, seed {seed})",
        "task": "detect",
        "stride": "32",
        "batch": "dynamic",
        "imgsz": f"[{IMGSZ}, {IMGSZ}]",
        "names": str(dict(enumerate(COCO_NAMES))),
        "parameters": str(g.params),
    }
    helper.set_model_props(model, meta)
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = build_yolov8n(args.seed)
    data = model.SerializeToString()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    params = next(p.value for p in model.metadata_props if p.key == "parameters")
    print(f"wrote {args.out} ({len(data):,} bytes, {int(params):,} parameters, "
          f"sha256 {hashlib.sha256(data).hexdigest()})")


if __name__ == "__main__":
    main()

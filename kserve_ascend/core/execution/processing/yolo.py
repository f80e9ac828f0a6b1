"""YOLOv8 output decoding: per-anchor best class, score threshold, class-aware NMS, max detections.

YOLOv8 heads output [84, anchors] per image: cx, cy, w, h in the input's pixels, then
one score per class (80 for COCO; no objectness, unlike v5). Every step is a numpy
operation over all anchors; the only Python loop is greedy NMS, once per *kept* box
(at most `max_detections` times), each pass one vectorised IoU against the candidates left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ...errors import InvalidInput


@dataclass(frozen=True)
class DetectionOptions:
    """What a request may set: the defaults are ultralytics' `predict` defaults but IoU (0.7 there)."""

    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    max_detections: int = 100

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, object]) -> "DetectionOptions":
        """The options a request's `parameters` set; InvalidInput for a value out of range or of the wrong type."""
        values = {}
        for key in ("score_threshold", "iou_threshold"):
            value = parameters.get(key)
            if value is None:
                continue
            if not _is_number(value) or not 0 <= value <= 1:
                raise InvalidInput(f"request parameter '{key}' must be a number in [0, 1], got {value!r}")
            values[key] = float(value)
        value = parameters.get("max_detections")
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"request parameter 'max_detections' must be a positive integer, got {value!r}")
            values["max_detections"] = value
        return cls(**values) if values else DEFAULT_OPTIONS


DEFAULT_OPTIONS = DetectionOptions()


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Detections:
    """Boxes as x1, y1, x2, y2 (FP32 [n, 4]), their scores (FP32 [n]) and class ids (INT32 [n]), best first."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray


def decode(output: np.ndarray, options: DetectionOptions = DEFAULT_OPTIONS) -> Detections:
    """Detections of one image from its [4 + classes, anchors] output, in the model input's pixels."""
    class_scores = output[4:]
    classes = class_scores.argmax(axis=0)
    scores = np.take_along_axis(class_scores, classes[None], axis=0)[0]
    candidates = np.flatnonzero(scores > options.score_threshold)  # strictly above, as ultralytics
    candidates = candidates[np.argsort(-scores[candidates], kind="stable")]
    cx, cy, w, h = output[:4, candidates]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1).astype(np.float32, copy=False)
    keep = nms(boxes, classes[candidates], options.iou_threshold, options.max_detections)
    return Detections(
        boxes[keep],
        scores[candidates[keep]].astype(np.float32, copy=False),
        classes[candidates[keep]].astype(np.int32),
    )


def nms(boxes: np.ndarray, classes: np.ndarray, iou_threshold: float, limit: int) -> np.ndarray:
    """Greedy class-aware non-maximum suppression over boxes sorted best first; indices of the kept ones.

    A box is suppressed by a better kept box of the same class overlapping it by IoU above
    the threshold; boxes of different classes never suppress each other.
    """
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    left = np.arange(len(boxes))
    keep = []
    while left.size and len(keep) < limit:
        best, rest = left[0], left[1:]
        keep.append(best)
        x1 = np.maximum(boxes[best, 0], boxes[rest, 0])
        y1 = np.maximum(boxes[best, 1], boxes[rest, 1])
        x2 = np.minimum(boxes[best, 2], boxes[rest, 2])
        y2 = np.minimum(boxes[best, 3], boxes[rest, 3])
        inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
        iou = inter / np.maximum(areas[best] + areas[rest] - inter, np.finfo(np.float32).eps)
        left = rest[(iou <= iou_threshold) | (classes[rest] != classes[best])]
    return np.array(keep, dtype=np.intp)

"""YOLOv8 pre- and post-processing as runtimes, the first and last steps of a detection ensemble.

    image (encoded) | images (letterboxed) --yolov8_preprocess--> letterboxed, letterbox
    letterboxed --the detector (any runtime, batched)--> output0
    output0, letterbox --yolov8_postprocess--> detection_boxes, detection_scores, detection_classes, num_detections

They run the core's own processing code (`processing.image`, `processing.yolo`) and load no
file: a model says `parameters { key: "runtime" value: { string_value: "yolov8_preprocess" } }`
and its version directory holds nothing it needs. Each is an ordinary model of both servers,
so its `instance_group` count sets how many images (or detector outputs) are processed at once,
off the event loop, while the detector between them batches.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ...errors import InvalidInput, ModelLoadError
from ..processing import image, yolo
from .base import Runtime, TensorSpec

IMAGE, IMAGES = "image", "images"
LETTERBOXED, LETTERBOX = "letterboxed", "letterbox"
OUTPUT0 = "output0"
BOXES, SCORES, CLASSES, COUNT = "detection_boxes", "detection_scores", "detection_classes", "num_detections"
#: The letterbox as one FP32 [5] tensor: the image's width and height, the scale, the left and top padding.
LETTERBOX_FIELDS = ("width", "height", "scale", "left", "top")


class YoloV8Preprocess(Runtime):
    """An encoded image, or a tensor already letterboxed, to the detector's input and its letterbox.

    The input size is the one the config declares for `letterboxed`: FP32 [1, 3, height, width].
    """

    name = "yolov8_preprocess"

    def __init__(self, path, device_id, config):
        super().__init__(path, device_id, config)
        declared = {t.name: list(t.dims) for t in config.output}
        dims = declared.get(LETTERBOXED, [])
        if config.max_batch_size or len(dims) != 4 or dims[:2] != [1, 3] or min(dims[2:]) < 1:
            raise ModelLoadError(
                f"a {self.name} model has max_batch_size 0 and declares the output '{LETTERBOXED}'"
                f" as FP32 [1, 3, height, width], got {dims} (max_batch_size {config.max_batch_size})"
            )
        self.size = (dims[2], dims[3])
        shape = (1, 3, *self.size)
        self.inputs = [TensorSpec(IMAGE, "BYTES", (1,)), TensorSpec(IMAGES, "FP32", shape)]
        self.outputs = [TensorSpec(LETTERBOXED, "FP32", shape), TensorSpec(LETTERBOX, "FP32", (len(LETTERBOX_FIELDS),))]

    def prepare_request(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object]) -> Mapping[str, np.ndarray]:
        if (IMAGE in inputs) == (IMAGES in inputs):
            raise InvalidInput(
                f"give exactly one of the inputs '{IMAGE}' (an encoded image) and '{IMAGES}'"
                f" (a letterboxed FP32 [1, 3, {self.size[0]}, {self.size[1]}] tensor)"
            )
        return inputs

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        if IMAGE in inputs:
            tensor, frame = image.letterbox(_bytes(inputs[IMAGE]), self.size)
        else:
            tensor, frame = inputs[IMAGES], image.Letterbox.identity(self.size[1], self.size[0])
        letterbox = np.array([getattr(frame, field) for field in LETTERBOX_FIELDS], dtype=np.float32)
        return {LETTERBOXED: tensor, LETTERBOX: letterbox}


class YoloV8Postprocess(Runtime):
    """The detector's [1, 4 + classes, anchors] output to detections in the image's pixels: decoding,
    class-aware NMS and the letterbox undone. Request parameters `score_threshold`, `iou_threshold`
    and `max_detections` (processing.yolo.DetectionOptions) apply per request."""

    name = "yolov8_postprocess"

    def __init__(self, path, device_id, config):
        super().__init__(path, device_id, config)
        if config.max_batch_size:
            raise ModelLoadError(f"a {self.name} model answers a variable number of boxes per image: max_batch_size must be 0")
        self.inputs = [TensorSpec(OUTPUT0, "FP32", (1, -1, -1)), TensorSpec(LETTERBOX, "FP32", (len(LETTERBOX_FIELDS),))]
        self.outputs = [
            TensorSpec(BOXES, "FP32", (-1, 4)),
            TensorSpec(SCORES, "FP32", (-1,)),
            TensorSpec(CLASSES, "INT32", (-1,)),
            TensorSpec(COUNT, "INT32", (1,)),
        ]

    def prepare_request(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object]) -> Mapping[str, object]:
        """The request's detection parameters, checked, ride along with its tensors."""
        if inputs[OUTPUT0].shape[1] < 5:
            raise InvalidInput(f"input '{OUTPUT0}' has shape {list(inputs[OUTPUT0].shape)}: a YOLOv8 head has 4 box rows and a row per class")
        options = yolo.DetectionOptions.from_parameters(parameters)
        return inputs if options is yolo.DEFAULT_OPTIONS else {**inputs, _OPTIONS: options}

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        found = yolo.decode(inputs[OUTPUT0][0], inputs.get(_OPTIONS) or yolo.DEFAULT_OPTIONS)
        width, height, scale, left, top = inputs[LETTERBOX].tolist()
        frame = image.Letterbox(width, height, scale, left, top)
        outputs = {
            BOXES: frame.to_image(found.boxes),
            SCORES: found.scores,
            CLASSES: found.classes,
            COUNT: np.array([len(found.scores)], dtype=np.int32),
        }
        return {name: outputs[name] for name in output_names}


#: Where `prepare_request` puts a request's DetectionOptions among its inputs (no tensor has this name).
_OPTIONS = "\0detection_options"


def _bytes(tensor: np.ndarray) -> bytes:
    value = tensor.reshape(-1)[0]
    return value.encode() if isinstance(value, str) else bytes(value)

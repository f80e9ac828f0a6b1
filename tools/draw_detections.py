"""Draws a detection server's answer on the photograph it was given: the README's picture.

    python tools/fall_detector.py && make serve MODEL_DIR=build/fall_repository   # in another shell
    python tools/draw_detections.py [--url localhost:8080] [--model fall_detect] [--image astronaut] [--out docs/detection.jpg]

`--image` is a file, or the name of one of scikit-image's photographs (`astronaut`, `camera`...).
The image goes to the server as its encoded bytes (the ensemble's `image` input) at the default
thresholds; each returned box is drawn with its class name and score, as the server placed it in
the image's own pixels.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parent.parent
CLASSES = {"fall_detect": ("Normal", "Fall")}
COLOURS = ((46, 204, 64), (255, 65, 54))


def photograph(image: str) -> bytes:
    if Path(image).is_file():
        return Path(image).read_bytes()
    from skimage import data  # the test extra's scikit-image

    buffer = io.BytesIO()
    Image.fromarray(getattr(data, image)()).convert("RGB").save(buffer, "PNG")
    return buffer.getvalue()


def detect(url: str, model: str, encoded: bytes) -> dict[str, np.ndarray]:
    with httpclient.InferenceServerClient(url) as client:
        tensor = httpclient.InferInput("image", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([encoded], dtype=object))
        result = client.infer(model, [tensor])
    return {n: result.as_numpy(n) for n in ("detection_boxes", "detection_scores", "detection_classes")}


def draw(encoded: bytes, found: dict[str, np.ndarray], names: tuple[str, ...]) -> Image.Image:
    picture = Image.open(io.BytesIO(encoded)).convert("RGB")
    canvas = ImageDraw.Draw(picture)
    font = ImageFont.load_default(size=max(12, picture.height // 28))
    width = max(2, picture.height // 170)
    for box, score, cls in zip(found["detection_boxes"], found["detection_scores"], found["detection_classes"]):
        colour = COLOURS[int(cls) % len(COLOURS)]
        label = f"{names[cls] if cls < len(names) else cls} {score:.2f}"
        x1, y1, x2, y2 = box.tolist()
        canvas.rectangle((x1, y1, x2, y2), outline=colour, width=width)
        left, top, right, bottom = canvas.textbbox((x1, y1), label, font=font)
        lift = min(bottom - top + 2 * width, y1)  # above the box, or inside it at the image's top
        canvas.rectangle((left, top - lift, right + 2 * width, bottom - lift + width), fill=colour)
        canvas.text((x1 + width, y1 - lift), label, fill=(255, 255, 255), font=font)
    return picture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8080")
    parser.add_argument("--model", default="fall_detect")
    parser.add_argument("--image", default="astronaut")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "detection.jpg")
    args = parser.parse_args()
    encoded = photograph(args.image)
    found = detect(args.url, args.model, encoded)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(encoded, found, CLASSES.get(args.model, ())).save(args.out, quality=85)
    for box, score, cls in zip(found["detection_boxes"], found["detection_scores"], found["detection_classes"]):
        print(f"class {cls} score {score:.3f} box {np.round(box, 1).tolist()}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

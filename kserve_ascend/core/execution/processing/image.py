"""Images to the letterboxed NCHW tensor YOLO models take, and boxes back to the image's pixels."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, UnidentifiedImageError

from ...errors import InvalidInput

#: YOLOv8's padding grey (114/255 once normalised).
PAD_VALUE = 114
#: Larger images are refused before their pixels are decoded (a 100 kB PNG can claim 10^10 pixels).
MAX_PIXELS = 64 * 2**20
#: EXIF orientation -> the transposition that shows the image upright (as ImageOps.exif_transpose).
_EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_AXES = {Image.Transpose.TRANSPOSE, Image.Transpose.ROTATE_270, Image.Transpose.TRANSVERSE, Image.Transpose.ROTATE_90}


@dataclass(frozen=True)
class Letterbox:
    """How an image of `width`×`height` pixels was placed in the model's square input."""

    width: int
    height: int
    scale: float
    left: int
    top: int

    @classmethod
    def identity(cls, width: int, height: int) -> "Letterbox":
        """The input tensor is the image itself (a client sent it already letterboxed)."""
        return cls(width, height, 1.0, 0, 0)

    def to_image(self, boxes: np.ndarray) -> np.ndarray:
        """Maps x1,y1,x2,y2 boxes in the model's input to the image's pixels, clipped to it (in place)."""
        boxes[:, 0::2] -= self.left
        boxes[:, 1::2] -= self.top
        boxes /= self.scale
        np.clip(boxes[:, 0::2], 0, self.width, out=boxes[:, 0::2])
        np.clip(boxes[:, 1::2], 0, self.height, out=boxes[:, 1::2])
        return boxes


def open_image(data: bytes) -> Image.Image:
    """Reads an encoded image's header (JPEG, PNG, anything Pillow knows); InvalidInput if it is none."""
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as error:
        raise InvalidInput(f"input 'image' is not an image Pillow can read (JPEG, PNG...): {type(error).__name__}") from None
    if image.width * image.height > MAX_PIXELS:
        raise InvalidInput(f"input 'image' has {image.width}x{image.height} pixels, more than {MAX_PIXELS}")
    return image


def letterbox(data: bytes, size: tuple[int, int]) -> tuple[np.ndarray, Letterbox]:
    """Decodes an image and letterboxes it as YOLOv8 does: RGB, scaled to fit `size` (height, width)
    keeping its aspect, centred on grey 114, as a [1, 3, height, width] FP32 tensor in 0..1."""
    image = open_image(data)
    try:
        # Camera JPEGs: the pixels as a viewer shows them (and as OpenCV reads them for YOLOv8).
        transpose = _EXIF_TRANSPOSE.get(image.getexif().get(ExifTags.Base.Orientation, 1))
        width, height = image.size[::-1] if transpose in _SWAPS_AXES else image.size
        scale = min(size[0] / height, size[1] / width)
        fitted = (max(1, round(width * scale)), max(1, round(height * scale)))
        # JPEG: libjpeg decodes at 1/2, 1/4 or 1/8 scale when that still covers the fitted size.
        image.draft("RGB", fitted[::-1] if transpose in _SWAPS_AXES else fitted)
        image = image.convert("RGB")
        if transpose is not None:
            image = image.transpose(transpose)
        if image.size != fitted:
            image = image.resize(fitted, Image.Resampling.BILINEAR)
        pixels = np.asarray(image)
    except (OSError, ValueError, SyntaxError) as error:  # truncated or corrupt data shows only when decoding
        raise InvalidInput(f"input 'image' cannot be decoded: {error}") from None
    left = round((size[1] - fitted[0]) / 2 - 0.1)  # YOLOv8's rounding, so boxes map back the way it maps them
    top = round((size[0] - fitted[1]) / 2 - 0.1)
    tensor = np.full((1, 3, *size), PAD_VALUE / 255, dtype=np.float32)
    np.multiply(pixels.transpose(2, 0, 1), np.float32(1 / 255), out=tensor[0, :, top : top + fitted[1], left : left + fitted[0]])
    return tensor, Letterbox(width, height, scale, left, top)

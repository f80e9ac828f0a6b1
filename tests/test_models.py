"""The committed model files are exactly what the generator scripts in tools/ write."""

import hashlib
import sys

import numpy as np

from conftest import REPOSITORY, ROOT

sys.path.insert(0, str(ROOT / "tools"))

from make_simple import build_simple  # noqa: E402
from make_yolov8n import build_yolov8n  # noqa: E402


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_simple_is_reproducible():
    committed = (REPOSITORY / "simple" / "1" / "model.onnx").read_bytes()
    assert digest(build_simple().SerializeToString()) == digest(committed)


def test_yolov8n_is_reproducible_and_small():
    committed = (REPOSITORY / "yolov8n" / "1" / "model.onnx").read_bytes()
    model = build_yolov8n(seed=0)
    assert digest(model.SerializeToString()) == digest(committed)
    assert len(committed) < 15 * 2**20
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.name.endswith((".weight", ".bias")))
    assert params == 3_151_904  # ultralytics' count for the fused YOLOv8n


def test_simple_string_is_reproducible():
    from make_simple_string import build_simple_string

    committed = (ROOT / "conformance" / "models" / "simple_string" / "1" / "model.onnx").read_bytes()
    assert digest(build_simple_string().SerializeToString()) == digest(committed)

"""The request every load sends: one row per model, shaped and typed as its config.pbtxt declares."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kserve_ascend.core.config import read_config
from kserve_ascend.core.datatypes import from_config, from_numpy, to_numpy

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
#: The bench's own models (fastsim).
BENCH_REPOSITORY = ROOT / "bench" / "model_repository"


def model_dir(model: str) -> Path:
    """A model's folder: the bench's own repository or model_repository/."""
    return BENCH_REPOSITORY / model if (BENCH_REPOSITORY / model).is_dir() else REPOSITORY / model


def inputs(model: str, rows: int = 1) -> dict[str, np.ndarray]:
    """Seeded inputs of `rows` rows: the data is irrelevant to the cost, the shapes and bytes are not."""
    rng = np.random.default_rng(0)
    arrays = {}
    for tensor in read_config(model_dir(model)).input:
        dtype = to_numpy(from_config(tensor.data_type))
        shape = (rows, *tensor.dims)
        arrays[tensor.name] = rng.integers(0, 100, shape).astype(dtype) if dtype.kind in "iu" else rng.random(shape).astype(dtype)
    return arrays


def json_body(model: str) -> bytes:
    """The OIP v2 JSON request a user would POST (no id, no parameters)."""
    tensors = [
        {"name": name, "shape": list(a.shape), "datatype": from_numpy(a.dtype), "data": a.ravel().tolist()}
        for name, a in inputs(model).items()
    ]
    return json.dumps({"inputs": tensors}).encode()


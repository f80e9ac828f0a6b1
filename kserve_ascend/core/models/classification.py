"""Triton's classification extension: an output returned as its top-k classes, `"<value>:<index>[:<label>]"`.

A requested output with `parameters: {"classification": k}` comes back as BYTES of shape
[batch, min(k, classes)] (batching models) or [min(k, classes)], the classes of each batch
row ranked by value, labels from the file its config's `label_filename` names (one per line).
As Triton's server does (src/classification.cc, src/http_server.cc, src/grpc/infer_handler.h),
values print as C++ `std::to_string` does (`%f` for floats) and the classification happens
after the model ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .. import datatypes
from ..errors import InvalidInput, ModelLoadError

#: Labels of a version's outputs: output name -> one label per class index ("" for none).
Labels = Mapping[str, tuple[bytes, ...]]

#: Datatypes whose values rank. Triton's TopkClassifications also refuses FP16; it is kept here,
#: as the NPU's native precision, printed as the float it is.
_RANKED = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"})


def read_labels(config: mc.ModelConfig, model_dir: Path) -> Labels:
    """The labels of every output whose config names a `label_filename` in the model's directory.

    Read as Triton's LabelProvider does (core src/label_provider.cc, std::getline): one label
    per line, kept byte for byte. A file that cannot be read fails the load, as in Triton.
    """
    labels = {}
    for output in config.output:
        if not output.label_filename:
            continue
        path = model_dir / output.label_filename
        try:
            text = path.read_bytes()
        except OSError as error:
            raise ModelLoadError(f"label_filename of output '{output.name}': cannot read {path}: {error.strerror}") from None
        lines = text.split(b"\n")
        labels[output.name] = tuple(lines[:-1] if lines[-1] == b"" else lines)
    return labels


def classification_count(value: object, output: str) -> int:
    """A requested output's `classification` parameter: a number of classes, at least 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInput(f"'classification' of output '{output}' must be a number of classes, at least 1, got {value!r}")
    return value


def classify(
    outputs: Mapping[str, np.ndarray], counts: Mapping[str, int], labels: Labels, batching: bool
) -> dict[str, np.ndarray]:
    """The outputs with each one named in `counts` replaced by its top classes."""
    if not counts:
        return dict(outputs)
    return {name: _top(name, array, counts[name], labels.get(name, ()), batching) if name in counts else array
            for name, array in outputs.items()}


def _top(name: str, scores: np.ndarray, k: int, labels: tuple[bytes, ...], batching: bool) -> np.ndarray:
    datatype = datatypes.from_numpy(scores.dtype)
    if datatype not in _RANKED:
        # Triton's words (src/classification.cc), which clients may match on.
        raise InvalidInput(f"class result not available for output due to unsupported type '{datatype}' (output '{name}')")
    rows = scores.reshape(scores.shape[0], -1) if batching else scores.reshape(1, -1)
    classes = rows.shape[1]
    # Highest first, ties in index order (what std::sort's insertion sort gives Triton on small outputs):
    # a stable ascending sort of the reversed row, read backwards.
    ranked = classes - 1 - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1][:, :k]
    text = _float_text if scores.dtype.kind == "f" else str
    result = np.empty(ranked.shape, dtype=object)
    for (row, column), index in np.ndenumerate(ranked):
        entry = f"{text(rows[row, index])}:{index}".encode()
        label = labels[index] if index < len(labels) else b""
        result[row, column] = entry + b":" + label if label else entry
    return result if batching else result.reshape(-1)


def _float_text(value: np.floating) -> str:
    """std::to_string of a float or double: printf's `%f` of the value widened to a double."""
    return "%f" % float(value)

"""Runtimes by name and by model file extension."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ...errors import ModelLoadError
from .base import Runtime, TensorSpec, parameter

#: runtime name -> (module, class); imported on first use so a missing `acl` costs nothing elsewhere.
_RUNTIMES = {
    "onnx": ("onnx", "OnnxRuntime"),
    "acl": ("acl", "AclRuntime"),
    "sim": ("sim", "SimRuntime"),
    # The core's processing code, steps of a detection ensemble: no file (config.PROCESSING_RUNTIMES).
    "yolov8_preprocess": ("yolo", "YoloV8Preprocess"),
    "yolov8_postprocess": ("yolo", "YoloV8Postprocess"),
    # Triton's `repeat` backend: a decoupled model, no file.
    "repeat": ("repeat", "RepeatRuntime"),
}
_BY_EXTENSION = {".onnx": "onnx", ".om": "acl", ".sim": "sim"}


def runtime_name(config: mc.ModelConfig, path: Path) -> str:
    """`parameters { key: "runtime" }` if set, else the model file's extension decides."""
    name = parameter(config, "runtime") or _BY_EXTENSION.get(path.suffix)
    if name not in _RUNTIMES:
        raise ModelLoadError(
            f"no runtime for {path.name}: set parameters runtime to one of {sorted(_RUNTIMES)}"
            f" or use one of the extensions {sorted(_BY_EXTENSION)}"
        )
    return name


def load_runtime(config: mc.ModelConfig, path: Path, device_id: int) -> Runtime:
    """Loads `path` on `device_id` with the runtime the config selects."""
    module, cls = _RUNTIMES[runtime_name(config, path)]
    return getattr(import_module(f"{__name__}.{module}"), cls)(path, device_id, config)


__all__ = ["Runtime", "TensorSpec", "load_runtime", "runtime_name", "parameter"]

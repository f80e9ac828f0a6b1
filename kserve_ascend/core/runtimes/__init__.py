"""Runtimes by name and by model file extension."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import ModelLoadError
from .base import Runtime, TensorSpec, parameter

#: runtime name -> (module, class); imported on first use so a missing `acl` costs nothing elsewhere.
_RUNTIMES = {
    "onnx": ("onnx", "OnnxRuntime"),
    "acl": ("acl", "AclRuntime"),
    "sim": ("sim", "SimRuntime"),
}
_BY_EXTENSION = {".onnx": "onnx", ".om": "acl", ".sim": "sim"}
#: `parameters { key: "pipeline" }` -> (module, class): a runtime wrapping the file's own runtime
#: with pre- and post-processing, e.g. image bytes in, detections out.
_PIPELINES = {"yolov8": ("detect", "YoloV8Runtime")}


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
    """Loads `path` on `device_id` with the runtime the config selects, inside its pipeline if it names one."""
    pipeline = parameter(config, "pipeline")
    if pipeline is not None and pipeline not in _PIPELINES:
        raise ModelLoadError(f"unknown pipeline {pipeline!r}: parameters pipeline must be one of {sorted(_PIPELINES)}")
    runtime = _load(_RUNTIMES[runtime_name(config, path)], path, device_id, config)
    if pipeline is None:
        return runtime
    try:
        return _load(_PIPELINES[pipeline], runtime)
    except BaseException:
        runtime.close()
        raise


def _load(where: tuple[str, str], *args) -> Runtime:
    module, cls = where
    return getattr(import_module(f"{__name__}.{module}"), cls)(*args)


__all__ = ["Runtime", "TensorSpec", "load_runtime", "runtime_name", "parameter"]

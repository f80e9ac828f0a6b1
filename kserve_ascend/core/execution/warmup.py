"""Warmup: executions every instance runs before its model version serves.

The first executions of a model on an NPU are slow: the first at each OM gear, and with
ONNX Runtime's CANN execution provider the first at every input shape (it compiles a graph
per shape). Warming up moves that cost before readiness, out of the first requests.

What runs:
- Triton's `model_warmup` samples, as Triton defines them (model_configuration.md, "Model
  Warmup", and Triton core's `TritonModelInstance::GenerateWarmupData`): `batch_size` rows
  (a sample of batch_size 0 is skipped), every input's `dims` fixed, its data `zero_data`,
  `random_data` (random bytes; zeros for TYPE_STRING) or `input_data_file` (the raw row-major
  bytes of one row, read from the model's `warmup/` directory; serialized strings for
  TYPE_STRING); each sample runs `count` times, at least once.
- Without `model_warmup`, by default: one execution of zeros at every batch size the runtime
  will be handed, i.e. each of `runtime.batch_sizes` the batcher can reach (OM gears, a static
  batch) and, when the runtime `compiles_per_shape`, every batch size 1..max_batch_size.
  `parameters { key: "warmup" value: { string_value: "none" } }` turns the default off.

The KServe server runs both; inside Triton, Triton runs `model_warmup` itself and the
`ascend` backend runs only the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import deserialize_bytes_tensor

from .. import datatypes
from ..errors import InvalidInput, ModelLoadError
from .runtimes import parameter
from ..signature import Signature

if TYPE_CHECKING:
    from .instance import Instance

#: Where `input_data_file` is read from, in the model's directory (Triton's kWarmupDataFolder).
WARMUP_DIR = "warmup"
#: `parameters { key: "warmup" }`: "default" (the default warmup when there is no model_warmup) or "none".
POLICIES = ("default", "none")


@dataclass(frozen=True)
class Sample:
    """One warmup request (batch dimension first when the model batches), run `count` times."""

    name: str
    inputs: dict[str, np.ndarray]
    count: int = 1


def configured_samples(config: mc.ModelConfig, model_dir: Path) -> list[Sample]:
    """The config's `model_warmup` samples; ModelLoadError names the sample and what is wrong."""
    signature = Signature(config)
    samples = []
    for setting in config.model_warmup:
        if setting.batch_size == 0:
            continue  # as Triton does
        where = f"model_warmup '{setting.name}'"
        inputs = {}
        for name, spec in setting.inputs.items():
            row = _row(name, spec, model_dir, where)
            inputs[name] = np.repeat(row[np.newaxis], setting.batch_size, axis=0) if signature.batching else row
        try:
            # The checks every request passes: names, datatypes, shapes, batch size.
            signature.check_inputs(inputs)
        except InvalidInput as error:
            raise ModelLoadError(f"{where}: {error}") from None
        if not signature.batching and setting.batch_size != 1:
            raise ModelLoadError(f"{where}: batch_size must be 1 for a model that does not batch (max_batch_size 0)")
        samples.append(Sample(setting.name, inputs, max(setting.count, 1)))
    return samples


def _row(name: str, spec: mc.ModelWarmup.Input, model_dir: Path, where: str) -> np.ndarray:
    """One row of an input's warmup data."""
    try:
        datatype = datatypes.from_config(spec.data_type)
    except ValueError as error:
        raise ModelLoadError(f"{where}: input '{name}': {error}") from None
    dims = tuple(spec.dims)
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"{where}: warmup setting expects all variable-size dimensions are specified for input '{name}'")
    dtype, count = datatypes.to_numpy(datatype), math.prod(dims)
    kind = spec.WhichOneof("input_data_type")
    if kind == "zero_data" or (kind == "random_data" and datatype == "BYTES"):
        return np.full(dims, b"", dtype=object) if datatype == "BYTES" else np.zeros(dims, dtype)
    if kind == "random_data":
        raw = np.frombuffer(np.random.default_rng().bytes(count * dtype.itemsize), np.uint8)
        return (raw != 0 if datatype == "BOOL" else raw.view(dtype)).reshape(dims)
    if kind == "input_data_file":
        return _from_file(name, spec.input_data_file, model_dir, datatype, dims, where)
    raise ModelLoadError(f"{where}: warmup setting expects input '{name}' to have input_data_type set")


def _from_file(name: str, file: str, model_dir: Path, datatype: str, dims: tuple, where: str) -> np.ndarray:
    folder = (model_dir / WARMUP_DIR).resolve()
    path = (folder / file).resolve()
    if not path.is_relative_to(folder):
        raise ModelLoadError(f"{where}: input_data_file {file!r} of input '{name}' is outside the model's {WARMUP_DIR}/ directory")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ModelLoadError(f"{where}: input_data_file of input '{name}': {error.strerror}: {WARMUP_DIR}/{file}") from None
    count = math.prod(dims)
    if datatype == "BYTES":
        try:
            strings = deserialize_bytes_tensor(data)
        except Exception:  # a truncated length prefix
            strings = None
        if strings is None or strings.size != count:
            raise ModelLoadError(f"{where}: {WARMUP_DIR}/{file} does not hold {count} serialized strings for input '{name}'")
        return strings.reshape(dims)
    dtype = datatypes.to_numpy(datatype)
    need = count * dtype.itemsize
    if len(data) < need:
        # Triton's words; like Triton, a longer file is read only as far as one row needs.
        raise ModelLoadError(f"{where}: warmup setting expects {need} bytes, but the data provided from {file} only has {len(data)} bytes")
    return np.frombuffer(data, dtype, count).reshape(dims)


def default_samples(config: mc.ModelConfig, instance: Instance) -> list[Sample]:
    """Zeros at each batch size the instance's runtime will be handed (see the module's doc), unless
    `warmup` is "none".

    Empty when there is nothing worth warming (a runtime that neither fixes its batch sizes
    nor compiles per shape) or no zeros make a request (an input of variable dimensions, or
    of strings).
    """
    policy = (parameter(config, "warmup") or "default").strip()
    if policy not in POLICIES:
        raise ModelLoadError(f"parameter warmup must be one of {', '.join(POLICIES)}, got {policy!r}")
    signature = Signature(config)
    # The sizes the instance runs the file at; the file's own when the model does not batch.
    batch_sizes = instance.batch_sizes if signature.batching else tuple(instance.runtime.batch_sizes)
    if policy == "none" or not (batch_sizes or instance.runtime.compiles_per_shape):
        return []
    required = [d for d in signature.inputs.values() if not d.optional]
    if not required or any(d.datatype == "BYTES" or -1 in d.dims for d in required):
        return []
    if not signature.batching:
        return [Sample("default", {d.name: np.zeros(d.dims, datatypes.to_numpy(d.datatype)) for d in required})]
    limit = signature.max_batch_size
    # A batch runs at the smallest size that holds it: min(size, limit) rows reach each size the batcher can.
    rows = sorted({min(size, limit) for size in batch_sizes}) if batch_sizes else range(1, limit + 1)
    return [
        Sample(f"default batch {n}", {d.name: np.zeros((n, *d.dims), datatypes.to_numpy(d.datatype)) for d in required})
        for n in rows
    ]

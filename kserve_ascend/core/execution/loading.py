"""A version's model file on its devices, and what every request passes before it runs: the one path
both servers take (the KServe server for every instance of a version, the Triton backend for the
one instance Triton hands it).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .. import config as cfg
from ..errors import ModelLoadError
from ..scheduling import sequences as seq
from ..signature import Signature
from . import warmup
from .instance import Instance, complete_config
from .runtimes import load_runtime

log = logging.getLogger(__name__)

#: A runtime's own check of a request (`Runtime.prepare_request`), None for a runtime with none.
PrepareRequest = Callable[[Mapping[str, np.ndarray], Mapping[str, object]], Mapping[str, object]] | None


@dataclass
class LoadedInstances:
    """A version's model file loaded once per device, checked against its config."""

    path: Path
    #: The file's size and modification time when it was read (`file_stamp`).
    stamp: tuple[int, int]
    sha256: str
    instances: list[Instance]
    #: What the model file takes: the config's tensors and, for a sequence model, the control and
    #: state tensors the sequence batcher adds.
    signature: Signature
    sequences: seq.SequenceBatching | None
    #: The runtime's check of a request, run after the signature's (see `accept`).
    prepare_request: PrepareRequest
    #: What warmup runs on every instance before the version serves (see `warmup`).
    samples: list[warmup.Sample]

    def close(self) -> None:
        for instance in self.instances:
            instance.runtime.close()


def load_instances(
    config: mc.ModelConfig, model_dir: Path, version: int, device_ids: Sequence[int], configured_warmup: bool = True
) -> LoadedInstances:
    """Loads version `version` of the model in `model_dir` on each of `device_ids`; the config may be completed
    from the file where it is silent. ModelLoadError says what does not fit.

    The file is refused unless its sha256 is the one the config expects (if it names one).
    `configured_warmup`: whether the samples include the config's `model_warmup` (Triton runs
    those itself for its backends; the default warmup is the backend's own).
    """
    path = cfg.model_file(config, model_dir / str(version))
    stamp = file_stamp(path)  # first: a file that changes while it is read is read again at the next reload
    sha256 = checked_sha256(config, path, version)
    runtimes = []
    try:
        for device_id in device_ids:
            runtimes.append(load_runtime(config, path, device_id))
        complete_config(config, runtimes[0])
        cfg.apply_input_shape(config)
        seq.apply_defaults(config)
        sequences = seq.SequenceBatching(config, model_dir) if config.HasField("sequence_batching") else None
        model_config = sequences.model_config(config) if sequences is not None else config
        signature = Signature(model_config)
        instances = [Instance(runtime, signature) for runtime in runtimes]
        if config.model_warmup:
            samples = warmup.configured_samples(model_config, model_dir) if configured_warmup else []
        else:
            samples = warmup.default_samples(model_config, instances[0])
    except BaseException:
        for runtime in runtimes:
            runtime.close()
        raise
    return LoadedInstances(path, stamp, sha256, instances, signature, sequences, runtimes[0].prepare_request, samples)


def accept(
    signature: Signature, prepare_request: PrepareRequest, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object]
) -> tuple[int, Mapping[str, np.ndarray]]:
    """The checks every request passes before it is batched: the config's (names, datatypes, shapes, batch
    size), then the runtime's own. Its batch size and what the runtime takes of it; InvalidInput (a 400)
    names what does not fit."""
    rows = signature.check_inputs(inputs)
    if prepare_request is not None:
        inputs = prepare_request(inputs, parameters)
    return rows, inputs


def run_sample(instance: Instance, sample: warmup.Sample, where: str) -> None:
    """One execution of a warmup sample; ModelLoadError names the sample and `where` it failed."""
    try:
        instance.run_batch([sample.inputs])
    except Exception as error:
        raise ModelLoadError(f"warmup sample '{sample.name}' on {where} failed: {error}") from None


def warm_up(instance: Instance, samples: Sequence[warmup.Sample], where: str) -> float:
    """Runs every sample `count` times on one instance, in order; the milliseconds it took. The padding the
    samples caused is not counted (statistics count requests only)."""
    start = time.perf_counter()
    for sample in samples:
        for _ in range(sample.count):
            run_sample(instance, sample, where)
    instance.padding_rows = 0
    return (time.perf_counter() - start) * 1000


def file_stamp(path: Path) -> tuple[int, int]:
    """Size and modification time: what tells a changed (or still growing) file, cheaply."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def checked_sha256(config: mc.ModelConfig, path: Path, version: int) -> str:
    """The sha256 of a version's file; ModelLoadError unless it is the digest the config expects (if any).

    "" for a version of a processing runtime, which is a directory and no file.
    """
    if path.is_dir():
        return ""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    sha256 = digest.hexdigest()
    expected = cfg.expected_sha256(config, version)
    if expected and expected != sha256:
        raise ModelLoadError(f"{path.name} of version {version} has sha256 {sha256}, but the config expects {expected}")
    return sha256

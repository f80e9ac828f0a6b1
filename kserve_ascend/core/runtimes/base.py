"""The runtime interface: one model file loaded on one device.

A runtime knows nothing of requests, batching or protocols: it takes a dict of numpy
arrays whose first dimension is the batch and returns a dict of numpy arrays.
Every method but `utilization` is called from the single thread that owns the instance
(device contexts such as ACL's are bound to a thread), never from the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as the runtime sees it: OIP datatype and full shape, -1 where variable."""

    name: str
    datatype: str
    shape: tuple[int, ...]


def parameter(config: mc.ModelConfig, key: str, default: str | None = None) -> str | None:
    """A `parameters { key: ... value: { string_value: ... } }` entry of config.pbtxt."""
    if key in config.parameters:
        return config.parameters[key].string_value
    return default


class Runtime(ABC):
    """A model loaded for inference on one device."""

    #: Name used by `parameters { key: "runtime" }` and shown in model metadata.
    name: str = ""

    #: `prepare_request(inputs, parameters) -> inputs`, for a runtime that checks more than the
    #: config can say or takes request `parameters`: called once a request's inputs passed the
    #: signature, before it is queued (so a mistake of the client's is an InvalidInput, a 400);
    #: what it returns is what `run` receives. None (no such check) costs a request nothing.
    prepare_request: Callable[[Mapping[str, np.ndarray], Mapping[str, object]], Mapping[str, object]] | None = None

    def __init__(self, path: Path, device_id: int, config: mc.ModelConfig):
        self.path = path
        self.device_id = device_id
        self.config = config

    @property
    @abstractmethod
    def inputs(self) -> Sequence[TensorSpec]:
        """The model's inputs as described by the model file."""

    @property
    @abstractmethod
    def outputs(self) -> Sequence[TensorSpec]:
        """The model's outputs as described by the model file."""

    @property
    def max_batch_size(self) -> int:
        """The largest batch one `run` accepts, as the model file allows (0: any)."""
        return 0

    @property
    def info(self) -> Mapping[str, str]:
        """What this runtime chose (provider, device...), shown in model metadata parameters."""
        return {"runtime": self.name, "device_id": str(self.device_id)}

    @abstractmethod
    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Runs one batch: every input has the batch as dimension 0 (when the model batches)."""

    def utilization(self) -> float | None:
        """How busy this runtime's device is, in percent; None when the runtime cannot tell.

        Unlike the other methods, called from any thread (a metrics scrape): an
        implementation asks about the device, never through the instance's context.
        """
        return None

    def close(self) -> None:
        """Releases the device resources. Idempotent."""

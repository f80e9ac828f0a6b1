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
import threading
from typing import Callable, Iterator, Mapping, Sequence

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

    #: The model's inputs as described by the model file (its datatypes: FP16 stays FP16),
    #: set by `__init__` (or a property of a runtime that derives them).
    inputs: Sequence[TensorSpec]
    #: The model's outputs as described by the model file, under the names the config uses: where
    #: the file's naming differs by construction (ATC names the outputs of a converted model
    #: `opname:idx:name`), the runtime reports them as the config names them.
    outputs: Sequence[TensorSpec]

    #: Whether the first execution of each new input shape is slow (a provider that compiles
    #: a graph per shape, as ONNX Runtime's CANN execution provider does): the default warmup
    #: then runs every batch size the batcher can form, not only `batch_sizes`.
    compiles_per_shape: bool = False

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes one `run` takes, ascending, when the model file fixes them.

        `(B,)` for a file of static batch B (an `.om` compiled for one batch, an ONNX whose
        first dimension is a number), the gears of an `.om` compiled with ATC
        `--dynamic_batch_size`; `()` when the file takes any batch (a variable first
        dimension) or does not batch. The `Instance` pads a batch with zero rows up to the
        smallest size that holds it and splits a larger one into several runs, so a runtime
        is never handed a batch of another size.
        """
        return ()

    @property
    def max_batch_size(self) -> int:
        """The largest batch one `run` accepts, as the model file allows (0: any)."""
        return self.batch_sizes[-1] if self.batch_sizes else 0

    @property
    def info(self) -> Mapping[str, str]:
        """What this runtime chose (provider, device...), shown in model metadata parameters.

        A runtime serving below what the config asked for (the CPU where the CANN execution
        provider was wanted) says `"degraded": "true"` and why in `"degraded_reason"`.
        """
        return {"runtime": self.name, "device_id": str(self.device_id)}

    @abstractmethod
    def run(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Runs one batch: every input has the batch as dimension 0 (when the model batches)."""

    def responses(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], stop: threading.Event
    ) -> Iterator[dict[str, np.ndarray]]:
        """A decoupled model's execution (config `model_transaction_policy { decoupled: true }`): yields each
        response's outputs as it is ready, zero or more; returning is the final flag.

        `stop` is set once nobody wants more (the client cancelled): the runtime then stops producing, and
        waits on it (`stop.wait(seconds)`) rather than sleeping. By default, one response: `run`'s.
        """
        yield self.run(inputs, output_names)

    def utilization(self) -> float | None:
        """How busy this runtime's device is, in percent; None when the runtime cannot tell.

        Unlike the other methods, called from any thread (a metrics scrape): an
        implementation asks about the device, never through the instance's context.
        """
        return None

    def close(self) -> None:
        """Releases the device resources. Idempotent."""

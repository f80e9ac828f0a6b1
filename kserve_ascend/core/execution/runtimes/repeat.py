"""Triton's `repeat` backend as a runtime of the core: a decoupled model answering one request with as many
responses as its input has elements (triton-inference-server/repeat_backend, src/repeat.cc).

Inputs `IN` (INT32 [-1]), `DELAY` (UINT32 [-1], as long as IN) and `WAIT` (UINT32 [1]); outputs `OUT`
(INT32 [1]) and `IDX` (UINT32 [1]). Response i is sent DELAY[i] ms after the one before and holds IN[i] and i;
then the final flag, alone. As in repeat.cc, the model must not batch (max_batch_size 0) and the request
holds its instance WAIT ms at least (repeat.cc sleeps WAIT ms before releasing the request, while a thread
of its own sends the responses; here the instance's thread sends them, so it is held until the last one too).
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Mapping, Sequence

import numpy as np

from ...errors import InvalidInput, ModelLoadError
from ...signature import Signature
from .base import Runtime, TensorSpec

#: name -> (datatype, dims), in repeat.cc's order (ModelState::ValidateModelConfig).
INPUTS = {"IN": ("INT32", (-1,)), "DELAY": ("UINT32", (-1,)), "WAIT": ("UINT32", (1,))}
OUTPUTS = {"OUT": ("INT32", (1,)), "IDX": ("UINT32", (1,))}


class RepeatRuntime(Runtime):
    name = "repeat"

    def __init__(self, path, device_id, config):
        super().__init__(path, device_id, config)
        if config.max_batch_size != 0:
            raise ModelLoadError("repeat backend only supports models with max_batch_size == 0")  # repeat.cc's words
        signature = Signature(config)
        for declared, expected, kind in ((signature.inputs, INPUTS, "inputs"), (signature.outputs, OUTPUTS, "outputs")):
            found = {name: (t.datatype, t.dims) for name, t in declared.items()}
            if found != expected:
                raise ModelLoadError(f"the repeat runtime takes {kind} {_described(expected)}, the config declares {_described(found)}")
        self.inputs = [TensorSpec(name, datatype, dims) for name, (datatype, dims) in INPUTS.items()]
        self.outputs = [TensorSpec(name, datatype, dims) for name, (datatype, dims) in OUTPUTS.items()]

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        raise InvalidInput("the repeat runtime answers with a stream of responses: declare model_transaction_policy { decoupled: true }")

    def responses(
        self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], stop: threading.Event
    ) -> Iterator[dict[str, np.ndarray]]:
        values, delays = inputs["IN"], inputs["DELAY"]
        if values.shape != delays.shape:  # repeat.cc's check and words (ModelInstanceState::ProcessRequest)
            raise InvalidInput(f"expected IN and DELAY shape to match, got {_shape(values)} and {_shape(delays)}")
        released = time.monotonic() + int(inputs["WAIT"][0]) / 1000
        for index in range(values.shape[0]):
            if stop.wait(int(delays[index]) / 1000):
                return  # cancelled: no more responses
            yield {"OUT": values[index : index + 1].copy(), "IDX": np.array([index], np.uint32)}
        stop.wait(released - time.monotonic())  # the request holds its instance WAIT ms at least


def _shape(array: np.ndarray) -> str:
    return "[" + ",".join(map(str, array.shape)) + "]"  # backend::ShapeToString


def _described(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    return ", ".join(f"{name} {datatype} {list(dims)}" for name, (datatype, dims) in tensors.items()) or "none"

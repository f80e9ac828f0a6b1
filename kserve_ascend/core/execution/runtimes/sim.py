"""A simulated device: costs fixed + per_item·batch milliseconds per execution, like an NPU call.

An NPU costs nearly the same per call whatever the batch, so this model makes the
batcher's effect measurable and deterministic on a CPU. Output i is a copy of input i.
`sim_memory_mb`: memory each instance really allocates (and touches, so it is resident) for as
long as it is loaded, as a model's weights take a device's, and reports as what its load took, as
pyACL's runtime reports the device memory its load took: what memory budgets are tested with.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import numpy as np

from ...errors import ModelLoadError
from ...signature import Signature
from .base import Runtime, TensorSpec, parameter


class SimRuntime(Runtime):
    name = "sim"

    def __init__(self, path, device_id, config):
        super().__init__(path, device_id, config)
        try:
            self.fixed_s = float(parameter(config, "sim_fixed_ms", "0")) / 1000
            self.per_item_s = float(parameter(config, "sim_per_item_ms", "0")) / 1000
        except ValueError as error:
            raise ModelLoadError(f"sim_fixed_ms and sim_per_item_ms must be numbers: {error}") from None
        signature = Signature(config)
        if len(signature.inputs) != len(signature.outputs) or not signature.inputs:
            raise ModelLoadError("a sim model declares as many outputs as inputs (output i copies input i)")
        batch = (-1,) if signature.batching else ()
        self.inputs = [TensorSpec(t.name, t.datatype, batch + t.dims) for t in signature.inputs.values()]
        self.outputs = [TensorSpec(t.name, t.datatype, batch + t.dims) for t in signature.outputs.values()]
        self._source = {o.name: i.name for i, o in zip(self.inputs, self.outputs)}
        self._batching = signature.batching
        from ...models.memory import sim_bytes

        self._memory = np.ones(sim_bytes(config), np.uint8)  # every page written: resident, as weights on a device
        self.memory_bytes = self._memory.nbytes  # what the simulated device holds for it
        self.memory_source = "sim_memory_mb"

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        rows = next(iter(inputs.values())).shape[0] if self._batching else 1
        time.sleep(self.fixed_s + self.per_item_s * rows)  # releases the GIL, as a device call does
        return {name: inputs[self._source[name]].copy() for name in output_names}

    def close(self) -> None:
        self._memory = None

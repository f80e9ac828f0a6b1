"""ONNX models through ONNX Runtime: the CANN execution provider on an NPU, the CPU elsewhere."""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from ..errors import ModelLoadError
from .base import Runtime, TensorSpec

log = logging.getLogger(__name__)

CANN = "CANNExecutionProvider"
#: CANN execution provider options that config.pbtxt `parameters` may set.
CANN_OPTIONS = (
    "npu_mem_limit",
    "arena_extend_strategy",
    "enable_cann_graph",
    "precision_mode",
    "op_select_impl_mode",
)

_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def _spec(node: ort.NodeArg) -> TensorSpec:
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape)
    return TensorSpec(node.name, _DATATYPES.get(node.type, node.type), shape)


class OnnxRuntime(Runtime):
    name = "onnx"

    def __init__(self, path, device_id, config):
        super().__init__(path, device_id, config)
        self.providers = self._providers()
        options = ort.SessionOptions()
        threads = config.parameters.get("intra_op_thread_count")
        if threads:
            options.intra_op_num_threads = int(threads.string_value)
        try:
            self.session = ort.InferenceSession(str(path), options, providers=self.providers)
        except Exception as error:  # ORT raises its own exception types for corrupt files
            raise ModelLoadError(f"onnxruntime cannot load {path.name}: {error}") from None
        self._inputs = [_spec(n) for n in self.session.get_inputs()]
        self._outputs = [_spec(n) for n in self.session.get_outputs()]
        log.info("%s: %s on device %d with %s", config.name, path.name, device_id, self.session.get_providers()[0])

    def _providers(self) -> list:
        if CANN not in ort.get_available_providers():
            return ["CPUExecutionProvider"]
        options = {"device_id": str(self.device_id)}
        for key in CANN_OPTIONS:
            if key in self.config.parameters:
                options[key] = self.config.parameters[key].string_value
        return [(CANN, options), "CPUExecutionProvider"]

    @property
    def inputs(self) -> Sequence[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorSpec]:
        return self._outputs

    @property
    def info(self) -> Mapping[str, str]:
        return {**super().info, "execution_provider": self.session.get_providers()[0]}

    def run(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        return dict(zip(output_names, self.session.run(list(output_names), dict(inputs))))

    def close(self) -> None:
        self.session = None

"""The baseline: the bench's models as a KServe user writes them, with stock `kserve` only.

    python bench/stock_kserve.py --http_port 8080 --grpc_port 8081

A plain `kserve.Model` per model whose synchronous `predict` runs each request alone
(KServe calls a sync predict on its event loop, one request at a time): onnxruntime for
simple and yolov8n, a sleep of fixed + per-row milliseconds for sim (20 + 1) and fastsim
(1 + 0.1), like the `sim` runtime.
No tritonclient here: it cannot be imported beside kserve (kserve/kserve#3099).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kserve
import numpy as np
import onnxruntime as ort
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from kserve.utils.numpy_codec import from_np_dtype
from kserve.utils.utils import generate_uuid

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"


def response(model: kserve.Model, request: InferRequest, outputs: dict[str, np.ndarray]) -> InferResponse:
    # As KServe's custom-model docs write it: numpy data, which gRPC sends raw and REST as a JSON list.
    tensors = [
        InferOutput(name=name, shape=list(array.shape), datatype=from_np_dtype(array.dtype), data=array)
        for name, array in outputs.items()
    ]
    # Stock KServe answers 500 for a response without an id, so give one as KServe's examples do.
    return InferResponse(response_id=request.id or generate_uuid(), model_name=model.name, infer_outputs=tensors)


class OnnxModel(kserve.Model):
    def __init__(self, name: str, path: Path):
        super().__init__(name)
        self.path = path
        self.load()

    def load(self) -> bool:
        self.session = ort.InferenceSession(str(self.path))
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.ready = True
        return self.ready

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        feeds = {tensor.name: tensor.as_numpy() for tensor in payload.inputs}
        return response(self, payload, dict(zip(self.output_names, self.session.run(self.output_names, feeds))))


class SimModel(kserve.Model):
    """A device call of fixed + per-row milliseconds (the sim_fixed_ms and sim_per_item_ms of the
    model's config.pbtxt) that blocks, as a driver call does."""

    def __init__(self, name: str, fixed_ms: float, per_row_ms: float):
        super().__init__(name)
        self.fixed_ms, self.per_row_ms = fixed_ms, per_row_ms
        self.ready = True

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        data = payload.inputs[0].as_numpy()
        time.sleep((self.fixed_ms + self.per_row_ms * data.shape[0]) / 1000)
        return response(self, payload, {"OUTPUT0": data.copy()})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(parents=[kserve.model_server.parser])
    parser.parse_args()  # kserve reads --http_port, --grpc_port and the rest from sys.argv itself
    kserve.ModelServer().start([
        OnnxModel("simple", REPOSITORY / "simple" / "1" / "model.onnx"),
        OnnxModel("yolov8n", REPOSITORY / "yolov8n" / "1" / "model.onnx"),
        SimModel("sim", 20, 1),  # model_repository/sim
        SimModel("fastsim", 1, 0.1),  # bench/model_repository/fastsim
    ])

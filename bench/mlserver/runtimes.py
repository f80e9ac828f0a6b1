"""MLServer 1.7 peers of the bench's models: custom runtimes (`mlserver.MLModel`), as an MLServer user writes them.

- `Simple`: Triton's `simple`, OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1 (INT32 [16]).
- `Sim`: the `sim` runtime's device (`sim`, `fastsim`): a call that blocks for fixed + per-row
  milliseconds (the model settings' `parameters.extra`) and echoes INPUT0 as OUTPUT0. It blocks
  the inference worker, as a driver call does, so one batch runs at a time; MLServer's adaptive
  batching (`max_batch_size`, `max_batch_time`) forms the batches.

servers.py writes the model-settings.json files and starts `mlserver start` with this folder on
PYTHONPATH, in its own virtualenv (Makefile: MLSERVER_VENV).
"""

from __future__ import annotations

import time

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


def _arrays(payload: InferenceRequest) -> dict:
    return {tensor.name: NumpyCodec.decode_input(tensor) for tensor in payload.inputs}


class Simple(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        arrays = _arrays(payload)
        a, b = arrays["INPUT0"], arrays["INPUT1"]
        outputs = [NumpyCodec.encode_output("OUTPUT0", a + b), NumpyCodec.encode_output("OUTPUT1", a - b)]
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=outputs)


class Sim(MLModel):
    async def load(self) -> bool:
        extra = self.settings.parameters.extra or {}
        self.fixed_s = float(extra["sim_fixed_ms"]) / 1000
        self.per_row_s = float(extra["sim_per_item_ms"]) / 1000
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        data = _arrays(payload)["INPUT0"]
        time.sleep(self.fixed_s + self.per_row_s * data.shape[0])  # the device: blocks, one batch at a time
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=[NumpyCodec.encode_output("OUTPUT0", data.copy())])

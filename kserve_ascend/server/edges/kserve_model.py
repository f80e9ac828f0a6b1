"""The repository's models behind KServe's `Model` interface: KServe's own routes (its V1 protocol:
`/v1/models`, `/v1/models/{m}`, `POST /v1/models/{m}:predict`) and wherever KServe hands a model a request.

Like the OIP edges, every call goes through the data plane (the same checks, classification,
statistics and shutdown in one process and with `--workers N`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Optional

from starlette.exceptions import HTTPException

from ...core.datatypes import from_numpy
from ...core.errors import AscendError
from ...core.signature import Signature
from ..dataplane import DataPlane, InferRequest
from ..kserve_seam import kserve
from . import v1
from .status import http_status, unexpected

log = logging.getLogger(__name__)

KServeInferRequest = kserve.InferRequest
KServeInferResponse = kserve.InferResponse


class AscendModel(kserve.Model):
    """One model of the repository (all its served versions), as KServe's routes see it."""

    def __init__(self, name: str, dataplane: DataPlane):
        super().__init__(name)
        self.dataplane = dataplane

    def load(self) -> bool:
        """The data plane's lifecycle loads models, never KServe: nothing is loaded here (KServe calls this for a
        model that is not ready, whose request the data plane then refuses)."""
        return False

    async def healthy(self) -> bool:
        return not await self.dataplane.unready_reason(self.name)

    async def predict(
        self,
        payload: KServeInferRequest | Any,
        headers: Optional[Dict[str, str]] = None,
        response_headers: Optional[Dict[str, str]] = None,
    ) -> KServeInferResponse | dict:
        """A V2 `InferRequest` (KServe's type), or a V1 body: answered as the OIP routes answer, errors as
        `{"error": ...}` with the core error's status, else 500."""
        try:
            if isinstance(payload, KServeInferRequest):
                return await self._predict_v2(payload)
            return await self._predict_v1(payload)
        except AscendError as error:
            raise HTTPException(http_status(error), str(error)) from None
        except Exception as error:
            log.exception("predict of model '%s': unexpected error", self.name)
            raise HTTPException(500, unexpected(error)) from None

    async def _predict_v2(self, payload: KServeInferRequest) -> KServeInferResponse:
        request = InferRequest(
            self.name,
            {tensor.name: tensor.as_numpy() for tensor in payload.inputs},
            payload.model_version or "",
            payload.id or "",
            tuple(output.name for output in payload.request_outputs or ()),
            dict(payload.parameters or {}),
        )
        result = await self.dataplane.infer(request)
        with result.answering():
            outputs = []
            for name, array in result.outputs.items():
                output = kserve.InferOutput(name=name, shape=list(array.shape), datatype=from_numpy(array.dtype))
                output.set_data_from_numpy(array)
                outputs.append(output)
            return KServeInferResponse(
                response_id=payload.id or "", model_name=self.name, model_version=str(result.model_version), infer_outputs=outputs
            )

    async def _predict_v1(self, body: Any) -> dict:
        """A V1 body: columns in one request; rows stacked into one request when the model batches, else each
        row a request of its own (an image per detection request)."""
        layout, value, parameters = v1.parse(body)
        signature = Signature(await self.dataplane.model_config(self.name))
        # JSON lists <-> arrays cost milliseconds for an image (1.2 million numbers): off the event loop.
        if layout == "inputs":
            inputs = await asyncio.to_thread(v1.inputs, v1.named(value, signature, '"inputs"'), signature)
            return await self._infer(inputs, parameters, v1.columns)
        if signature.batching:
            inputs = await asyncio.to_thread(v1.rows, value, signature)
            return {"predictions": await self._infer(inputs, parameters, v1.predictions)}
        requests = [
            await asyncio.to_thread(v1.inputs, v1.named(row, signature, f"instance {i}"), signature) for i, row in enumerate(value)
        ]
        answers = await asyncio.gather(*(self._infer(inputs, parameters, v1.columns) for inputs in requests))
        return {"predictions": [answer["outputs"] for answer in answers]}

    async def _infer(self, inputs: dict, parameters: dict, answer) -> Any:
        """One request through the data plane, answered by `answer(outputs)` off the event loop."""
        result = await self.dataplane.infer(InferRequest(self.name, inputs, parameters=parameters))
        with result.answering():
            return await asyncio.to_thread(answer, result.outputs)


class ModelRegistry(kserve.ModelRepository):
    """KServe's model registry over the data plane: every repository model, as the data plane knows them now."""

    def __init__(self, dataplane: DataPlane):
        super().__init__()
        self.dataplane = dataplane

    def get_model(self, name: str) -> AscendModel | None:
        return AscendModel(name, self.dataplane) if name in self.dataplane.model_names() else None

    def get_models(self) -> dict[str, AscendModel]:
        return {name: AscendModel(name, self.dataplane) for name in self.dataplane.model_names()}

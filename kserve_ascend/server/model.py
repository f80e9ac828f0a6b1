"""Each repository model as a `kserve.Model`, registered in KServe's model registry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Dict, Optional

import kserve
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from starlette.exceptions import HTTPException

from . import v1
from ..core.datatypes import from_numpy
from ..core.errors import AscendError, ModelLoadError
from ..core.model import Model
from .errors import http_status, unexpected

if TYPE_CHECKING:
    from .dataplane import DataPlane

log = logging.getLogger(__name__)


class AscendModel(kserve.Model):
    """A model of the repository (all its served versions) behind KServe's Model interface.

    The OIP edges of this server call the core directly; `predict` serves KServe's own
    data plane: its V1 routes (`POST /v1/models/{m}:predict`, see `v1`) and wherever
    KServe hands the model an InferRequest. `dataplane`: the one-process server's, whose
    shutdown makes the model unready and refuses its requests as the OIP routes are refused
    (a frontend's model reaches the engine's data plane, which does that itself).
    """

    def __init__(self, model: Model, dataplane: DataPlane | None = None):
        self.model = model
        self.dataplane = dataplane
        super().__init__(model.name)

    @property
    def ready(self) -> bool:
        return self.model.ready and not (self.dataplane is not None and self.dataplane.stopping)

    @ready.setter
    def ready(self, value: bool) -> None:
        pass  # kserve.Model sets it; the core model's state is the one truth

    def load(self) -> bool:
        """Loads every served version (blocking); a broken model stays not ready, with its reason."""
        with contextlib.suppress(ModelLoadError):
            for replaced in self.model.load():
                replaced.close()
        return self.model.ready

    def stop(self) -> None:
        self.model.close()

    async def predict(
        self,
        payload: InferRequest,
        headers: Optional[Dict[str, str]] = None,
        response_headers: Optional[Dict[str, str]] = None,
    ) -> InferResponse:
        if not isinstance(payload, InferRequest):
            # Answered as the OIP routes answer: {"error": ...} with the core error's status, else 500.
            try:
                return await self._predict_v1(payload)
            except AscendError as error:
                raise HTTPException(http_status(error), str(error)) from None
            except Exception as error:
                log.exception("V1 predict of model '%s': unexpected error", self.name)
                raise HTTPException(500, unexpected(error)) from None
        self._check_accepting()
        served = self.model.version(payload.model_version)
        outputs = await served.infer({i.name: i.as_numpy() for i in payload.inputs})
        infer_outputs = []
        for name, array in outputs.items():
            output = InferOutput(name=name, shape=list(array.shape), datatype=from_numpy(array.dtype))
            output.set_data_from_numpy(array)
            infer_outputs.append(output)
        return InferResponse(
            response_id=payload.id or "",
            model_name=self.name,
            model_version=str(served.version),
            infer_outputs=infer_outputs,
        )

    def _check_accepting(self) -> None:
        if self.dataplane is not None:
            self.dataplane.check_accepting()

    async def _predict_v1(self, body: Any) -> dict:
        """A V1 body through the core: columns in one request; rows stacked into one request when the
        model batches, else each row a request of its own (an image per detection request)."""
        self._check_accepting()
        layout, value, parameters = v1.parse(body)
        served = self.model.version()
        signature = served.signature
        # JSON lists <-> arrays cost milliseconds for an image (1.2 million numbers): off the event loop.
        if layout == "inputs":
            inputs = await asyncio.to_thread(v1.inputs, v1.named(value, signature, '"inputs"'), signature)
            return await asyncio.to_thread(v1.columns, await served.infer(inputs, None, parameters))
        if signature.batching:
            outputs = await served.infer(await asyncio.to_thread(v1.rows, value, signature), None, parameters)
            return {"predictions": await asyncio.to_thread(v1.predictions, outputs)}
        requests = [
            await asyncio.to_thread(v1.inputs, v1.named(row, signature, f"instance {i}"), signature) for i, row in enumerate(value)
        ]
        answers = await asyncio.gather(*(served.infer(inputs, None, parameters) for inputs in requests))
        return {"predictions": await asyncio.to_thread(lambda: [v1.columns(outputs)["outputs"] for outputs in answers])}

"""Each repository model as a `kserve.Model`, registered in KServe's model registry."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import kserve
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from ..core.datatypes import from_numpy
from ..core.errors import ModelLoadError
from ..core.model import Model


class AscendModel(kserve.Model):
    """A model of the repository (all its served versions) behind KServe's Model interface.

    The OIP edges of this server call the core directly; `predict` serves KServe's own
    data plane, so the model also works wherever KServe hands it an InferRequest.
    """

    def __init__(self, model: Model):
        self.model = model
        super().__init__(model.name)

    @property
    def ready(self) -> bool:
        return self.model.ready

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
            # KServe's V1 routes hand over the raw body; this model speaks OIP v2 only.
            raise InvalidInput(f"model '{self.name}' takes Open Inference Protocol v2 requests: POST /v2/models/{self.name}/infer")
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

"""The one data plane behind both edges: REST and gRPC only translate to and from it."""

from __future__ import annotations

from typing import Any

from .. import __version__
from ..core.config import config_json
from ..core.model import Model, ModelVersion
from ..core.repository import Repository
from .codec import InferRequest
from .shm import SharedMemoryRegistry

SERVER_NAME = "kserve-ascend"
#: Protocol extensions this server implements in full (listed in server metadata).
EXTENSIONS = ["binary_tensor_data", "parameters", "model_configuration", "statistics", "system_shared_memory"]


class DataPlane:
    def __init__(self, repository: Repository):
        self.repository = repository
        self.loaded = False  # set once the start-up load of the repository has finished
        self.shm = SharedMemoryRegistry()  # the regions both edges read inputs from and write outputs to

    @staticmethod
    def metadata() -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}

    def ready(self) -> bool:
        return self.loaded and self.repository.ready

    def model(self, name: str) -> Model:
        return self.repository.get(name)

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether the model (version) serves; unknown models and versions raise ModelNotFound."""
        model = self.repository.get(name)
        if not model.ready:
            return False
        model.version(version)
        return True

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        served = self.repository.get(name).version(version)
        signature = served.signature

        def describe(tensors):
            return [{"name": t.name, "datatype": t.datatype, "shape": signature.shape(t)} for t in tensors.values()]

        return {
            "name": name,
            "versions": [str(v) for v in sorted(self.repository.get(name).versions)],
            "platform": served.config.platform or served.config.backend or "ascend",
            "inputs": describe(signature.inputs),
            "outputs": describe(signature.outputs),
            "parameters": dict(served.runtime_info),
        }

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The model's config as Triton's model configuration extension returns it (JSON)."""
        return config_json(self.repository.get(name).version(version).config)

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension: every served version, or those of one model (version)."""
        if name:
            model = self.repository.get(name)
            versions = [model.version(version)] if version else [model.versions[v] for v in sorted(model.versions)]
        else:
            versions = [m.versions[v] for m in self.repository.models.values() for v in sorted(m.versions)]
        return {"model_stats": [v.stats.as_dict(v.name, v.version) for v in versions]}

    def index(self) -> list[dict]:
        return self.repository.index()

    async def infer(self, name: str, version: str | None, request: InferRequest) -> tuple[ModelVersion, dict]:
        served = self.repository.get(name).version(version)
        outputs = await served.infer(request.inputs, list(request.outputs), request.parameters)
        return served, outputs


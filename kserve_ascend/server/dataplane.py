"""The one data plane behind both edges: REST and gRPC only translate to and from it.

Shutdown happens here too, so that both edges (and, with `--workers N`, the engine behind
every frontend) answer alike: once `stop_accepting` is called, readiness is false and a new
inference is refused with Unavailable (503 / UNAVAILABLE: a load balancer retries it on
another replica); `drain` waits for every request already accepted to be answered, and at
its deadline fails what is left, queued or executing, with Unavailable too.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Awaitable, Callable, TypeVar

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from .. import __version__
from ..core import classification
from ..core.config import config_json, parse_version
from ..core.errors import InvalidInput, ModelLoadError, ModelNotFound, ModelNotReady, Unavailable
from ..core.model import Model, ModelVersion
from ..core.repository import Repository
from ..core.stats import RequestTiming
from .codec import InferRequest
from .shm import SharedMemoryRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")

SERVER_NAME = "kserve-ascend"
#: Protocol extensions this server implements in full (listed in server metadata).
EXTENSIONS = [
    "binary_tensor_data", "parameters", "model_repository", "model_configuration", "statistics", "system_shared_memory",
    "classification", "sequence",
]
SHUTTING_DOWN = "the server is shutting down"


class DataPlane:
    def __init__(self, repository: Repository, explicit_control: bool = False):
        self.repository = repository
        self.explicit_control = explicit_control  # whether clients may load and unload models
        self.loaded = False  # set once the start-up load of the repository has finished
        self.stopping = False  # set once shutdown begins: not ready, no new inference accepted
        self.shm = SharedMemoryRegistry()  # the regions both edges read inputs from and write outputs to

    @staticmethod
    def metadata() -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}

    def ready(self) -> bool:
        return self.loaded and self.repository.ready and not self.stopping

    def model(self, name: str) -> Model:
        return self.repository.get(name)

    def unready_reason(self, name: str, version: str | None = None) -> str:
        """Why the model (version) does not serve, "" if it does.

        As Triton answers: an unknown model or version is not ready, not an error; a version
        string that is no number is (InvalidInput).
        """
        parse_version(version)
        model = self.repository.models.get(name)  # a name that is no directory is an unknown model
        if model is None:
            return f"Request for unknown model: '{name}' is not found"
        try:
            model.version(version)
        except (ModelNotFound, ModelNotReady) as error:
            return str(error)
        return SHUTTING_DOWN if self.stopping else ""

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
        return {"model_stats": [v.statistics() for v in versions]}

    def index(self) -> list[dict]:
        return self.repository.index()

    async def load_model(self, name: str, config_json: str | None = None) -> None:
        """The repository extension's load: (re)loads a model, from `config_json` instead of config.pbtxt if given.

        Every failure says "failed to load '<name>'", Triton's words, which its clients and
        examples match on; a model the client asked for that is broken is a 400, as in Triton.
        """
        self._check_explicit_control()
        try:
            await self.repository.load(name, _override(name, config_json))
        except ModelLoadError as error:
            raise InvalidInput(f"failed to load '{name}': {error}") from None
        except (InvalidInput, ModelNotFound) as error:
            raise type(error)(f"failed to load '{name}': {error}") from None

    async def unload_model(self, name: str) -> None:
        self._check_explicit_control()
        await self.repository.unload(name)

    def _check_explicit_control(self) -> None:
        if not self.explicit_control:
            raise InvalidInput("explicit model load / unload is not allowed: start the server with --model_control_mode explicit")

    async def infer(
        self,
        name: str,
        version: str | None,
        request: InferRequest,
        timing: RequestTiming,
        encode: Callable[..., T | Awaitable[T]],
    ) -> tuple[ModelVersion, T]:
        """Runs a decoded request and answers it: `encode(model_name, version, request, outputs)`, the edge's encoder
        (which may return an awaitable of the answer: one it encodes off the event loop).

        `timing`, started by the edge before decoding, goes into the version's statistics once the answer is encoded.
        """
        self.check_accepting()
        served = self.repository.get(name).version(version)
        outputs = await served.infer(request.inputs, request.outputs, request.parameters, timing)
        with timing.answering():  # compute_output: what is made of the outputs, then their encoding
            if request.classification:
                outputs = classification.classify(outputs, request.classification, served.labels, served.signature.batching)
            answer = encode(served.name, served.version, request, outputs)
            if inspect.isawaitable(answer):  # a large answer, encoded off the event loop (offload.off_loop)
                answer = await answer
            return served, answer

    # ------------------------------------------------------------ shutdown

    def check_accepting(self) -> None:
        """Unavailable once shutdown has begun: from then on no inference enters a queue.

        Called right before the request is queued, with no await in between, so a request
        is either refused here or counted by its scheduler, which `drain` waits for.
        """
        if self.stopping:
            raise Unavailable(f"{SHUTTING_DOWN}: it accepts no new request")

    def stop_accepting(self) -> None:
        """Shutdown begins: readiness false, new inferences refused (liveness stays true)."""
        self.stopping = True

    async def drain(self, timeout_s: float) -> None:
        """Waits until every request accepted has been answered, `timeout_s` at most; then fails what is
        left (queued or executing) with Unavailable, for the edges to answer it before they stop."""
        versions = [v for model in list(self.repository.models.values()) for v in list(model.versions.values())]
        waiting = sum(v.scheduler.outstanding for v in versions)
        if not waiting:
            return
        log.info("answering the %d requests accepted before shutdown (%g s at most)", waiting, timeout_s)
        try:
            await asyncio.wait_for(asyncio.gather(*(v.scheduler.drain() for v in versions)), max(timeout_s, 0))
        except TimeoutError:
            left = Unavailable(f"{SHUTTING_DOWN}: the request was not answered within the shutdown timeout")
            log.error("%d requests were not answered within the shutdown timeout: failing them",
                      sum(v.scheduler.outstanding for v in versions))
            for version in versions:
                version.abandon(left)

    def close(self) -> None:
        """Releases every model's devices (blocking; after `drain`, so nothing waits for them)."""
        for model in list(self.repository.models.values()):
            model.close()


def _override(name: str, config_json: str | None) -> mc.ModelConfig | None:
    """The config a load request gives in place of config.pbtxt, if any."""
    if config_json is None:
        return None
    try:
        override = json_format.Parse(config_json, mc.ModelConfig())
    except json_format.ParseError as error:
        raise InvalidInput(f"the 'config' parameter is not a ModelConfig in JSON: {error}") from None
    if override.name and override.name != name:
        raise InvalidInput(f"the 'config' parameter names the model '{override.name}', not '{name}'")
    return override

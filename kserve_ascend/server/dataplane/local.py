"""The data plane over the repository this process serves: the one-process server's, and the engine's.

Once shutdown begins (`stopping`), readiness is false and a new inference is refused with
Unavailable (503 / UNAVAILABLE: a load balancer retries it on another replica); the lifecycle
then waits for the requests already accepted (`lifecycle.Lifecycle`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from google.protobuf import json_format
from prometheus_client import CollectorRegistry, generate_latest
from tritonclient.grpc import model_config_pb2 as mc

from ... import __version__
from ...core import tracing
from ...core.config import normalized, parse_version
from ...core.contracts import RequestOptions, Responses, ServedVersion
from ...core.errors import InvalidInput, ModelLoadError, ModelNotFound, ModelNotReady, Unavailable, Unsupported
from ...core.models import classification
from ...core.models.repository import Repository
from ...core.stats import RequestTiming, now_ns
from ..observability import logs, traces
from . import DECOUPLED_REFUSED, EXTENSIONS, RAW_INPUT, SERVER_NAME, SHUTTING_DOWN, InferRequest
from .shm import SharedMemoryRegistry

log = logging.getLogger(__name__)


class Answer:
    """An inference's outputs; the request is recorded once its answer is made (`answering`)."""

    __slots__ = ("model_name", "model_version", "outputs", "timing")
    streamed = False

    def __init__(self, served: ServedVersion, outputs: dict, timing: RequestTiming):
        self.model_name, self.model_version, self.outputs, self.timing = served.name, served.version, outputs, timing

    def answering(self) -> Answer:
        return self

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, traceback) -> None:
        self.timing.answered(kind is None)


class Streamed:
    """A decoupled model's responses to one request (`ResponseStream`)."""

    __slots__ = ("model_name", "model_version", "_responses")
    streamed = True

    def __init__(self, served: ServedVersion, responses: Responses):
        self.model_name, self.model_version, self._responses = served.name, served.version, responses

    def __aiter__(self) -> Responses:
        return self._responses

    async def aclose(self) -> None:
        await self._responses.aclose()


class LocalDataPlane:
    """`DataPlane` over `repository`; `metrics_registry` is what `metrics` renders (the process's, or the engine's)."""

    def __init__(self, repository: Repository, explicit_control: bool, metrics_registry: CollectorRegistry,
                 trace_manager: traces.TraceManager | None = None):  # fmt: skip
        self.repository = repository
        self.traces = trace_manager or traces.TraceManager()
        self.explicit_control = explicit_control  # whether clients may load and unload models
        self.metrics_registry = metrics_registry
        self.loaded = False  # set once the start-up load of the repository has finished
        self.stopping = False
        self.regions = SharedMemoryRegistry()

    def model_names(self) -> list[str]:
        return list(self.repository.models)

    async def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    async def ready(self) -> bool:
        return self.loaded and self.repository.ready and not self.stopping

    async def unready_reason(self, name: str, version: str = "") -> str:
        parse_version(version)  # a version string that is no number is an error (InvalidInput), as in Triton
        model = self.repository.models.get(name)  # a name that is no directory is an unknown model
        if model is None:
            return f"Request for unknown model: '{name}' is not found"
        try:
            model.version(version)
        except (ModelNotFound, ModelNotReady) as error:
            return str(error)
        return SHUTTING_DOWN if self.stopping else ""

    async def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        model = self.repository.get(name)
        served = model.version(version)
        signature = served.signature

        def describe(tensors):
            return [{"name": t.name, "datatype": t.datatype, "shape": signature.shape(t)} for t in tensors.values()]

        return {
            "name": name,
            "versions": [str(v) for v in sorted(model.versions)],
            "platform": served.config.platform or served.config.backend or "ascend",
            "inputs": describe(signature.inputs),
            "outputs": describe(signature.outputs),
            "parameters": dict(served.runtime_info),
        }

    async def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return normalized(self.repository.get(name).version(version).config)

    async def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            model = self.repository.get(name)
            versions = [model.version(version)] if version else [model.versions[v] for v in sorted(model.versions)]
        else:
            versions = [m.versions[v] for m in self.repository.models.values() for v in sorted(m.versions)]
        return {"model_stats": [v.statistics() for v in versions]}

    async def repository_index(self) -> list[dict[str, Any]]:
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

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_explicit_control()
        await self.repository.unload(name, with_steps=unload_dependents)

    def _check_explicit_control(self) -> None:
        if not self.explicit_control:
            raise InvalidInput("explicit model load / unload is not allowed: start the server with --model_control_mode explicit")

    async def infer(self, request: InferRequest, streaming: bool = False) -> Answer | Streamed:
        """Runs a decoded request; its answer, for the edge to encode inside `answering()` (or a decoupled
        model's responses, `streaming`)."""
        if self.stopping:  # no await from here to the scheduler: a request is refused here or drained
            raise Unavailable(f"{SHUTTING_DOWN}: it accepts no new request")
        options = RequestOptions.parse(request.parameters)
        served, waited_ns = await self._served(request, options)
        if served.decoupled and not streaming:
            raise Unsupported(DECOUPLED_REFUSED)
        inputs = request.inputs
        if RAW_INPUT in inputs:
            inputs = served.signature.raw_input(inputs[RAW_INPUT], request.model_name)
        timing = RequestTiming(request.received_ns)
        timing.load_wait_ns = waited_ns
        if served.decoupled:
            return Streamed(served, served.stream(inputs, request.outputs, options, timing))
        if self.traces.active:
            timing.trace = self.traces.sample(request.model_name, request.id, request.protocol)
            if timing.trace is not None:
                timing.trace.inputs(served.version, inputs)
        try:
            outputs = await served.infer(inputs, request.outputs, options, timing)
        except BaseException:
            if timing.trace is not None:  # refused before it was queued: its trace ends here
                timing.trace.end(timing, now_ns())
            raise
        if timing.trace is not None:
            timing.trace.outputs(outputs)
        timing.answering()  # compute_output: what is made of the outputs, then their encoding at the edge
        if request.classification:
            try:
                outputs = classification.classify(outputs, request.classification, served.labels, served.signature.batching)
            except BaseException:
                timing.answered(False)
                raise
        return Answer(served, outputs, timing)

    async def _served(self, request: InferRequest, options: RequestOptions) -> tuple[ServedVersion, int]:
        """The version a request names, once its model is loaded (`--load_on_demand`: after waiting for its load,
        within the request's `timeout`); and the nanoseconds it waited."""
        repository = self.repository
        model = repository.get(request.model_name)
        waited_ns = 0
        if repository.load_on_demand and not model.ready:
            waited_ns = await self._wait_for_load(request, options)
        repository.touch(model.name)
        return model.version(request.model_version), waited_ns

    async def _wait_for_load(self, request: InferRequest, options: RequestOptions) -> int:
        """`--load_on_demand`: waits while the model loads, within the request's `timeout`; the nanoseconds it waited."""
        start = now_ns()
        deadline = None if options.timeout_us is None else (request.received_ns + options.timeout_us * 1000) / 1e9
        try:
            await self.repository.wait_until_loaded(request.model_name, deadline)
        finally:
            waited = now_ns() - start
            self.repository.record_wait(request.model_name, waited / 1e9)
        return waited

    async def shm_status(self, name: str = "") -> list[dict[str, Any]]:
        return self.regions.status(name)

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.regions.register(name, key, offset, byte_size)

    async def shm_unregister(self, name: str = "") -> None:
        self.regions.unregister(name)

    async def metrics(self) -> bytes:
        # Off the loop: a scrape may wait on the NPU driver (npu_telemetry's DCMI calls).
        return await asyncio.to_thread(generate_latest, self.metrics_registry)

    async def trace_settings(self, model: str = "", changes: dict[str, Any] | None = None) -> dict[str, Any]:
        if model and not getattr(self.repository.models.get(model), "ready", False):
            raise InvalidInput(f"Request for unknown model : {model}")  # Triton's words, for one not ready too
        if not changes:
            return self.traces.answer(model)
        answer = self.traces.update(model, changes)
        if self.traces.mode == "opentelemetry":
            tracing.enabled = self.traces.spans_on  # this process's spans (a frontend's: the engine tells it)
        return answer

    async def log_settings(self, changes: dict[str, Any] | None = None) -> dict[str, Any]:
        if changes:
            logs.apply(logs.checked(changes))
        return logs.settings()

    def close(self) -> None:
        """Unmaps the regions clients left registered; writes the traces collected."""
        self.regions.close()
        self.traces.close()


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

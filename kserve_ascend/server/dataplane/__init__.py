"""The data plane: what every edge (REST, gRPC, KServe's V1 routes and `predict`) asks of the server, declared once.

In one process the edges hold a `local.LocalDataPlane` over the repository; a frontend of
`--workers N` holds a `workers.remote.RemoteDataPlane`, which forwards the same calls to the
engine and never blocks its event loop. Every call is awaited, whichever it is.

An inference is one call and one step after it: `infer` answers with the outputs, and the edge
makes its answer of them inside `InferResult.answering()`, which then records the request (its
statistics include the encoding). A decoupled model answers, on the routes that can carry them,
with its stream of responses instead (`ResponseStream`). Nothing climbs back up from the data
plane into an edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ClassVar, ContextManager, Mapping, Protocol, runtime_checkable

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ...core.stats import now_ns

SERVER_NAME = "kserve-ascend"
#: Protocol extensions this server implements in full (listed in server metadata).
#: In Triton 2.51's order, which declares cuda_shared_memory too (after system_shared_memory).
EXTENSIONS = (
    "classification", "sequence", "model_repository", "model_repository(unload_dependents)", "schedule_policy",
    "model_configuration", "system_shared_memory", "binary_tensor_data", "parameters", "statistics", "trace", "logging",
)
SHUTTING_DOWN = "the server is shutting down"
#: Triton's refusal of a decoupled model on a route that answers once, after the route's name ("HTTP end point",
#: "ModelInfer RPC": server src/http_server.cc, src/grpc/infer_handler.cc).
DECOUPLED_REFUSED = "doesn't support models with decoupled transaction policy"
#: The one input of a raw binary request, by this name: its body's bytes (uint8), which the data plane
#: shapes as the model's single input (`Signature.raw_input`), where the model is known.
RAW_INPUT = ""


@dataclass(slots=True)
class InferRequest:
    """A decoded inference request, the same whichever edge it came in by."""

    model_name: str
    inputs: dict[str, np.ndarray]
    #: The version the request names ("": the model's choice).
    model_version: str = ""
    id: str = ""
    #: The outputs asked for (empty: all of them), in the order asked.
    outputs: tuple[str, ...] = ()
    parameters: dict[str, Any] = field(default_factory=dict)
    #: Outputs to answer as their top classes (the classification extension): name -> how many.
    classification: dict[str, int] = field(default_factory=dict)
    #: When the server began working on it (its body in, before decoding): its statistics start here.
    received_ns: int = field(default_factory=now_ns)
    #: The protocol it came by, as Triton's traces name it: HTTP or GRPC.
    protocol: str = "HTTP"


@runtime_checkable
class InferResult(Protocol):
    """The answer of an inference, for the edge to encode inside `answering()`."""

    #: False: what tells it from a `ResponseStream` (one attribute read, where an isinstance of a protocol takes µs).
    streamed: ClassVar[bool]
    model_name: str
    model_version: int
    outputs: Mapping[str, np.ndarray]

    def answering(self) -> ContextManager[None]:
        """Wraps making the answer: on leaving, the request is recorded, a success unless the block raised."""


class ResponseStream(Protocol):
    """A decoupled model's answer to one request (`DataPlane.infer` with `streaming`): each response's outputs as
    the model produces them; the end of the iteration is the final flag. An error of the model raises from the
    iteration (the request is answered). The request is recorded in the statistics when the iteration ends."""

    streamed: ClassVar[bool]  # True
    model_name: str
    model_version: int

    def __aiter__(self) -> AsyncIterator[Mapping[str, np.ndarray]]: ...

    async def aclose(self) -> None:
        """Stops the model producing (the client cancelled the stream); safe after the end too."""


class RegionViews(Protocol):
    """The system shared memory regions clients registered, mapped in this process (never blocks)."""

    def view(self, name: str, offset: int, byte_size: int, what: str) -> memoryview:
        """The bytes at `offset` of region `name`; InvalidInput names what is wrong."""

    def locate(self, array: np.ndarray) -> tuple[str, int] | None:
        """The region and offset an array lies in, if it is a view of one."""


@runtime_checkable
class DataPlane(Protocol):
    """What the edges ask of the server."""

    #: Shutdown has begun: not ready, new inferences refused (the REST edge closes connections it answers).
    stopping: bool
    #: The regions inputs are read from and outputs written to, in this process.
    regions: RegionViews

    def model_names(self) -> list[str]:
        """The models of the repository as this process knows them now (never blocks): KServe's registry lists them."""

    async def server_metadata(self) -> dict[str, Any]: ...

    async def ready(self) -> bool:
        """Whether every model meant to serve is ready, and the server is not shutting down."""

    async def unready_reason(self, name: str, version: str = "") -> str:
        """Why the model (version) does not serve, "" if it does; as Triton, an unknown model is not ready, not an error."""

    async def model_metadata(self, name: str, version: str = "") -> dict[str, Any]: ...

    async def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        """The version's config with the defaults Triton fills in (the model configuration extension)."""

    async def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's statistics extension: every served version, or those of one model (version)."""

    async def repository_index(self) -> list[dict[str, Any]]: ...

    async def load_model(self, name: str, config_json: str | None = None) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """The repository extension's unload; `unload_dependents`: also the step models loaded along with it."""

    async def infer(self, request: InferRequest, streaming: bool = False) -> InferResult | ResponseStream:
        """The answer to `request`; a decoupled model's is its stream of responses where the route can carry one
        (`streaming`), else Unsupported(DECOUPLED_REFUSED). A malformed request raises here, before any response."""

    async def shm_status(self, name: str = "") -> list[dict[str, Any]]: ...

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None: ...

    async def shm_unregister(self, name: str = "") -> None: ...

    async def metrics(self) -> bytes:
        """The server's Prometheus metrics, in the text exposition format."""

    async def trace_settings(self, model: str = "", changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """The trace extension: applies a client's `changes` to the global setting (`model` "") or a model's, then
        answers the setting now (Triton's names; values are strings, the level a list)."""

    async def log_settings(self, changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """The logging extension: applies a client's `changes` (Triton's names and types) in every process of the
        server, then answers the settings now."""


__all__ = [
    "DECOUPLED_REFUSED", "DataPlane", "EXTENSIONS", "InferRequest", "InferResult", "RAW_INPUT", "RegionViews", "ResponseStream",
    "SERVER_NAME", "SHUTTING_DOWN",
]

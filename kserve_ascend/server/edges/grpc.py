"""The OIP v2 gRPC edge: Triton's GRPCInferenceService (the proto tritonclient ships)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf import json_format
from grpc import aio
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from ...core import tracing
from ...core.errors import AscendError, InvalidInput, Unsupported
from ...core.stats import now_ns
from ..dataplane import DataPlane, ResponseStream
from ..dataplane.shm import CUDA_SHM_UNSUPPORTED
from ..observability import logs
from .codec import decode_grpc, encode_grpc
from .offload import OFF_LOOP_BYTES, decode_grpc_off_loop, grpc_typed_bytes
from .status import grpc_code, logged, unexpected

log = logging.getLogger(__name__)


def _header(context: aio.ServicerContext, key: str) -> str | None:
    return next((value for name, value in context.invocation_metadata() or () if name == key), None)


def _trace_carrier(context: aio.ServicerContext) -> dict[str, str] | None:
    """The call's metadata, where a client's `traceparent` travels; read only while tracing."""
    return dict(context.invocation_metadata() or ()) if tracing.enabled else None


def _answers_errors(rpc):
    """Aborts the call with the code of a core error, or INTERNAL for any other error (logged with
    its traceback); the server goes on serving.

    Also starts the call's log context, named by its `x-request-id` metadata if it has one.
    A call its client cancels (or whose deadline passes) is cancelled here too: grpc.aio cancels the
    task running it (grpc's aio/server.pyx.pxi, `_handle_cancellation_from_core`), which takes its
    request out of the queue.
    """

    @functools.wraps(rpc)
    async def wrapper(self, request, context: aio.ServicerContext):
        logs.begin_request(_header(context, "x-request-id"))
        if logs.verbose:
            log.debug("gRPC request: %s", rpc.__name__)
        try:
            return await rpc(self, request, context)
        except asyncio.CancelledError:
            log.info("%s: cancelled (by its client, its deadline or the server stopping)", rpc.__name__)
            raise
        except AscendError as error:
            code = grpc_code(error)
            (log.error if code is grpc.StatusCode.INTERNAL else log.info)("%s: %s", rpc.__name__, error)
            await context.abort(code, str(error))
        except aio.AbortError:
            raise  # the call was already ended with its status
        except Exception as error:
            log.exception("%s: unexpected error", rpc.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, unexpected(error))

    return wrapper


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    @_answers_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @_answers_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=await self.dataplane.ready())

    @_answers_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**await self.dataplane.server_metadata())

    @_answers_errors
    async def ModelReady(self, request, context):
        # Triton's answer: `ready: false` for an unknown model or version too, not an error.
        return pb.ModelReadyResponse(ready=not await self.dataplane.unready_reason(request.name, request.version))

    @_answers_errors
    async def ModelMetadata(self, request, context):
        metadata = await self.dataplane.model_metadata(request.name, request.version)
        tensors = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=metadata["name"],
            versions=metadata["versions"],
            platform=metadata["platform"],
            inputs=[tensors(**t) for t in metadata["inputs"]],
            outputs=[tensors(**t) for t in metadata["outputs"]],
        )

    @_answers_errors
    async def ModelConfig(self, request, context):
        return pb.ModelConfigResponse(config=await self.dataplane.model_config(request.name, request.version))

    @_answers_errors
    async def ModelStatistics(self, request, context):
        statistics = await self.dataplane.statistics(request.name, request.version)
        return json_format.ParseDict(statistics, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)  # batch_padding_rows: REST only

    @_answers_errors
    async def RepositoryIndex(self, request, context):
        index = await self.dataplane.repository_index()
        if request.ready:
            index = [entry for entry in index if entry["state"] == "READY"]
        fields = ("name", "version", "state", "reason")  # Triton's ModelIndex has no digest
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**{k: e[k] for k in fields if k in e}) for e in index]
        )

    @_answers_errors
    async def RepositoryModelLoad(self, request, context):
        parameters = request.parameters
        if any(key.startswith("file:") for key in parameters):
            raise InvalidInput("file overrides ('file:<path>' parameters) are not supported: put the file in the repository")
        config = parameters["config"].string_param if "config" in parameters else None
        await self.dataplane.load_model(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @_answers_errors
    async def RepositoryModelUnload(self, request, context):
        await self.dataplane.unload_model(request.model_name, _bool_parameter(request.parameters, "unload_dependents"))
        return pb.RepositoryModelUnloadResponse()

    @_answers_errors
    async def ModelInfer(self, request, context):
        try:
            return await self._infer(request, context)
        except Unsupported as error:  # a decoupled model, as Triton words it
            raise Unsupported(f"ModelInfer RPC {error}") from None

    async def _infer(self, request: pb.ModelInferRequest, context: aio.ServicerContext, decoupled=None) -> pb.ModelInferResponse | None:
        """The request's answer; for a decoupled model, what `decoupled(decoded, answer, stream)` does with its
        stream of responses (in the request's span), or Unsupported where the route answers once (no `decoupled`)."""
        if request.id:
            logs.begin_request(request.id)  # the OIP id names the request ahead of the metadata
        with tracing.infer_span(request.model_name, _trace_carrier(context), logs.request_id) as span:
            received = now_ns()  # the server's work on the request starts once its message is in
            if grpc_typed_bytes(request) > OFF_LOOP_BYTES:
                decoded, answer = await decode_grpc_off_loop(request, self.dataplane.regions, received)
            else:
                decoded, answer = decode_grpc(request, self.dataplane.regions, received)
            result = await self.dataplane.infer(decoded, streaming=decoupled is not None)
            if result.streamed:
                return await decoupled(decoded, answer, result)
            with result.answering():
                response = encode_grpc(result.model_name, result.model_version, decoded.id, result.outputs, answer)
            if span is not None:
                span.set_attribute(tracing.MODEL_VERSION, result.model_version)
            return response

    @_answers_errors
    async def SystemSharedMemoryStatus(self, request, context):
        regions = await self.dataplane.shm_status(request.name)
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(regions={r["name"]: status(**r) for r in regions})

    @_answers_errors
    async def SystemSharedMemoryRegister(self, request, context):
        await self.dataplane.shm_register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_answers_errors
    async def SystemSharedMemoryUnregister(self, request, context):
        await self.dataplane.shm_unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_answers_errors
    async def CudaSharedMemoryStatus(self, request, context):
        if request.name:
            raise InvalidInput(f"Unable to find cuda shared memory region: '{request.name}'")
        return pb.CudaSharedMemoryStatusResponse()

    @_answers_errors
    async def CudaSharedMemoryRegister(self, request, context):
        raise InvalidInput(CUDA_SHM_UNSUPPORTED)

    @_answers_errors
    async def CudaSharedMemoryUnregister(self, request, context):
        return pb.CudaSharedMemoryUnregisterResponse()  # no CUDA region can be registered

    @_answers_errors
    async def LogSettings(self, request, context):
        changes = {name: getattr(value, value.WhichOneof("parameter_choice") or "", None) for name, value in request.settings.items()}
        settings = await self.dataplane.log_settings(changes or None)
        value = pb.LogSettingsResponse.SettingValue
        return pb.LogSettingsResponse(settings={name: value(**{_LOG_PARAMETER[type(v)]: v}) for name, v in settings.items()})

    @_answers_errors
    async def TraceSetting(self, request, context):
        # An empty value clears a setting (a model's, back to the global one), as JSON's null does over REST.
        changes = {
            name: None if not value.value else list(value.value) if name == "trace_level" or len(value.value) > 1 else value.value[0]
            for name, value in request.settings.items()
        }  # fmt: skip
        settings = await self.dataplane.trace_settings(request.model_name, changes or None)
        value = pb.TraceSettingResponse.SettingValue
        return pb.TraceSettingResponse(settings={name: value(value=v if isinstance(v, list) else [v]) for name, v in settings.items()})

    async def ModelStreamInfer(self, request_iterator, context):
        """The requests of a stream run concurrently, as in Triton, each answered when its result is
        ready (clients match responses by id); the requests of one sequence run in stream order.
        An error travels in its request's response and the stream goes on."""
        stream_id = _header(context, "x-request-id")
        responses: asyncio.Queue = asyncio.Queue()
        answering: set[asyncio.Task] = set()
        latest: dict = {}  # sequence id -> the task answering its latest request

        async def answer(request: pb.ModelInferRequest, after: asyncio.Task | None) -> None:
            if after is not None:
                await asyncio.wait((after,))  # the sequence's previous request first
            logs.begin_request(stream_id)
            await self._stream_answer(request, context, responses.put_nowait)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    sequence = _sequence_id(request)
                    task = asyncio.create_task(answer(request, latest.get(sequence)))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
                    if sequence is not None:
                        latest[sequence] = task
                        task.add_done_callback(lambda done, key=sequence: latest.get(key) is done and latest.pop(key))
                if answering:
                    await asyncio.wait(answering)
            finally:
                responses.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await responses.get()) is not None:
                yield response
        finally:  # the stream ended: also when the client went away, whose answers nobody reads
            reader.cancel()
            for task in answering:
                task.cancel()

    async def _stream_answer(self, request: pb.ModelInferRequest, context, send: Callable[[pb.ModelStreamInferResponse], None]) -> None:
        """`send`s a request's responses on the stream, each marked `triton_final_response` as Triton marks them
        (server src/grpc/stream_infer_handler.cc): an ordinary model's one answer is final; a decoupled
        model's are not, and the final flag that follows them alone is a response of its own only when the
        request asks for it (`triton_enable_empty_final_response`). An error is a response with
        `error_message` naming the request; one the model raised after it accepted the request is final.
        Cancelling this (the client went away) stops a decoupled model."""
        try:
            empty_final = _bool_parameter(request.parameters, EMPTY_FINAL_RESPONSE)
            response = await self._infer(
                request, context, lambda decoded, answer, stream: self._stream_decoupled(decoded, answer, stream, empty_final, send)
            )
        except Exception as error:
            return send(_stream_error(error, pb.ModelInferResponse(id=request.id)))
        if response is not None:  # an ordinary model's one answer
            response.parameters[FINAL_RESPONSE].bool_param = True
            send(pb.ModelStreamInferResponse(infer_response=response))

    async def _stream_decoupled(self, decoded, answer, stream: ResponseStream, empty_final: bool, send) -> None:
        """A decoupled model's responses, each `send` as it comes."""
        final = pb.ModelInferResponse(id=decoded.id, model_name=stream.model_name)
        final.parameters[FINAL_RESPONSE].bool_param = True
        try:
            async for outputs in stream:
                response = encode_grpc(stream.model_name, stream.model_version, decoded.id, outputs, answer)
                response.parameters[FINAL_RESPONSE].bool_param = False
                send(pb.ModelStreamInferResponse(infer_response=response))
        except Exception as error:
            return send(_stream_error(error, final))
        finally:
            await stream.aclose()
        if empty_final:
            send(pb.ModelStreamInferResponse(infer_response=final))


def _stream_error(error: Exception, response: pb.ModelInferResponse) -> pb.ModelStreamInferResponse:
    """An error as a stream's response (logged)."""
    return pb.ModelStreamInferResponse(error_message=logged(log, "ModelStreamInfer", error), infer_response=response)


#: The parameter that marks a streamed response final, and the request parameter that asks for a final flag
#: sent alone to come as an empty response (Triton's names, server src/grpc/stream_infer_handler.cc).
FINAL_RESPONSE = "triton_final_response"
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


def _bool_parameter(parameters, name: str) -> bool:
    """A boolean request parameter (an inference's or a repository call's), False when absent; another type is
    refused in Triton's words."""
    if name not in parameters:
        return False
    parameter = parameters[name]
    if parameter.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidInput(f"invalid value type for '{name}' parameter, expected bool_param.")
    return parameter.bool_param


#: A log setting's Python type -> the field of its gRPC SettingValue.
_LOG_PARAMETER = {bool: "bool_param", int: "uint32_param", str: "string_param"}


def _sequence_id(request: pb.ModelInferRequest):
    """The request's `sequence_id` parameter (a number or a string), None outside a sequence."""
    if "sequence_id" not in request.parameters:
        return None
    parameter = request.parameters["sequence_id"]
    return getattr(parameter, parameter.WhichOneof("parameter_choice") or "int64_param") or None


class CertificateFiles:
    """The gRPC port's TLS key and certificate chain, read again when the files change.

    KServe's REST server reloads the same files on change (cert-manager and Kubernetes
    rotate them in place); gRPC asks `fetch` before every TLS handshake, which costs two
    `stat` calls per new connection, none per request.
    """

    def __init__(self, certfile: str, keyfile: str):
        self.paths = (Path(certfile), Path(keyfile))
        self._stamp = None
        self._initial = self._read()  # OSError if either is unreadable: the server does not start

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._initial, self.fetch)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A configuration from the files if they changed since last read, else None (keep the current one)."""
        try:
            if self._stamps() == self._stamp:
                return None
            log.info("reloading the gRPC TLS certificate from %s", self.paths[0])
            return self._read()
        except OSError as error:  # in the middle of a rotation: serve the pair read before
            log.warning("cannot read the gRPC TLS certificate: %s", error)
            return None

    def _stamps(self) -> tuple:
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(os.stat, self.paths))

    def _read(self) -> grpc.ServerCertificateConfiguration:
        stamp = self._stamps()
        certificate, key = (path.read_bytes() for path in self.paths)
        self._stamp = stamp
        return grpc.ssl_server_certificate_configuration([(key, certificate)])


class GrpcServer:
    """A grpc.aio server on the event loop the REST server shares, so both feed one batcher.

    With `credentials` the port speaks TLS only; `interceptors` see every call first.
    """

    def __init__(
        self,
        port: int,
        dataplane: DataPlane,
        options: list[tuple[str, int]],
        credentials: grpc.ServerCredentials | None = None,
        interceptors: list[aio.ServerInterceptor] | None = None,
    ):
        self.port = port
        self.dataplane = dataplane
        self.options = options
        self.credentials = credentials
        self.interceptors = interceptors or []
        self._server: aio.Server | None = None

    async def start(self) -> None:
        """Serves until stopped."""
        # Created here: a grpc.aio server belongs to the loop that is running when it is made.
        self._server = aio.server(options=self.options, interceptors=self.interceptors)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.dataplane), self._server)
        address = f"[::]:{self.port}"
        if self.credentials is None:
            self._server.add_insecure_port(address)
        else:
            self._server.add_secure_port(address, self.credentials)
        await self._server.start()
        log.info("gRPC server listening on port %d%s", self.port, " (TLS)" if self.credentials else "")
        await self._server.wait_for_termination()

    async def stop(self, grace: float) -> None:
        """Stops accepting; calls in flight get `grace` seconds, then are cancelled."""
        if self._server is not None:
            await self._server.stop(grace=grace)

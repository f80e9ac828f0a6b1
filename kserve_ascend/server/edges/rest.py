"""The OIP v2 REST edge: a plain ASGI application that translates HTTP to the data plane and back.

The OIP routes (and /metrics) are dispatched on the path by a dictionary and one regular
expression, and answered with two ASGI messages: no framework request, response or router
objects on a request's way, whose cost is most of a small request's handling. The body is
decoded once by the codec and the answer encoded straight to bytes with orjson. Every other
path goes to KServe's own app (its V1 routes, docs), behind the body limit as before.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prometheus_client import CONTENT_TYPE_LATEST

from ...core import tracing
from ...core.config import config_json
from ...core.errors import AscendError, InvalidInput, ModelNotFound, Unsupported
from ...core.stats import now_ns
from ..dataplane import DataPlane
from ..dataplane.shm import CUDA_SHM_UNSUPPORTED
from ..observability import logs
from . import compression, generate
from .auth import Authenticator, RestAuthentication
from .codec import decode_rest, json_object
from .offload import OFF_LOOP_BYTES, decode_rest_off_loop, encode_rest_off_loop, rest_json_bytes
from .status import http_status, unexpected

log = logging.getLogger(__name__)

#: Triton's default for `--http-max-input-size`: 64 MiB.
DEFAULT_MAX_INPUT_SIZE = 64 * 2**20

#: An answer: status, body, headers (ASGI's raw pairs, content-type first); a body of Server-Sent Events
#: (`generate.Events`) is sent event by event.
Answer = tuple[int, "bytes | generate.Events", list]
#: An OIP endpoint: answers one call.
Endpoint = Callable[["Call"], Awaitable[Answer]]

_JSON = [(b"content-type", b"application/json")]
_EMPTY: Answer = (200, b"", [])


def _json(content, status: int = 200) -> Answer:
    return status, orjson.dumps(content), _JSON


def _error(message: str, status: int, headers: dict | None = None) -> Answer:
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    return status, orjson.dumps({"error": message}), _JSON + extra


async def _send(send: Send, answer: Answer) -> None:
    status, body, headers = answer
    await send({"type": "http.response.start", "status": status, "headers": [*headers, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def _send_events(send: Send, call: Call, answer: Answer) -> None:
    """Server-Sent Events, each as it comes; a client that goes away stops the model that produces them."""
    status, events, headers = answer
    watch = call.cancel_if_client_leaves(asyncio.get_running_loop())
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        async for chunk in events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    except asyncio.CancelledError:
        if not call.client_left:
            raise
        asyncio.current_task().uncancel()
        log.info("%s %s: the client went away: its stream is cancelled", call.scope["method"], call.scope["path"])
    finally:
        watch.cancel()
        await events.aclose()


async def _repository_parameters(call: Call) -> dict:
    """The `parameters` object of a repository load or unload body ({} without one)."""
    body = await call.body()
    parameters = (json_object(body) if body else {}).get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object")
    return parameters


async def _setting_changes(call: Call) -> dict | None:
    """The changes a POST to a settings endpoint (trace, logging) asks for; None for a GET or an empty body."""
    body = await call.body() if call.scope["method"] == "POST" else b""
    return json_object(body) if body else None


class Call:
    """One OIP request on its way: what the endpoints read of it, taken from the headers in one pass.

    `name` and `version` are the path's: the model's (or the shared memory region's) name, and the
    version a model path names ("" where it names none).
    """

    __slots__ = ("scope", "receive", "name", "version", "request_id", "header_length", "content_length",
                 "content_encoding", "accept_encoding", "client_left")

    def __init__(self, scope: Scope, receive: Receive, name: str, version: str):
        self.scope, self.receive, self.name, self.version = scope, receive, name, version
        self.request_id = self.header_length = self.content_length = self.content_encoding = self.accept_encoding = None
        self.client_left = False  # set when the client went away while its request was served: its task is cancelled
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                self.request_id = value.decode("latin-1")
            elif key == b"inference-header-content-length":
                self.header_length = value.decode("latin-1")
            elif key == b"content-length":
                self.content_length = value
            elif key == b"content-encoding":
                self.content_encoding = value.decode("latin-1")
            elif key == b"accept-encoding":
                self.accept_encoding = value.decode("latin-1")

    async def body(self) -> bytes:
        """The whole body (its size held to the limit by `OipApplication`); ClientDisconnect if the client left."""
        chunks = []
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def cancel_if_client_leaves(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task:
        """Cancels the task serving this call if its client goes away (from now on: the body is read), which takes
        its request out of the queue; cancel the watch returned once the answer is made.

        The server learns of it from ASGI's `http.disconnect`, which `receive` returns once the body is
        read only when the connection is lost (uvicorn's RequestResponseCycle.receive).
        """
        return loop.create_task(self._cancel_when_disconnected(asyncio.current_task(loop)))

    async def _cancel_when_disconnected(self, serving: asyncio.Task) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.client_left = True
        serving.cancel()

    def headers(self) -> dict[str, str]:
        """Every header by name (the last of repeated ones): the carrier of a client's trace context."""
        return {k.decode("latin-1"): v.decode("latin-1") for k, v in self.scope["headers"]}


class RestEndpoints:
    def __init__(self, dataplane: DataPlane, max_input_size: int = DEFAULT_MAX_INPUT_SIZE):
        self.dataplane = dataplane
        self.max_input_size = max_input_size
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, once it serves

    async def server_metadata(self, call: Call) -> Answer:
        return _json(await self.dataplane.server_metadata())

    async def live(self, call: Call) -> Answer:
        return _json({"live": True})

    async def ready(self, call: Call) -> Answer:
        # OIP: 200 means ready, 4xx means not ready.
        ready = await self.dataplane.ready()
        return _json({"ready": ready}, 200 if ready else 400)

    async def model_metadata(self, call: Call) -> Answer:
        return _json(await self.dataplane.model_metadata(call.name, call.version))

    async def model_ready(self, call: Call) -> Answer:
        unready = await self.dataplane.unready_reason(call.name, call.version)
        if unready:
            # Triton's status and words, for an unknown model or version as for one not loaded (OIP: 4xx is false).
            return _error(f"Model version not ready: {unready}", 400)
        return _json({"name": call.name, "ready": True})

    async def model_config(self, call: Call) -> Answer:
        return _json(config_json(await self.dataplane.model_config(call.name, call.version)))

    async def statistics(self, call: Call) -> Answer:
        return _json(await self.dataplane.statistics(call.name, call.version))

    async def repository_index(self, call: Call) -> Answer:
        return _json(await self.dataplane.repository_index())

    async def load_model(self, call: Call) -> Answer:
        parameters = await _repository_parameters(call)
        if any(key.startswith("file:") for key in parameters):
            raise InvalidInput("file overrides ('file:<path>' parameters) are not supported: put the file in the repository")
        config = parameters.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidInput("the 'config' parameter must be a string holding the ModelConfig as JSON")
        await self.dataplane.load_model(call.name, config)
        return _EMPTY

    async def unload_model(self, call: Call) -> Answer:
        unload_dependents = (await _repository_parameters(call)).get("unload_dependents", False)
        if not isinstance(unload_dependents, bool):  # Triton's words; its 2.51 then unloads anyway (deviations.yaml)
            raise InvalidInput("Unable to parse 'unload_dependents': attempt to access JSON non-boolean as boolean")
        await self.dataplane.unload_model(call.name, unload_dependents)
        return _EMPTY

    async def infer(self, call: Call) -> Answer:
        """Inference, with Triton's compression of the request body and of a successful answer."""
        if call.content_encoding is not None:
            call.receive = compression.decoding(call.receive, call.content_encoding, self.max_input_size)
        span_context = tracing.infer_span(call.name, call.headers() if tracing.enabled else None, logs.request_id)
        with span_context as span:
            body = await call.body()
            received = now_ns()  # the server's work on the request starts once its body is in
            regions = self.dataplane.regions
            if rest_json_bytes(body, call.header_length) > OFF_LOOP_BYTES:
                request, answer = await decode_rest_off_loop(body, call.header_length, regions, call.name, call.version, received)
            else:
                request, answer = decode_rest(body, call.header_length, regions, call.name, call.version, received)
            if request.id:
                logs.begin_request(request.id)  # the OIP id names the request ahead of the header
            loop = self._loop
            if loop is None:  # once: on CPython 3.11 each get_running_loop() is a getpid() system call
                self._loop = loop = asyncio.get_running_loop()
            watch = call.cancel_if_client_leaves(loop)
            try:
                result = await self.dataplane.infer(request)
            except Unsupported as error:  # a decoupled model, as Triton words it
                raise Unsupported(f"HTTP end point {error}") from None
            finally:
                watch.cancel()
            with result.answering():
                body, header_length = await encode_rest_off_loop(
                    result.model_name, result.model_version, request.id, result.outputs, answer
                )
            if span is not None:
                span.set_attribute(tracing.MODEL_VERSION, result.model_version)
        if header_length is None:
            headers = _JSON
        else:
            headers = [(b"content-type", b"application/octet-stream"), (b"inference-header-content-length", b"%d" % header_length)]
        if call.accept_encoding is not None:
            coding = compression.response_coding(call.accept_encoding)
            if coding != "identity":
                body = await compression.compressed(body, coding)
                headers = [*headers, (b"content-encoding", coding.encode())]
        return 200, body, headers

    async def trace_settings(self, call: Call) -> Answer:
        """The trace extension, for the server (`/v2/trace/setting`) or a model (`/v2/models/{m}/trace/setting`)."""
        if call.version:
            raise ModelNotFound("Not Found")  # a setting is a model's, of no version: Triton has no such route
        return _json(await self.dataplane.trace_settings(call.name, await _setting_changes(call)))

    async def log_settings(self, call: Call) -> Answer:
        """The logging extension: GET answers the settings, POST changes those its JSON object names first."""
        return _json(await self.dataplane.log_settings(await _setting_changes(call)))

    async def generate(self, call: Call) -> Answer:
        return await self._generate(call, streaming=False)

    async def generate_stream(self, call: Call) -> Answer:
        return await self._generate(call, streaming=True)

    async def _generate(self, call: Call, streaming: bool) -> Answer:
        """Triton's generate extension (`generate`): the model's metadata first (an unknown model is a 404 before the
        body is read, as in Triton), then the body as its inputs and parameters, then its answers."""
        metadata = await self.dataplane.model_metadata(call.name, call.version)
        if call.content_encoding not in (None, "identity"):
            raise InvalidInput("Unsupported content-encoding, only 'identity' is supported.")  # Triton's words
        # The request's span ends with its answer made, or with a stream's first response.
        with tracing.infer_span(call.name, call.headers() if tracing.enabled else None, logs.request_id):
            request = generate.decode_generate(await call.body(), metadata["inputs"], call.name, call.version, now_ns())
            if request.id:
                logs.begin_request(request.id)
            watch = call.cancel_if_client_leaves(asyncio.get_running_loop())
            try:
                result = await self.dataplane.infer(request, streaming=True)
                if result.streamed:  # a decoupled model: its answers are a stream of responses
                    if streaming:
                        events = await generate.Events(result, request.id).opened()
                        return events.status, events, generate.SSE
                    status, body = await generate.decoupled_answer(result, request.id)
                    return status, body, generate.JSON
            finally:
                watch.cancel()
            with result.answering():
                body = generate.encode_generate(result.model_name, result.model_version, request.id, result.outputs)
        return (200, generate.event(body), generate.SSE) if streaming else (200, body, generate.JSON)

    async def metrics(self, call: Call) -> Answer:
        return 200, await self.dataplane.metrics(), [(b"content-type", CONTENT_TYPE_LATEST.encode())]

    async def shm_status(self, call: Call) -> Answer:
        return _json(await self.dataplane.shm_status(call.name))

    async def shm_register(self, call: Call) -> Answer:
        body = json_object(await call.body())
        await self.dataplane.shm_register(call.name, body.get("key"), body.get("offset", 0), body.get("byte_size"))
        return _EMPTY

    async def shm_unregister(self, call: Call) -> Answer:
        await self.dataplane.shm_unregister(call.name)
        return _EMPTY

    async def cuda_shm_status(self, call: Call) -> Answer:
        if call.name:
            raise InvalidInput(f"Unable to find cuda shared memory region: '{call.name}'")
        return _json([])

    async def cuda_shm_register(self, call: Call) -> Answer:
        raise InvalidInput(CUDA_SHM_UNSUPPORTED)

    async def cuda_shm_unregister(self, call: Call) -> Answer:
        return _EMPTY  # no CUDA region can be registered, so there is none to unregister

    def static_routes(self) -> dict[str, dict[str, Endpoint]]:
        """Paths without parameters -> {method: endpoint}."""
        routes = {
            "/v2": {"GET": self.server_metadata},
            "/v2/health/live": {"GET": self.live},
            "/v2/health/ready": {"GET": self.ready},
            # The probe paths of MindIE's deployment guide (manifests/mindie), answered as the two above.
            "/health": {"GET": self.live},
            "/ready": {"GET": self.ready},
            "/v2/repository/index": {"POST": self.repository_index},
            "/v2/models/stats": {"GET": self.statistics},
            "/metrics": {"GET": self.metrics},
            "/v2/logging": {"GET": self.log_settings, "POST": self.log_settings},
            "/v2/trace/setting": {"GET": self.trace_settings, "POST": self.trace_settings},
        }
        for shm, status, unregister in (
            ("/v2/systemsharedmemory", self.shm_status, self.shm_unregister),
            ("/v2/cudasharedmemory", self.cuda_shm_status, self.cuda_shm_unregister),
        ):
            routes[shm + "/status"] = {"GET": status}
            routes[shm + "/unregister"] = {"POST": unregister}
        return routes

    def model_routes(self) -> dict[str, dict[str, Endpoint]]:
        """What follows /v2/models/<name>[/versions/<version>] -> {method: endpoint}."""
        return {
            "": {"GET": self.model_metadata},
            "/ready": {"GET": self.model_ready},
            "/config": {"GET": self.model_config},
            "/stats": {"GET": self.statistics},
            "/infer": {"POST": self.infer},
            "/trace/setting": {"GET": self.trace_settings, "POST": self.trace_settings},
            "/generate": {"POST": self.generate},
            "/generate_stream": {"POST": self.generate_stream},
        }

    def region_routes(self) -> dict[tuple[str, str], dict[str, Endpoint]]:
        """(extension, action) of /v2/<extension>/region/<name>/<action> -> {method: endpoint}."""
        return {
            ("systemsharedmemory", "status"): {"GET": self.shm_status},
            ("systemsharedmemory", "register"): {"POST": self.shm_register},
            ("systemsharedmemory", "unregister"): {"POST": self.shm_unregister},
            ("cudasharedmemory", "status"): {"GET": self.cuda_shm_status},
            ("cudasharedmemory", "register"): {"POST": self.cuda_shm_register},
            ("cudasharedmemory", "unregister"): {"POST": self.cuda_shm_unregister},
        }


#: A path segment is what Starlette's `{name}` matched: anything but a slash.
_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?(|/ready|/config|/stats|/infer|/generate|/generate_stream|/trace/setting)")
_REPOSITORY_PATH = re.compile(r"/v2/repository/models/([^/]+)/(load|unload)")
_REGION_PATH = re.compile(r"/v2/(systemsharedmemory|cudasharedmemory)/region/([^/]+)/(status|register|unregister)")


class OipApplication:
    """The OIP routes, then `fallback` (KServe's app) for every path or method they do not serve.

    Each OIP request starts its log context (named by its `x-request-id` header if it has one)
    and any error answers `{"error": ...}`: a core error with its status, any other 500 (logged
    with its traceback); the server goes on serving. A body over `max_input_size` is answered
    413 unread (with a Content-Length) or as soon as the count passes it (chunked).
    """

    def __init__(self, dataplane: DataPlane, fallback: ASGIApp, max_input_size: int = DEFAULT_MAX_INPUT_SIZE):
        endpoints = RestEndpoints(dataplane, max_input_size)
        self.fallback = fallback
        self.max_input_size = max_input_size
        self.too_large = f"the request body is larger than {max_input_size} bytes (--http_max_input_size)"
        self._static = endpoints.static_routes()
        self._model = endpoints.model_routes()
        self._region = endpoints.region_routes()
        self._repository = {"load": {"POST": endpoints.load_model}, "unload": {"POST": endpoints.unload_model}}

    def _route(self, path: str) -> tuple[dict[str, Endpoint], str, str] | None:
        methods = self._static.get(path)
        if methods is not None:
            return methods, "", ""
        if path.startswith("/v2/models/"):
            match = _MODEL_PATH.fullmatch(path)
            if match is not None:
                name, version, action = match.groups()
                return self._model[action], name, version or ""
        elif path.startswith("/v2/repository/"):
            match = _REPOSITORY_PATH.fullmatch(path)
            if match is not None:
                return self._repository[match[2]], match[1], ""
        elif path.endswith(("/status", "/register", "/unregister")):
            match = _REGION_PATH.fullmatch(path)
            if match is not None:
                return self._region[match[1], match[3]], match[2], ""
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = self._route(scope["path"])
            if route is not None:
                methods, name, version = route
                method = scope["method"]
                endpoint = methods.get("GET" if method == "HEAD" else method)
                if endpoint is not None:
                    call = Call(scope, receive, name, version)
                    answer = await self._answer(endpoint, call)
                    if type(answer[1]) is generate.Events:
                        return await _send_events(send, call, answer)
                    return await _send(send, answer)
        await self.fallback(scope, receive, send)

    async def _answer(self, endpoint: Endpoint, call: Call) -> Answer:
        logs.begin_request(call.request_id)
        if logs.verbose:  # Triton's verbose line of each request
            log.debug("HTTP request: %s %s", call.scope["method"], call.scope["path"])
        try:
            if call.content_length is None:
                call.receive = _counting(call.receive, self.max_input_size, self.too_large)
            elif int(call.content_length) > self.max_input_size:  # the HTTP parser refused one that is no number
                raise HTTPException(413, self.too_large)
            return await endpoint(call)
        except AscendError as error:
            status = http_status(error)
            # A fault is an error; a refusal to retry (503: queue full, shutting down) is the server working as meant.
            (log.error if status == 500 else log.info)("%s %s: %s", call.scope["method"], call.scope["path"], error)
            return _error(str(error), status)
        except HTTPException as error:  # reading the body: too large, badly compressed
            log.info("%s %s: %d %s", call.scope["method"], call.scope["path"], error.status_code, error.detail)
            return _error(str(error.detail), error.status_code, error.headers)
        except ClientDisconnect:
            log.info("%s %s: the client went away before sending its whole body", call.scope["method"], call.scope["path"])
            return 400, b"", []  # read by nobody
        except asyncio.CancelledError:
            if not call.client_left:
                raise
            asyncio.current_task().uncancel()  # cancelled by `Call.cancel_if_client_leaves`, which is over
            log.info("%s %s: the client went away before its answer: the request is cancelled", call.scope["method"], call.scope["path"])
            return 400, b"", []  # read by nobody
        except Exception as error:
            log.exception("%s %s: unexpected error", call.scope["method"], call.scope["path"])
            return _error(unexpected(error), 500)


def _counting(receive: Receive, limit: int, message: str) -> Receive:
    """`receive`, raising HTTPException 413 once the body it has read is over `limit` bytes."""
    received = 0

    async def counting_receive() -> Message:
        nonlocal received
        message_ = await receive()
        received += len(message_.get("body", b""))
        if received > limit:
            raise HTTPException(413, message)
        return message_

    return counting_receive


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Unknown routes, wrong methods and unreadable bodies answer in the OIP error shape too."""
    return Response(orjson.dumps({"error": str(error.detail)}), error.status_code, error.headers, "application/json")


async def _server_error(request: Request, error: Exception) -> Response:
    """What escaped KServe's own handling answers in the OIP error shape too.

    Starlette raises the error again once this is sent, so uvicorn logs it with its traceback.
    """
    return Response(orjson.dumps({"error": unexpected(error)}), 500, media_type="application/json")


class BodyLimit:
    """Answers 413 to a request for KServe's app whose body is over `limit` bytes, reading no more of it than that.

    A Content-Length over the limit is refused before the request is routed; a body
    without one (chunked) is counted as the endpoint reads it.
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit
        self.message = f"the request body is larger than {limit} bytes (--http_max_input_size)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = next((value for key, value in scope["headers"] if key == b"content-length"), None)
            if length is None:
                receive = _counting(receive, self.limit, self.message)
            elif int(length) > self.limit:
                log.info("%s %s: 413 %s", scope["method"], scope["path"], self.message)
                return await _send(send, _error(self.message, 413))
        await self.app(scope, receive, send)


def application(
    dataplane: DataPlane,
    kserve_app: Starlette,
    max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
    authenticator: Authenticator | None = None,
) -> ASGIApp:
    """The OIP routes and /metrics first, KServe's own app (its V1 routes, docs) for every other path.

    The OIP routes sit outside KServe's middleware stack (per-request timing logs,
    telemetry) and outside any framework, which cost more than the rest of a small
    request's handling. The token check (when `authenticator` is given) guards both, and
    the body limit both; inference requests and responses are compressed as Triton's are
    (see `compression`).
    """
    kserve_app.add_exception_handler(HTTPException, _http_error)
    kserve = Starlette(
        routes=[Mount("/", app=kserve_app)],
        middleware=[Middleware(BodyLimit, limit=max_input_size)],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app: ASGIApp = OipApplication(dataplane, kserve, max_input_size)
    if authenticator is not None:
        app = RestAuthentication(app, authenticator)  # before any body is read
    return app

"""The OIP v2 REST edge: Starlette routes that translate HTTP to the data plane and back.

Routes are plain Starlette endpoints (no pydantic models on the hot path): the body is
decoded once by the codec and the response is encoded straight to bytes with orjson.
"""

from __future__ import annotations

import functools
import logging

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core import tracing
from ..core.errors import AscendError, InvalidInput
from ..core.stats import RequestTiming
from . import logs
from .auth import Authenticator, RestAuthentication
from .codec import HEADER_LENGTH, decode_rest, encode_rest, json_object
from .dataplane import DataPlane
from .compression import Compression
from .errors import http_status, unexpected
from .shm import CUDA_SHM_UNSUPPORTED

log = logging.getLogger(__name__)

JSON = "application/json"

#: Triton's default for `--http-max-input-size`: 64 MiB.
DEFAULT_MAX_INPUT_SIZE = 64 * 2**20


def _json(content, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type=JSON)


def _error(message: str, status: int) -> Response:
    return _json({"error": message}, status)


def _answers_errors(endpoint):
    """Turns any error into `{"error": ...}`: a core error with its status, any other 500 (logged
    with its traceback); the server goes on serving.

    Also starts the request's log context, named by its `x-request-id` header if it has one.
    """

    @functools.wraps(endpoint)
    async def wrapper(request: Request) -> Response:
        logs.begin_request(request.headers.get("x-request-id"))
        try:
            return await endpoint(request)
        except AscendError as error:
            status = http_status(error)
            (log.error if status >= 500 else log.info)("%s %s: %s", request.method, request.url.path, error)
            return _error(str(error), status)
        except HTTPException:
            raise  # raised while reading the body (too large, badly compressed): the app's handler answers it
        except ClientDisconnect:
            log.info("%s %s: the client went away before sending its whole body", request.method, request.url.path)
            return Response(status_code=400)  # read by nobody
        except Exception as error:
            log.exception("%s %s: unexpected error", request.method, request.url.path)
            return _error(unexpected(error), 500)

    return wrapper


class RestEndpoints:
    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    async def server_metadata(self, request: Request) -> Response:
        return _json(self.dataplane.metadata())

    async def live(self, request: Request) -> Response:
        return _json({"live": True})

    async def ready(self, request: Request) -> Response:
        # OIP: 200 means ready, 4xx means not ready.
        ready = self.dataplane.ready()
        return _json({"ready": ready}, 200 if ready else 400)

    async def model_metadata(self, request: Request) -> Response:
        p = request.path_params
        return _json(self.dataplane.model_metadata(p["model_name"], p.get("model_version")))

    async def model_ready(self, request: Request) -> Response:
        p = request.path_params
        name, version = p["model_name"], p.get("model_version")
        unready = self.dataplane.unready_reason(name, version)
        if unready:
            # Triton's status and words, for an unknown model or version as for one not loaded (OIP: 4xx is false).
            return _error(f"Model version not ready: {unready}", 400)
        return _json({"name": name, "ready": True})

    async def model_config(self, request: Request) -> Response:
        p = request.path_params
        return _json(self.dataplane.model_config(p["model_name"], p.get("model_version")))

    async def statistics(self, request: Request) -> Response:
        p = request.path_params
        return _json(self.dataplane.statistics(p.get("model_name"), p.get("model_version")))

    async def repository_index(self, request: Request) -> Response:
        return _json(self.dataplane.index())

    async def load_model(self, request: Request) -> Response:
        body = await request.body()
        parameters = (json_object(body) if body else {}).get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InvalidInput("'parameters' must be an object")
        if any(key.startswith("file:") for key in parameters):
            raise InvalidInput("file overrides ('file:<path>' parameters) are not supported: put the file in the repository")
        config = parameters.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidInput("the 'config' parameter must be a string holding the ModelConfig as JSON")
        await self.dataplane.load_model(request.path_params["model_name"], config)
        return Response()

    async def unload_model(self, request: Request) -> Response:
        await self.dataplane.unload_model(request.path_params["model_name"])
        return Response()

    async def infer(self, request: Request) -> Response:
        p = request.path_params
        with tracing.infer_span(p["model_name"], request.headers, logs.request_id) as span:
            body = await request.body()
            timing = RequestTiming()  # the server's work on the request starts once its body is in
            infer_request = decode_rest(body, request.headers.get(HEADER_LENGTH), self.dataplane.shm)
            if infer_request.id:
                logs.begin_request(infer_request.id)  # the OIP id names the request ahead of the header
            served, (answer, header_length) = await self.dataplane.infer(
                p["model_name"], p.get("model_version"), infer_request, timing, encode_rest
            )
            if span is not None:
                span.set_attribute(tracing.MODEL_VERSION, served.version)
        if header_length is None:
            return Response(answer, media_type=JSON)
        return Response(
            answer,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(header_length)},
        )

    async def shm_status(self, request: Request) -> Response:
        return _json(self.dataplane.shm.status(request.path_params.get("region_name", "")))

    async def shm_register(self, request: Request) -> Response:
        body = json_object(await request.body())
        self.dataplane.shm.register(
            request.path_params["region_name"], body.get("key"), body.get("offset", 0), body.get("byte_size")
        )
        return Response()

    async def shm_unregister(self, request: Request) -> Response:
        self.dataplane.shm.unregister(request.path_params.get("region_name", ""))
        return Response()

    async def cuda_shm_status(self, request: Request) -> Response:
        if "region_name" in request.path_params:
            raise InvalidInput(f"Unable to find cuda shared memory region: '{request.path_params['region_name']}'")
        return _json([])

    async def cuda_shm_register(self, request: Request) -> Response:
        raise InvalidInput(CUDA_SHM_UNSUPPORTED)

    async def cuda_shm_unregister(self, request: Request) -> Response:
        return Response()  # no CUDA region can be registered, so there is none to unregister

    def routes(self) -> list[Route]:
        model = "/v2/models/{model_name}"
        version = model + "/versions/{model_version}"
        table = [
            ("/v2", self.server_metadata, "GET"),
            ("/v2/health/live", self.live, "GET"),
            ("/v2/health/ready", self.ready, "GET"),
            # The probe paths of MindIE's deployment guide (manifests/mindie), answered as the two above.
            ("/health", self.live, "GET"),
            ("/ready", self.ready, "GET"),
            ("/v2/repository/index", self.repository_index, "POST"),
            ("/v2/repository/models/{model_name}/load", self.load_model, "POST"),
            ("/v2/repository/models/{model_name}/unload", self.unload_model, "POST"),
            ("/v2/models/stats", self.statistics, "GET"),
        ]
        for shm, status, register, unregister in (
            ("/v2/systemsharedmemory", self.shm_status, self.shm_register, self.shm_unregister),
            ("/v2/cudasharedmemory", self.cuda_shm_status, self.cuda_shm_register, self.cuda_shm_unregister),
        ):
            region = shm + "/region/{region_name}"
            table += [
                (shm + "/status", status, "GET"),
                (region + "/status", status, "GET"),
                (region + "/register", register, "POST"),
                (shm + "/unregister", unregister, "POST"),
                (region + "/unregister", unregister, "POST"),
            ]
        for prefix in (model, version):
            table += [
                (prefix, self.model_metadata, "GET"),
                (prefix + "/ready", self.model_ready, "GET"),
                (prefix + "/config", self.model_config, "GET"),
                (prefix + "/stats", self.statistics, "GET"),
                (prefix + "/infer", self.infer, "POST"),
            ]
        return [Route(path, _answers_errors(endpoint), methods=[method]) for path, endpoint, method in table]


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Unknown routes, wrong methods and unreadable bodies answer in the OIP error shape too."""
    response = _error(str(error.detail), error.status_code)
    response.headers.update(error.headers or {})
    return response


async def _server_error(request: Request, error: Exception) -> Response:
    """What escaped every route's own handling (a fault in a middleware) answers in the OIP error shape too.

    Starlette raises the error again once this is sent, so uvicorn logs it with its traceback.
    """
    return _error(unexpected(error), 500)


class BodyLimit:
    """Answers 413 to a request whose body is over `limit` bytes, reading no more of it than that.

    A Content-Length over the limit is refused before the request is routed; a body
    without one (chunked) is counted as the endpoint reads it. Requests within their
    Content-Length pay one look at the headers (the HTTP parser holds the body to it).
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit
        self.message = f"the request body is larger than {limit} bytes (--http_max_input_size)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = next((value for key, value in scope["headers"] if key == b"content-length"), None)
            if length is None:
                receive = self._counting(receive)
            elif int(length) > self.limit:  # the HTTP parser has refused a Content-Length that is not a number
                log.info("%s %s: 413 %s", scope["method"], scope["path"], self.message)
                return await _error(self.message, 413)(scope, receive, send)
        await self.app(scope, receive, send)

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self.message)  # answered by the app's handler, in the OIP error shape
            return message

        return counting_receive


def application(
    dataplane: DataPlane,
    kserve_app: Starlette,
    max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
    authenticator: Authenticator | None = None,
) -> Starlette:
    """The OIP routes first, KServe's own app (V1 routes, /metrics, ...) for every other path.

    The OIP routes sit outside KServe's middleware stack (per-request timing logs,
    telemetry), which costs more than the rest of a small request's handling. The token
    check (when `authenticator` is given) and the body limit guard both; inference requests and
    responses are compressed as Triton's are (see `compression`).
    """
    kserve_app.add_exception_handler(HTTPException, _http_error)
    middleware = [Middleware(BodyLimit, limit=max_input_size), Middleware(Compression, limit=max_input_size)]
    if authenticator is not None:
        middleware.insert(0, Middleware(RestAuthentication, authenticator=authenticator))  # before any body is read
    return Starlette(
        routes=[*RestEndpoints(dataplane).routes(), Mount("/", app=kserve_app)],
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )

"""The KServe ModelServer of kserve-ascend: KServe's server and flags, this project's OIP edges."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Awaitable

import kserve
from kserve import model_server
from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
from kserve.protocol.rest.server import RESTServer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core import tracing
from ..core.errors import AscendError
from ..core.model import Model
from ..core.repository import Repository
from . import listeners, logs, metrics, ports, rest
from .auth import Authenticator, GrpcAuthentication
from .dataplane import DataPlane
from .grpc import CertificateFiles, GrpcServer
from .model import AscendModel

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_LENGTH = 2**31 - 1
#: Of --shutdown_timeout_s, what the edges keep after the drain (at most half of it): time to write the
#: answers of the requests failed at the drain's end and to close their connections.
EDGES_STOP_S = 1.0

_TRANSFORMER = "a KServe transformer's flag: this server is the predictor, it calls none"
#: KServe's flags this server has no use for, and why: accepted (ServingRuntimes written for KServe's
#: servers pass some), hidden from --help, and a WARNING when given. The others it honours.
IGNORED_KSERVE_FLAGS = {
    "model_name": "the model repository names the models (a directory each)",
    "predictor_host": _TRANSFORMER,
    "protocol": _TRANSFORMER,
    "predictor_protocol": _TRANSFORMER,
    "predictor_use_ssl": _TRANSFORMER,
    "predictor_request_timeout_seconds": _TRANSFORMER,
    "predictor_request_retries": _TRANSFORMER,
    "enable_predictor_health_check": _TRANSFORMER,
    "max_threads": "gRPC is served on the event loop (grpc.aio), with no thread pool to size",
    "enable_latency_logging": "per-request timings are in the statistics extension, the metrics and --enable_tracing",
}


def build_parser() -> argparse.ArgumentParser:
    """KServe's own flags (`--http_port`, `--grpc_port`, `--workers`, ...) plus the repository."""
    parser = argparse.ArgumentParser(
        prog="kserve-ascend",
        parents=[model_server.parser],
        description="Serve a Triton-layout model repository on Ascend NPUs over Open Inference Protocol v2.",
    )
    for action in parser._actions:  # argparse has no public way to hide an inherited flag
        if action.dest in IGNORED_KSERVE_FLAGS:
            # SUPPRESS as default: the namespace has the attribute only when the flag was given.
            action.help = action.default = argparse.SUPPRESS
    # KServe caps gRPC messages at 8 MiB; a batch of 640x640 images is larger. Triton's limit is INT32_MAX.
    parser.set_defaults(grpc_max_send_message_length=GRPC_MAX_MESSAGE_LENGTH, grpc_max_receive_message_length=GRPC_MAX_MESSAGE_LENGTH)
    parser.add_argument(
        "--model_dir",
        default="/mnt/models",
        help="The model repository: <model>/config.pbtxt and <model>/<version>/model.onnx|model.om.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="A CANN inference-server config.yaml (server ports and models) to serve instead of --model_dir.",
    )
    parser.add_argument(
        "--model_control_mode",
        choices=("none", "poll", "explicit"),
        default="none",
        help="As Triton's: none loads the repository once; poll follows its changes; "
        "explicit loads and unloads by the repository extension.",
    )
    parser.add_argument(
        "--load_model",
        action="append",
        default=[],
        metavar="NAME",
        help="With explicit control, a model to load at start-up (repeatable; '*' for all).",
    )
    parser.add_argument(
        "--metrics_port", type=int, default=9090, help="Port of the Prometheus /metrics endpoint (0: only on the HTTP port)."
    )
    parser.add_argument(
        "--shutdown_timeout_s",
        type=positive_seconds,
        default=20.0,
        metavar="SECONDS",
        help="On SIGTERM or SIGINT the server turns unready and refuses new requests (503 / UNAVAILABLE) at once, "
        "answers the requests it accepted, then exits, within this many seconds: a request still unanswered then "
        "fails with 503 (Triton's --exit-timeout-secs). Keep it below the pod's terminationGracePeriodSeconds "
        "(Kubernetes' default 30) minus its preStop delay.",
    )
    parser.add_argument("--log_format", choices=("text", "json"), default="text", help="json: one JSON object per log line.")
    parser.add_argument(
        "--enable_access_log",
        action="store_true",
        help="Log one line per HTTP request (uvicorn's access log). Off by default, as in Triton: at thousands of "
        "requests a second the line costs more than serving a small request.",
    )
    security = parser.add_argument_group(
        "security",
        "TLS: --ssl_certfile and --ssl_keyfile secure both the REST and the gRPC port. Authentication is off unless "
        "a token file or a JWT key is given; then every endpoint but the health and readiness probes needs "
        "'Authorization: Bearer <token>' (gRPC metadata 'authorization').",
    )
    security.add_argument(
        "--http_max_input_size",
        type=byte_count,
        default=rest.DEFAULT_MAX_INPUT_SIZE,
        metavar="BYTES",
        help="Largest REST request body; a larger one is answered 413 unread (Triton's --http-max-input-size, "
        "default 64 MiB). gRPC's is --grpc_max_receive_message_length.",
    )
    security.add_argument("--auth_token_file", metavar="PATH", help="Accepted bearer tokens, one a line.")
    security.add_argument(
        "--auth_jwt_public_key", metavar="PATH", help="PEM public key (or certificate) that signs accepted JWT access tokens."
    )
    security.add_argument("--auth_jwt_issuer", help="The 'iss' an accepted JWT must carry.")
    security.add_argument("--auth_jwt_audience", help="The 'aud' an accepted JWT must carry.")
    parser.add_argument(
        "--enable_tracing",
        action="store_true",
        help="OpenTelemetry spans of queue, batch and execution (exporter from the OTEL_* environment).",
    )
    return parser


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return seconds


def byte_count(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {value}")
    return number


class AscendModelServer(kserve.ModelServer):
    """kserve.ModelServer serving a repository whose models load in the background.

    The server is live at once and ready when every model meant to serve has loaded
    (Triton's strict readiness), so Kubernetes probes see loading as "live, not ready".
    `control_mode` is Triton's: none loads the repository once, poll follows its changes
    on disk, explicit loads `startup_models` and then what the repository extension asks.
    """

    def __init__(
        self,
        repository: Repository,
        control_mode: str = "none",
        startup_models: list[str] | None = None,
        grpc_options: list[tuple[str, int]] | None = None,
        metrics_port: int = 0,
        http_max_input_size: int = rest.DEFAULT_MAX_INPUT_SIZE,
        authenticator: Authenticator | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.http_max_input_size = http_max_input_size
        self.authenticator = authenticator
        self.grpc_options = grpc_options or []
        self.metrics_port = metrics_port
        self.control_mode = control_mode
        self.startup_models = startup_models or []
        self.repository = repository
        self._stopping = asyncio.Event()  # ends poll mode's watch, so shutdown is not held up by it
        self._shutdown: asyncio.Task | None = None
        self.ascend_dataplane = DataPlane(repository, explicit_control=control_mode == "explicit")
        self._registered: dict[str, Model] = {}

    def _register_models(self) -> None:
        """Each model of the repository as a kserve.Model in KServe's registry (its V1 routes, its tooling)."""
        for name, model in list(self.repository.models.items()):
            if self._registered.get(name) is not model:
                self.register_model(AscendModel(model, self.ascend_dataplane))
                self._registered[name] = model

    async def load_models(self) -> None:
        """The start-up load, then (poll mode) the repository followed until `stop_watching`."""
        names = list(self.repository.models)
        if self.control_mode == "explicit" and "*" not in self.startup_models:
            names = self.startup_models
        # All LOADING at once: one waiting for its turn must not show in the index as unloaded meanwhile.
        for name in names:
            if name in self.repository.models:
                self.repository.models[name].mark_loading()
        for name in names:
            try:
                await self.repository.load(name)
            except AscendError as error:  # the model's reason is in the index; the others load
                log.error("model '%s' did not load: %s", name, error)
        self._register_models()
        self.ascend_dataplane.loaded = True
        log.info("repository loaded: %s", {m.name: m.state.value for m in self.repository.models.values()})
        if self.control_mode == "poll":
            async for _ in self.repository.follow(self._stopping):
                self._register_models()

    def stop_watching(self) -> None:
        """Ends poll mode's watch, so that shutdown is not held up by it (on the loop's thread)."""
        self._stopping.set()

    def start(self, models: list | None = None) -> None:
        """Serves in this one process: the edges and the models together (`--workers N` > 1 runs `engine.Engine`)."""
        if self.workers != 1:
            raise ValueError("one process serves --workers 1; kserve_ascend.server.engine.Engine serves more")
        self._register_models()
        metrics.register(self.repository, self.metrics_port)
        self.servers = serve_edges(self, self.ascend_dataplane)
        self.setup_event_loop()
        try:
            asyncio.run(self._serve())
        finally:
            self.ascend_dataplane.shm.close()  # unmaps the regions clients left registered

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, self.stop, sig)
        loading = asyncio.create_task(self.load_models())
        await asyncio.gather(*self.servers)  # until `stop` has drained the models and stopped the edges
        loading.cancel()
        self.ascend_dataplane.close()  # nothing is in flight: the devices go
        log.info("server stopped")

    def stop(self, sig: int | None = None) -> None:
        """SIGTERM, SIGINT or SIGQUIT (KServe's `stop`, made graceful): begins the shutdown, once."""
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(self._shut_down())

    async def _shut_down(self) -> None:
        """Unready and refusing new requests at once; the accepted ones answered (or failed at the deadline);
        then the edges stop, all within --shutdown_timeout_s (KServe's `grace_period`: see `server_options`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_period
        log.info("shutting down: unready, refusing new requests, answering those accepted within %g s", self.grace_period)
        self.stop_watching()
        self.ascend_dataplane.stop_accepting()
        try:
            await self.ascend_dataplane.drain(self.grace_period - min(EDGES_STOP_S, self.grace_period / 2))
        except Exception:  # a fault of the drain must not keep the server from stopping
            log.exception("draining the models failed: stopping now")
        # uvicorn's listening socket, emptied before uvicorn closes it (listeners: closing resets what it queued).
        uvicorn_listeners = [sock for listener in self._rest_server._server.servers for sock in listener.sockets]
        await listeners.drain(uvicorn_listeners, max(deadline - loop.time(), 0) / 2)
        stop_edges(self, max(deadline - loop.time(), 0))


def serve_edges(server: kserve.ModelServer, dataplane, http_socket: socket.socket | None = None) -> list[Awaitable]:
    """The REST edge (KServe's uvicorn server and routes, in front of which go the OIP routes) and the gRPC edge,
    over `dataplane`: what serves them, to await.

    `server` also carries this project's edge settings (`grpc_options`, `http_max_input_size`,
    `authenticator`). One process binds both ports itself, the gRPC port exclusively (no
    other process can bind it beside ours, grpcio's default SO_REUSEPORT would allow that);
    a frontend of `--workers N` serves the HTTP socket the engine made for it and binds the
    gRPC port with SO_REUSEPORT beside the other frontends (grpcio takes no socket).
    """
    server._rest_server = RESTServer(
        FASTAPI_APP_IMPORT_STRING,
        server.dataplane,
        server.model_repository_extension,
        server.http_port,
        access_log_format=server.access_log_format,
        grace_period=server.grace_period,
        event_loop=server.event_loop,
        timeout_keep_alive=server.timeout_keep_alive,
        ssl_certfile=server.ssl_certfile,
        ssl_keyfile=server.ssl_keyfile,
    )
    server._rest_server.config.app = ClosesWhenStopping(
        rest.application(dataplane, model_server.app, server.http_max_input_size, server.authenticator), dataplane
    )
    # uvicorn would take SIGTERM and SIGINT for itself and close its port at once; the server stops it
    # (`stop_edges`) once the models have drained, refusing new requests with 503 meanwhile.
    server._rest_server._server.capture_signals = contextlib.nullcontext
    if http_socket is None:
        serving = [server._rest_server.start()]
    else:
        server._rest_server.create_application()  # KServe's routes, as its start() adds them
        serving = [server._rest_server._server.serve(sockets=[http_socket])]
    if server.enable_grpc:
        server._grpc_server = GrpcServer(
            server.grpc_port,
            dataplane,
            [*server.grpc_options, ("grpc.so_reuseport", int(http_socket is not None))],
            server.grace_period,
            credentials=_grpc_credentials(server.ssl_certfile, server.ssl_keyfile),
            interceptors=[GrpcAuthentication(server.authenticator)] if server.authenticator else [],
        )
        serving.append(server._grpc_server.start())
    return serving


class ClosesWhenStopping:
    """The REST app, whose every answer closes its connection (`Connection: close`) once the server is
    shutting down (`dataplane.stopping`), as a draining proxy does.

    The client's next request then goes out on a new connection: to another replica, through
    a balancer, or refused outright once this server stops listening. On a kept-alive
    connection it could meet the server closing that connection as it arrives, which the
    client cannot tell from a request lost (HTTP/1.1's keep-alive race, RFC 9112 §9.3.1).
    """

    def __init__(self, app: ASGIApp, dataplane):
        self.app = app
        self.dataplane = dataplane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        dataplane = self.dataplane

        async def answer(message: Message) -> None:
            if dataplane.stopping and message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"connection", b"close")]
            await send(message)

        await self.app(scope, receive, answer)


def stop_edges(server: kserve.ModelServer, grace: float) -> None:
    """Both edges stop accepting; what they accepted gets `grace` seconds to be answered, then is cancelled."""
    if server._rest_server is not None:
        uvicorn = server._rest_server._server
        uvicorn.config.timeout_graceful_shutdown = grace
        uvicorn.should_exit = True
    if server._grpc_server is not None:
        server._grpc_server.grace_period = grace
        asyncio.get_running_loop().create_task(server._grpc_server.stop())


def _grpc_credentials(certfile: str | None, keyfile: str | None):
    """TLS with REST's certificate and key (both or neither, checked by main), reloaded when they change."""
    if not certfile:
        return None
    try:
        return CertificateFiles(certfile, keyfile).credentials()
    except OSError as error:
        raise SystemExit(f"kserve-ascend: cannot read the TLS certificate or key: {error}") from None


def _log_like_kserve(log_format: str, access_log: bool = False) -> None:
    """This package logs through the handlers KServe configured, at INFO; every line names its request.

    uvicorn writes an access line per request while its logger has a handler, so without
    `access_log` the logger has none (and passes nothing on to the root's).
    """
    ascend = logging.getLogger("kserve_ascend")
    ascend.setLevel(logging.INFO)
    ascend.propagate = False  # written once, by KServe's handlers, not again by the root's (json)
    for handler in logging.getLogger("kserve").handlers:
        ascend.addHandler(handler)
    if not access_log:
        access = logging.getLogger("uvicorn.access")
        access.handlers, access.propagate = [], False
    logs.configure(log_format)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.config:
        from .. import cann_config

        # The file's ports and models become defaults: flags given on the command line still win.
        parser.set_defaults(**cann_config.parser_defaults(known.config))
    args = parser.parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl_certfile and --ssl_keyfile go together: they secure the REST and the gRPC port")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.workers > 1 and not (hasattr(os, "memfd_create") and hasattr(socket, "SO_REUSEPORT")):
        parser.error("--workers N > 1 needs Linux: its frontends share memfd shared memory and SO_REUSEPORT ports")
    return args


def server_options(args: argparse.Namespace) -> dict:
    """What the edges are made of, from the flags: the same in the one process and in every frontend."""
    return dict(
        grpc_options=[
            ("grpc.max_send_message_length", args.grpc_max_send_message_length),
            ("grpc.max_receive_message_length", args.grpc_max_receive_message_length),
        ],
        http_max_input_size=args.http_max_input_size,
        authenticator=Authenticator.from_files(
            args.auth_token_file, args.auth_jwt_public_key, args.auth_jwt_issuer, args.auth_jwt_audience
        ),
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        workers=args.workers,
        max_asyncio_workers=args.max_asyncio_workers,
        enable_grpc=args.enable_grpc,
        enable_docs_url=args.enable_docs_url,
        access_log_format=args.access_log_format,
        event_loop=args.event_loop,
        timeout_keep_alive=args.timeout_keep_alive,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        # KServe's grace period is uvicorn's timeout_graceful_shutdown and gRPC's stop grace, which
        # each start when their edge stops. One flag bounds the whole shutdown instead: the edges
        # stop only once the models have drained, and get what is left of it (`stop_edges`).
        grace_period=args.shutdown_timeout_s,
    )


def check_ports(server: AscendModelServer) -> None:
    """Exits with one line naming a port given twice or another process holds, before anything starts.

    The ports are the server's, not the flags': with TLS, KServe moves the default HTTP port to 8443.
    """
    listening = {"--http_port": (server.http_port, ports.HTTP)}
    if server.enable_grpc:
        listening["--grpc_port"] = (server.grpc_port, ports.GRPC)
    if server.metrics_port:  # 0: /metrics on the HTTP port only
        listening["--metrics_port"] = (server.metrics_port, ports.METRICS)
    ports.check_distinct({flag: port for flag, (port, _) in listening.items()})
    for port, what in listening.values():
        ports.check_free(port, what)


def configure_process(args: argparse.Namespace) -> None:
    """Logging and tracing as the flags ask, in the one process, the engine and every frontend."""
    _log_like_kserve(args.log_format, args.enable_access_log)
    if args.enable_tracing:
        tracing.enable()


def warn_ignored(args: argparse.Namespace) -> None:
    """A WARNING for each KServe flag given that this server has no use for."""
    for dest, reason in IGNORED_KSERVE_FLAGS.items():
        if hasattr(args, dest):
            log.warning("--%s is ignored: %s", dest, reason)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = server_options(args)
    try:
        repository = Repository(Path(args.model_dir))
    except FileNotFoundError as error:
        raise SystemExit(f"kserve-ascend: {error}") from None
    server = AscendModelServer(
        repository,
        control_mode=args.model_control_mode,
        startup_models=args.load_model,
        metrics_port=args.metrics_port,
        **options,
    )
    check_ports(server)
    configure_process(args)
    warn_ignored(args)
    if args.workers > 1:
        from .engine import Engine

        # This process owns the NPUs and batches; `--workers` frontend processes serve the ports.
        Engine(server, args).run()
    else:
        server.start()

"""The KServe ModelServer of kserve-ascend: KServe's server and flags, this project's OIP edges."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import kserve
from kserve import model_server
from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
from kserve.protocol.rest.server import RESTServer

from ..core import tracing
from ..core.errors import AscendError
from ..core.model import Model
from ..core.repository import Repository
from . import logs, metrics, rest
from .auth import Authenticator, GrpcAuthentication
from .dataplane import DataPlane
from .grpc import CertificateFiles, GrpcServer
from .model import AscendModel

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_LENGTH = 2**31 - 1


def build_parser() -> argparse.ArgumentParser:
    """KServe's own flags (`--http_port`, `--grpc_port`, `--workers`, ...) plus the repository."""
    parser = argparse.ArgumentParser(
        prog="kserve-ascend",
        parents=[model_server.parser],
        description="Serve a Triton-layout model repository on Ascend NPUs over Open Inference Protocol v2.",
    )
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
    parser.add_argument("--log_format", choices=("text", "json"), default="text", help="json: one JSON object per log line.")
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
        self.ascend_dataplane = DataPlane(repository, explicit_control=control_mode == "explicit")
        self._registered: dict[str, Model] = {}

    def _register_models(self) -> None:
        """Each model of the repository as a kserve.Model in KServe's registry (its V1 routes, its tooling)."""
        for name, model in list(self.repository.models.items()):
            if self._registered.get(name) is not model:
                self.register_model(AscendModel(model))
                self._registered[name] = model

    async def _load_models(self) -> None:
        names = list(self.repository.models)
        if self.control_mode == "explicit" and "*" not in self.startup_models:
            names = self.startup_models
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

    def _grpc_credentials(self):
        """TLS with REST's certificate and key (both or neither, checked by main), reloaded when they change."""
        if not self.ssl_certfile:
            return None
        try:
            return CertificateFiles(self.ssl_certfile, self.ssl_keyfile).credentials()
        except OSError as error:
            raise SystemExit(f"kserve-ascend: cannot read the TLS certificate or key: {error}") from None

    def stop(self, sig: int) -> None:
        # A signal handler, run on the loop's thread between two steps: set the event from the loop.
        asyncio.get_running_loop().call_soon(self._stopping.set)
        super().stop(sig)

    def start(self, models: list | None = None) -> None:
        if self.workers != 1:
            # Every worker process would load its own copy of each model on the NPU and batch alone.
            raise SystemExit("--workers must be 1: scale kserve-ascend with replicas, one process per NPU set")
        self._register_models()
        metrics.register(self.repository, self.metrics_port)
        self._rest_server = RESTServer(
            FASTAPI_APP_IMPORT_STRING,
            self.dataplane,
            self.model_repository_extension,
            self.http_port,
            access_log_format=self.access_log_format,
            grace_period=self.grace_period,
            event_loop=self.event_loop,
            timeout_keep_alive=self.timeout_keep_alive,
            ssl_certfile=self.ssl_certfile,
            ssl_keyfile=self.ssl_keyfile,
        )
        # KServe's server (uvicorn, TLS refresh) and its routes, in front of which go the OIP routes.
        self._rest_server.config.app = rest.application(
            self.ascend_dataplane, model_server.app, self.http_max_input_size, self.authenticator
        )
        self.servers = [self._rest_server.start(), self._load_models()]
        if self.enable_grpc:
            self._grpc_server = GrpcServer(
                self.grpc_port,
                self.ascend_dataplane,
                self.grpc_options,
                self.grace_period,
                credentials=self._grpc_credentials(),
                interceptors=[GrpcAuthentication(self.authenticator)] if self.authenticator else [],
            )
            self.servers.append(self._grpc_server.start())
        self.setup_event_loop()
        self.register_signal_handler()
        try:
            asyncio.run(self._serve())
        finally:
            self.ascend_dataplane.shm.close()  # unmaps the regions clients left registered


def _log_like_kserve(log_format: str) -> None:
    """This package logs through the handlers KServe configured, at INFO; every line names its request."""
    ascend = logging.getLogger("kserve_ascend")
    ascend.setLevel(logging.INFO)
    ascend.propagate = False  # written once, by KServe's handlers, not again by the root's (json)
    for handler in logging.getLogger("kserve").handlers:
        ascend.addHandler(handler)
    logs.configure(log_format)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.config:
        from .. import cann_config

        # The file's ports and models become defaults: flags given on the command line still win.
        parser.set_defaults(**cann_config.parser_defaults(known.config))
    args = parser.parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl_certfile and --ssl_keyfile go together: they secure the REST and the gRPC port")
    authenticator = Authenticator.from_files(
        args.auth_token_file, args.auth_jwt_public_key, args.auth_jwt_issuer, args.auth_jwt_audience
    )
    try:
        repository = Repository(Path(args.model_dir))
    except FileNotFoundError as error:
        raise SystemExit(f"kserve-ascend: {error}") from None
    server = AscendModelServer(
        repository,
        control_mode=args.model_control_mode,
        startup_models=args.load_model,
        grpc_options=[
            ("grpc.max_send_message_length", args.grpc_max_send_message_length),
            ("grpc.max_receive_message_length", args.grpc_max_receive_message_length),
        ],
        metrics_port=args.metrics_port,
        http_max_input_size=args.http_max_input_size,
        authenticator=authenticator,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        workers=args.workers,
        max_threads=args.max_threads,
        max_asyncio_workers=args.max_asyncio_workers,
        enable_grpc=args.enable_grpc,
        enable_docs_url=args.enable_docs_url,
        enable_latency_logging=args.enable_latency_logging,
        access_log_format=args.access_log_format,
        event_loop=args.event_loop,
        timeout_keep_alive=args.timeout_keep_alive,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    _log_like_kserve(args.log_format)
    if args.enable_tracing:
        tracing.enable()
    server.start()

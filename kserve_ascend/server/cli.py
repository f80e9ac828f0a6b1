"""The command line: KServe's flags (its ModelServer's, as a parent parser) and this server's own.

The same flags mean the same in the one process and in every process of `--workers N`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .. import cann_config
from ..core import tracing
from ..core.cache import ResponseCache
from ..core.execution.runtimes.acl_process import device_memory
from ..core.models.memory import RESERVE_MB, Ledger
from ..core.models.repository import Repository
from ..core.scheduling.rate_limiter import RateLimiter, parse_resource
from . import kserve_seam
from .edges import rest
from .edges.auth import Authenticator
from .observability import logs, traces

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_LENGTH = 2**31 - 1

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
        parents=[kserve_seam.parser(hidden=IGNORED_KSERVE_FLAGS)],
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
        help="With explicit control or --load_on_demand, a model to load at start-up (repeatable; '*' for all).",
    )
    memory = parser.add_argument_group(
        "memory",
        "Each load is admitted against the memory budget of every device it loads on, before it touches one, or "
        "refused naming both numbers (docs/operating.md, 'Many models on few NPUs').",
    )
    memory.add_argument(
        "--memory_budget_mb",
        type=positive_megabytes,
        metavar="MB",
        help="Memory the models may take on each NPU. Default: where pyACL is present, each device's free memory "
        f"when it is first used less {RESERVE_MB} MB; unlimited on a host without it.",
    )
    memory.add_argument(
        "--load_on_demand",
        action="store_true",
        help="Load a model when a request first asks for it (the request waits, within its timeout); a load that "
        "does not fit unloads the models used least recently that no request is using. Only --load_model models "
        "load at start, and they are never unloaded (nor models whose config says parameters pinned: \"true\").",
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
    parser.add_argument(
        "--log_format",
        type=lambda value: "default" if value == "text" else value,  # `text`: its name before the logging extension
        choices=logs.LOG_FORMATS,
        default="default",
        help="default: KServe's lines; ISO8601: the same with the time in ISO 8601 UTC; json: one JSON object per line. "
        "Changed at run time by POST /v2/logging (Triton's logging extension), as are the levels written.",
    )
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
    limiter = parser.add_argument_group(
        "rate limiter",
        "Triton's: with execution_count, a model instance executes only when the resources its instance_group's "
        "rate_limiter names are free (per NPU, or across the server if global), in turn by priority.",
    )
    limiter.add_argument(
        "--rate_limit",
        type=str.lower,
        choices=("execution_count", "off"),
        default="off",
        help="Triton's --rate-limit: execution_count, or off (the default: rate_limiter configs are ignored).",
    )
    limiter.add_argument(
        "--rate_limit_resource",
        type=rate_limit_resource,
        action="append",
        default=[],
        metavar="NAME:COUNT[:DEVICE]",
        help="Triton's --rate-limit-resource (repeatable): COUNT of resource NAME on NPU DEVICE (every NPU if none; "
        "the largest count given for a global resource). Given any, a resource none names counts 0; given none, "
        "each counts the most any instance needs.",
    )
    parser.add_argument(
        "--cache_config",
        action="append",
        default=[],
        metavar="local,size=BYTES",
        help="A response cache of this many bytes (Triton's --cache-config), used by the models whose config.pbtxt "
        "says response_cache { enable: true }: a request equal to one answered before is answered again without "
        "running the model. Without it such models serve uncached, as in Triton.",
    )
    parser.add_argument(
        "--enable_tracing",
        action="store_true",
        help="OpenTelemetry spans of queue, batch and execution (exporter from the OTEL_* environment): "
        "--trace_config mode=opentelemetry with level TIMESTAMPS unless --trace_config gives one.",
    )
    traces.add_flag(parser)
    return parser


def rate_limit_resource(value: str) -> tuple[str, int, int]:
    try:
        return parse_resource(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def rate_limiter(args: argparse.Namespace) -> RateLimiter | None:
    """The server's rate limiter, which the engine's repository shares among every model (None: --rate_limit off)."""
    return RateLimiter(args.rate_limit_resource) if args.rate_limit == "execution_count" else None


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return seconds


def positive_megabytes(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of MB, got {value}")
    return number


def repository(args: argparse.Namespace) -> Repository:
    """The model repository the flags describe: its response cache, rate limiter, memory budget and loading on demand."""
    ledger = Ledger(args.memory_budget_mb, device_memory)
    pinned = [name for name in args.load_model if name != "*"]
    return Repository(
        Path(args.model_dir), response_cache(args), rate_limiter(args), ledger, load_on_demand=args.load_on_demand, pinned=pinned
    )


def byte_count(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {value}")
    return number


def _log_like_kserve(log_format: str, access_log: bool = False) -> None:
    """This package logs through the handlers KServe configured, at INFO; every line names its request.

    uvicorn writes an access line per request while its logger has a handler, so without
    `access_log` the logger has none (and passes nothing on to the root's).
    """
    ascend = logging.getLogger("kserve_ascend")
    ascend.setLevel(logging.INFO)
    ascend.propagate = False  # written once, by KServe's handlers, not again by the root's (json)
    for handler in kserve_seam.log_handlers():
        ascend.addHandler(handler)
    if not access_log:
        access = logging.getLogger("uvicorn.access")
        access.handlers, access.propagate = [], False
    logs.configure(log_format)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.config:
        # The file's ports and models become defaults: flags given on the command line still win.
        parser.set_defaults(**cann_config.parser_defaults(known.config))
    args = parser.parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl_certfile and --ssl_keyfile go together: they secure the REST and the gRPC port")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    try:
        traces.manager_of(args.trace_config, args.enable_tracing)
    except ValueError as error:
        parser.error(str(error))
    if args.workers > 1 and not (hasattr(os, "memfd_create") and hasattr(socket, "SO_REUSEPORT")):
        parser.error("--workers N > 1 needs Linux: its frontends share memfd shared memory and SO_REUSEPORT ports")
    try:
        response_cache(args)
    except ValueError as error:
        parser.error(f"--cache_config: {error}")
    return args


def response_cache(args: argparse.Namespace) -> ResponseCache | None:
    """The response cache `--cache_config` asks for (in the process that holds the models), if any."""
    return ResponseCache.parse(args.cache_config) if args.cache_config else None


@dataclass(frozen=True)
class EdgeSettings:
    """What the edges are made of beyond KServe's own settings: the same in the one process and in every frontend."""

    grpc_options: tuple[tuple[str, int], ...]
    http_max_input_size: int
    authenticator: Authenticator | None


def edge_settings(args: argparse.Namespace) -> EdgeSettings:
    return EdgeSettings(
        grpc_options=(
            ("grpc.max_send_message_length", args.grpc_max_send_message_length),
            ("grpc.max_receive_message_length", args.grpc_max_receive_message_length),
        ),
        http_max_input_size=args.http_max_input_size,
        authenticator=Authenticator.from_files(
            args.auth_token_file, args.auth_jwt_public_key, args.auth_jwt_issuer, args.auth_jwt_audience
        ),
    )


def kserve_options(args: argparse.Namespace) -> dict:
    """kserve.ModelServer's settings, from its flags."""
    return dict(
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
        # stop only once the models have drained, and get what is left of it (`lifecycle`).
        grace_period=args.shutdown_timeout_s,
    )


def configure_process(args: argparse.Namespace) -> traces.TraceManager:
    """Logging and tracing as the flags ask, in the one process, the engine and every frontend; the trace settings
    (what the process serving the models keeps)."""
    _log_like_kserve(args.log_format, args.enable_access_log)
    trace_manager = traces.manager_of(args.trace_config, args.enable_tracing)
    if trace_manager.mode == "opentelemetry":
        tracing.enable()  # the exporter, set up once: the trace level switches the spans on and off
        tracing.enabled = trace_manager.spans_on
    return trace_manager


def run_event_loop(args: argparse.Namespace, main: Coroutine) -> None:
    """Runs `main` to its end on the event loop KServe's `--event-loop` names: the one process, the engine
    and every frontend of `--workers N` serve on it.

    "auto", KServe's default, is uvloop where it is installed (kserve installs it, through uvicorn's
    standard extra), as uvicorn chooses; KServe itself honours the flag only in its multi-process
    server. On uvloop a small JSON request costs about a sixth less server CPU (docs/performance.md).
    """
    uvloop = _uvloop(args.event_loop)
    log.info("event loop: %s", "uvloop" if uvloop is not None else "asyncio")
    (uvloop.run if uvloop is not None else asyncio.run)(main)


def _uvloop(choice: str) -> ModuleType | None:
    """The uvloop module if `choice` ("auto", "asyncio" or "uvloop") asks for it and it is installed."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("kserve-ascend: --event-loop uvloop, but uvloop is not installed") from None
        return None
    return uvloop


def warn_ignored(args: argparse.Namespace) -> None:
    """A WARNING for each KServe flag given that this server has no use for."""
    for dest, reason in IGNORED_KSERVE_FLAGS.items():
        if hasattr(args, dest):
            log.warning("--%s is ignored: %s", dest, reason)



"""Every use of kserve's internals, in one place: where this server leans on what kserve does not promise.

The rest of the package uses kserve's public API only (`kserve.ModelServer`, `kserve.Model`,
`kserve.ModelRepository`, the `InferRequest` types, `model_server.parser` as a parent parser,
as KServe's own custom-server examples do), and imports kserve from here. `missing()` lists
what of kserve's insides this module relies on and a kserve release no longer has;
tests/test_kserve_seam.py runs it, and drives each piece below against the installed kserve.

What is leaned on, and why:
- import: kserve and tritonclient both register protobuf package `inference` in the default
  descriptor pool under different file names, so importing both fails with "duplicate symbol
  'inference.ServerLiveRequest'" (kserve/kserve#3099). Triton's grpc_service.proto is a superset
  of KServe's grpc_predict_v2.proto on the same wire, so this process loads Triton's and points
  kserve's module name at it, before kserve is imported. And kserve parses `sys.argv` when
  imported, abbreviations allowed, and would take `--config` (the CANN config.yaml) for its own
  `--configure_logging`: it is imported with the command line minus that flag.
- flags: KServe's parser, with the flags this server ignores hidden (argparse offers no public way).
- the REST server: KServe's `RESTServer` (uvicorn with KServe's routes and TLS reload), served
  with this project's app in front, on a socket given or its own port, and stopped when the
  lifecycle says (not on uvicorn's own signal handling).
- logging: the handlers KServe configured on its logger, as its ModelServer configures them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from typing import Callable

from tritonclient.grpc import service_pb2 as _triton_service_pb2

sys.modules.setdefault("kserve.protocol.grpc.grpc_predict_v2_pb2", _triton_service_pb2)

_config_flag = argparse.ArgumentParser(prog="kserve-ascend", add_help=False, allow_abbrev=False)
_config_flag.add_argument("--config")
_argv, sys.argv = sys.argv, sys.argv[:1] + _config_flag.parse_known_args(sys.argv[1:])[1]
try:
    import kserve
    from kserve import model_server
    from kserve.constants import constants as kserve_constants
    from kserve.protocol.rest import server as kserve_rest
finally:
    sys.argv = _argv

from starlette.types import ASGIApp  # noqa: E402

def missing() -> list[str]:
    """What this module relies on that the installed kserve (or uvicorn) no longer has, named."""
    rest = kserve_rest.RESTServer(kserve_constants.FASTAPI_APP_IMPORT_STRING, None, None, 0)
    relied_on = {
        "kserve.model_server.parser": (model_server, "parser"),
        "kserve.model_server.app": (model_server, "app"),
        "kserve.constants.constants.FASTAPI_APP_IMPORT_STRING": (kserve_constants, "FASTAPI_APP_IMPORT_STRING"),
        "kserve.protocol.rest.server.RESTServer.create_application": (rest, "create_application"),
        "kserve.protocol.rest.server.RESTServer().config": (rest, "config"),
        "kserve.protocol.rest.server.RESTServer()._server": (rest, "_server"),
        "uvicorn.Server().capture_signals": (getattr(rest, "_server", None), "capture_signals"),
        "uvicorn.Server().serve": (getattr(rest, "_server", None), "serve"),
        "uvicorn.Server().should_exit": (getattr(rest, "_server", None), "should_exit"),
        "uvicorn.Server().started": (getattr(rest, "_server", None), "started"),
        "uvicorn.Config().timeout_graceful_shutdown": (getattr(rest, "config", None), "timeout_graceful_shutdown"),
        "argparse.ArgumentParser()._actions": (model_server.parser, "_actions"),
    }
    return [name for name, (owner, attribute) in relied_on.items() if not hasattr(owner, attribute)]


def parser(hidden: dict[str, str]) -> argparse.ArgumentParser:
    """KServe's flags as a parent parser, those in `hidden` (by dest) left out of --help.

    A hidden flag is still accepted (ServingRuntimes written for KServe's servers pass some), and
    appears in the namespace only when given (its default is SUPPRESS).
    """
    kserve_flags = model_server.parser
    for action in kserve_flags._actions:  # argparse has no public way to hide an inherited flag
        if action.dest in hidden:
            action.help = action.default = argparse.SUPPRESS
    return kserve_flags


def http_port(port: int, ssl_certfile: str | None, ssl_keyfile: str | None) -> int:
    """The HTTP port KServe's ModelServer listens on for these flags: with TLS, its default 8080 becomes 8443.

    Asked of a ModelServer made for the purpose, which also configures KServe's logging as its
    server does (unless `--configure_logging` is off or a handler is set): the engine of
    `--workers N` makes no other, and this package logs through KServe's handlers.
    """
    return kserve.ModelServer(http_port=port, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, enable_grpc=False).http_port


def log_handlers() -> list[logging.Handler]:
    """The handlers KServe configured (its `configure_logging`): this package logs through them too."""
    return list(logging.getLogger("kserve").handlers)


class RestServer:
    """KServe's REST server (uvicorn, KServe's routes and its TLS reload) serving `app(kserve_app)` in front of
    KServe's app, until `stop`. `server`: the kserve.ModelServer whose settings and registry it serves."""

    def __init__(self, server: kserve.ModelServer, app: Callable[[ASGIApp], ASGIApp]):
        self._rest = kserve_rest.RESTServer(
            kserve_constants.FASTAPI_APP_IMPORT_STRING,
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
        self._rest.create_application()  # KServe's routes on its app, as its start() adds them
        self._rest.config.app = app(model_server.app)
        self._uvicorn = self._rest._server
        # uvicorn would take SIGTERM and SIGINT for itself and close its port at once: the lifecycle stops it
        # once the models have drained (`stop`), refusing new requests with 503 meanwhile.
        self._uvicorn.capture_signals = contextlib.nullcontext

    async def serve(self, sock: socket.socket | None = None) -> None:
        """Serves until stopped: on `sock` if given (a frontend's, made by the engine), else on its own port."""
        await self._uvicorn.serve(sockets=[sock] if sock is not None else None)

    @property
    def started(self) -> bool:
        return self._uvicorn.started

    def listening_sockets(self) -> list:
        """The sockets uvicorn listens on (asyncio's TransportSockets), once it serves (uvicorn.Server().servers, set
        as it starts: tests/test_kserve_seam.py reads it from a serving one)."""
        return [sock for server in self._uvicorn.servers for sock in server.sockets]

    def stop(self, grace: float) -> None:
        """Stops accepting; the requests accepted get `grace` seconds to be answered, then are cancelled."""
        self._uvicorn.config.timeout_graceful_shutdown = grace
        self._uvicorn.should_exit = True


__all__ = ["RestServer", "http_port", "kserve", "log_handlers", "missing", "parser"]

"""The KServe ModelServer of kserve-ascend: KServe's server, flags and registry, with this project's REST and
gRPC edges over a data plane. The one process runs one over its local data plane; each frontend of
`--workers N` runs one over the engine's (`workers.remote`).
"""

from __future__ import annotations

import asyncio
import logging
import socket

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import listeners
from .cli import EdgeSettings
from .dataplane import DataPlane
from .edges import rest
from .edges.auth import GrpcAuthentication
from .edges.grpc import CertificateFiles, GrpcServer
from .edges.kserve_model import ModelRegistry
from .kserve_seam import RestServer, kserve

log = logging.getLogger(__name__)


class AscendModelServer(kserve.ModelServer):
    """Serves `dataplane` over REST (the OIP routes and /metrics before KServe's app) and gRPC until `stop`.

    KServe's registry lists the data plane's models (`ModelRegistry`), for its V1 routes.
    """

    def __init__(self, dataplane: DataPlane, settings: EdgeSettings, **kserve_options):
        super().__init__(registered_models=ModelRegistry(dataplane), **kserve_options)
        self.ascend_dataplane = dataplane
        self.settings = settings
        self.rest: RestServer | None = None
        self.grpc: GrpcServer | None = None

    async def serve(self, http_socket: socket.socket | None = None) -> None:
        """Serves until stopped. The one process binds both ports itself, the gRPC port exclusively (no other
        process can bind it beside ours, which grpcio's default SO_REUSEPORT would allow); a frontend serves the
        HTTP socket the engine made for it and binds the gRPC port with SO_REUSEPORT beside the other frontends
        (grpcio takes no socket)."""
        dataplane, settings = self.ascend_dataplane, self.settings
        self.setup_event_loop()  # KServe's executor size and exception handler, on this loop
        self.rest = RestServer(
            self,
            lambda kserve_app: ClosesWhenStopping(
                rest.application(dataplane, kserve_app, settings.http_max_input_size, settings.authenticator), dataplane
            ),
        )
        serving = [self.rest.serve(http_socket)]
        if self.enable_grpc:
            self.grpc = GrpcServer(
                self.grpc_port,
                dataplane,
                [*settings.grpc_options, ("grpc.so_reuseport", int(http_socket is not None))],
                credentials=_grpc_credentials(self.ssl_certfile, self.ssl_keyfile),
                interceptors=[GrpcAuthentication(settings.authenticator)] if settings.authenticator else [],
            )
            serving.append(self.grpc.start())
        await asyncio.gather(*serving)

    async def listening(self) -> None:
        """Returns once the REST edge listens (uvicorn has said so; the gRPC edge starts with it)."""
        while self.rest is None or not self.rest.started:
            await asyncio.sleep(0.05)

    def shutting_down(self) -> None:
        """Nothing to do: the REST edge reads `dataplane.stopping` (`ClosesWhenStopping`)."""

    async def stop_serving(self, grace: float) -> None:
        """Stops accepting with nothing left queued on the HTTP port (`listeners`: closing a listening socket resets
        the connections queued on it), then stops the edges, all within `grace` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if self.rest is not None:
            await listeners.drain(self.rest.listening_sockets(), grace / 2)
        self.stop_edges(max(deadline - loop.time(), 0))

    def stop_edges(self, grace: float) -> None:
        """Both edges stop accepting; what they accepted gets `grace` seconds to be answered, then is cancelled."""
        if self.rest is not None:
            self.rest.stop(grace)
        if self.grpc is not None:
            asyncio.get_running_loop().create_task(self.grpc.stop(grace))


class ClosesWhenStopping:
    """The REST app, whose every answer closes its connection (`Connection: close`) once the server is
    shutting down (`dataplane.stopping`), as a draining proxy does.

    The client's next request then goes out on a new connection: to another replica, through
    a balancer, or refused outright once this server stops listening. On a kept-alive
    connection it could meet the server closing that connection as it arrives, which the
    client cannot tell from a request lost (HTTP/1.1's keep-alive race, RFC 9112 §9.3.1).
    """

    def __init__(self, app: ASGIApp, dataplane: DataPlane):
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


def _grpc_credentials(certfile: str | None, keyfile: str | None):
    """TLS with REST's certificate and key (both or neither, checked by the flags), reloaded when they change."""
    if not certfile:
        return None
    try:
        return CertificateFiles(certfile, keyfile).credentials()
    except OSError as error:
        raise SystemExit(f"kserve-ascend: cannot read the TLS certificate or key: {error}") from None

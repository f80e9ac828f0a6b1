"""A frontend process of `--workers N`: the REST and gRPC edges, over the engine's data plane.

It runs what the one-process server runs in front of its data plane, unchanged: uvicorn
with KServe's routes behind the OIP ones, the gRPC service, TLS, authentication, parsing
and the protocol's checks, decoding, encoding, compression. Every decoded request crosses
to the engine (`remote.RemoteDataPlane`), which checks it against the version it picks
(A/B weights and reloads decide that there, atomically), prepares it and batches it with
the other frontends' requests.

It stops when the engine says so (once the engine has answered every request it accepted),
or on SIGTERM (the engine then starts another): uvicorn and gRPC stop accepting, answer what
they accepted, and the process exits. SIGINT, which a terminal's Ctrl+C sends the whole
process group, is the engine's to act on. If the engine is gone, it stops at once: nothing
it accepted can be answered any more.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

import kserve

from . import metrics, offload
from .remote import RemoteDataPlane, RemoteModelRepository

log = logging.getLogger(__name__)


def run(args: argparse.Namespace, index: int, channel: socket.socket, calls: socket.socket, http_socket: socket.socket) -> None:
    """The frontend process's entry (multiprocessing `spawn`): serves until stopped."""
    from . import app  # the flags' meaning, as the one-process server reads them

    frontend = FrontendServer(index, channel, calls, http_socket, **app.server_options(args))
    app.configure_process(args)  # after KServe's ModelServer, which configures logging if nothing has yet
    try:
        asyncio.run(frontend.serve())
    finally:
        offload.stop()


class FrontendServer(kserve.ModelServer):
    """KServe's ModelServer in a frontend: its registry asks the engine, its edges serve the engine's data plane."""

    def __init__(self, index: int, channel: socket.socket, calls: socket.socket, http_socket: socket.socket,
                 grpc_options, http_max_input_size, authenticator, **kwargs):
        self.index = index
        self.remote = RemoteDataPlane(channel, calls, self.stop_serving)
        self.http_socket = http_socket
        self.grpc_options = grpc_options
        self.http_max_input_size = http_max_input_size
        self.authenticator = authenticator
        super().__init__(registered_models=RemoteModelRepository(self.remote), **kwargs)
        self._stopping = False

    async def serve(self) -> None:
        from .app import serve_edges

        loop = asyncio.get_running_loop()
        self.setup_event_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop_serving, False)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the engine drains, then tells this frontend to stop
        self.remote.start()
        metrics.serve_from_engine(self.remote.metric_families)
        rest, *grpc = [asyncio.create_task(edge) for edge in serve_edges(self, self.remote, self.http_socket)]
        uvicorn = self._rest_server._server
        while not uvicorn.started and not rest.done():
            await asyncio.sleep(0.05)
        if not uvicorn.started or any(task.done() for task in grpc) and not self._stopping:
            await asyncio.gather(rest, *grpc)  # what stopped it: a port it could not bind, a certificate it could not read
            raise SystemExit(f"kserve-ascend: frontend {self.index} did not start")
        self.remote.channel.send(["serving"])
        try:
            await rest  # until told to stop: then uvicorn answers what it accepted
            if self._grpc_server is not None:
                await self._grpc_server.stop()  # and gRPC, which stopped accepting with it
            await asyncio.gather(*grpc)
        finally:
            self.remote.close()

    def stop_serving(self, now: bool) -> None:
        """Stops accepting and answers what was accepted; `now`: the engine is gone, so what is in flight has
        failed (503), and the edges only write those answers, rather than wait for the grace period."""
        from .app import EDGES_STOP_S, stop_edges

        if self._stopping and not now:
            return
        self._stopping = True
        stop_edges(self, EDGES_STOP_S if now else self.grace_period)

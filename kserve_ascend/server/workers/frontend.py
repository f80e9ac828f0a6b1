"""A frontend process of `--workers N`: the REST and gRPC edges, over the engine's data plane.

It runs what the one-process server runs in front of its data plane, unchanged
(`model_server.AscendModelServer`: uvicorn with KServe's routes behind the OIP ones, the gRPC
service, TLS, authentication, decoding, encoding, compression), over `remote.RemoteDataPlane`:
every decoded request crosses to the engine, which checks it against the version it picks
(A/B weights and reloads decide that there, atomically) and batches it with the other
frontends' requests.

It stops when the engine says so (once the engine has answered every request it accepted),
or on SIGTERM (the engine then starts another): the edges stop accepting, answer what they
accepted, and the process exits. SIGINT, which a terminal's Ctrl+C sends the whole process
group, is the engine's to act on. If the engine is gone, it stops at once: nothing it
accepted can be answered any more.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from ...core import heap
from .. import cli
from ..edges import offload
from ..lifecycle import EDGES_STOP_S
from ..model_server import AscendModelServer
from . import messages
from .remote import RemoteDataPlane

log = logging.getLogger(__name__)


def run(args: argparse.Namespace, index: int, sock: socket.socket, http_socket: socket.socket) -> None:
    """The frontend process's entry (multiprocessing `spawn`): serves until stopped."""
    frontend = Frontend(args, index, sock, http_socket)
    cli.configure_process(args)  # after KServe's ModelServer, which configures logging if nothing has yet
    try:
        cli.run_event_loop(args, frontend.serve())
    finally:
        offload.stop()


class Frontend:
    def __init__(self, args: argparse.Namespace, index: int, sock: socket.socket, http_socket: socket.socket):
        self.index = index
        self.http_socket = http_socket
        self.remote = RemoteDataPlane(sock, self.stop)
        self.server = AscendModelServer(self.remote, cli.edge_settings(args), **cli.kserve_options(args))
        self._stopping = False

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop, False)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the engine drains, then tells this frontend to stop
        self.remote.start()
        serving = asyncio.create_task(self.server.serve(self.http_socket))
        listening = asyncio.ensure_future(self.server.listening())
        await asyncio.wait([serving, listening], return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if serving.done() and not self._stopping:
            await serving  # what stopped it: a port it could not bind, a certificate it could not read
            raise SystemExit(f"kserve-ascend: frontend {self.index} did not start")
        heap.settle(f"frontend {self.index} serving")
        self.remote.channel.send(messages.Serving())
        try:
            await serving  # until told to stop: then the edges answer what they accepted
        finally:
            self.remote.close()

    def stop(self, now: bool) -> None:
        """Stops accepting and answers what was accepted; `now`: the engine is gone, so what is in flight has
        failed (503), and the edges only write those answers, rather than wait for the grace period."""
        if self._stopping and not now:
            return
        self._stopping = True
        self.server.stop_edges(EDGES_STOP_S if now else self.server.grace_period)

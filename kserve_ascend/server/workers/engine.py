"""`--workers N`: this process owns the NPUs; N frontend processes speak the protocols.

The engine holds what must exist once per pod: the repository and its lifecycle (poll and
explicit control), every version's batcher and instances (so one queue per version batches
the requests of every frontend), the statistics and metrics, and the system shared memory
registry. It serves no HTTP or gRPC itself. It starts N frontends (`frontend.run`) and serves
each over a Unix socket (`link.FrontendLink`: typed `messages`; tensors cross in shared
memory, `arena`).

Ports: the engine makes one HTTP listening socket per frontend, bound with SO_REUSEPORT so
the kernel spreads connections over the frontends, and keeps them: a frontend that dies is
started again on the same socket, so connections waiting for it are served, not reset.
grpcio cannot serve a socket it is given, so each frontend binds the gRPC port itself,
with `grpc.so_reuseport`. Before anything binds, `main` checks that no other process holds
a port (`ports`: an exclusive bind), so the group is this server's frontends alone (Linux
admits only sockets of the same user to it; the one-process server binds the gRPC port
exclusively).

Shutdown goes as in one process (`lifecycle`), the frontends being the edges: they go on
accepting and answer new requests 503 while the engine answers every request it accepted;
then the engine holds new connections off the HTTP sockets, waits until the frontends have
accepted every connection queued on them (`listeners`: Linux resets those still queued when a
socket closes), closes its copies and tells every frontend to stop: each stops accepting,
writes the answers it has, and exits; then the engine releases the models and exits. A
frontend that exits otherwise is started again (its clients' connections fail; the other
frontends serve on); one that cannot start at all stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import socket
import tempfile
from typing import Any, Callable

from ...core import tracing
from ...core.models.repository import Repository
from .. import cli, listeners, ports
from ..dataplane.local import LocalDataPlane
from ..lifecycle import STOP_SIGNALS, Lifecycle
from ..observability import logs, metrics, traces
from . import messages
from .control import MODELS, REGIONS, ControlPage
from .link import FrontendLink
from .supervisor import FrontendProcess

log = logging.getLogger(__name__)


class Engine:
    """Serves `repository` with `args.workers` frontends on `http_port`."""

    def __init__(self, args: argparse.Namespace, repository: Repository, http_port: int, trace_manager: traces.TraceManager):
        self.args = args
        self.traces = trace_manager
        self.repository = repository
        self.http_port = http_port
        self.control = ControlPage.create()
        self.frontends: list[FrontendProcess] = []
        self.http_sockets: list[socket.socket] = []
        self.failed = False
        self._models_generation = 0

    @property
    def stopping(self) -> bool:
        return self.dataplane.stopping

    def run(self) -> None:
        # KServe's histograms, counted in the frontends, summed by the engine (prometheus_client's multiprocess mode).
        metrics_dir = tempfile.mkdtemp(prefix="kserve-ascend-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each frontend as it starts
        try:
            registry = metrics.engine_registry(self.repository, metrics_dir, self.args.metrics_port)
            self.dataplane = EngineDataPlane(self, registry)
            self.lifecycle = Lifecycle(
                self.dataplane, self.args.model_control_mode, self.args.load_model, self.args.shutdown_timeout_s
            )
            self.repository.on_change = self.models_changed
            cli.run_event_loop(self.args, self._serve())
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if self.failed:
            raise SystemExit(1)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.lifecycle.shut_down, self)
        self.http_sockets = listening_sockets(self.http_port, self.args.workers)
        self.frontends = [FrontendProcess(self, index) for index in range(self.args.workers)]
        for member in self.frontends:
            member.start()
        loading = asyncio.create_task(self.lifecycle.run(asyncio.gather(*(member.served.wait() for member in self.frontends))))
        await self.lifecycle.stopped.wait()
        await asyncio.gather(*(member.exited.wait() for member in self.frontends))
        loading.cancel()
        # Every frontend has answered what it accepted: nothing is in flight, the models go.
        self.lifecycle.close()
        log.info("engine stopped")

    # ------------------------------------------------------------ the frontends are the edges

    def shutting_down(self) -> None:
        """Their REST answers close their connections from now on."""
        self._broadcast(messages.Stopping())

    async def stop_serving(self, grace: float) -> None:
        """Stops accepting, with nothing left queued (`listeners`: closing resets what is), then every frontend (the
        HTTP sockets close once the frontends close theirs)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await listeners.drain(self.http_sockets, grace / 2)
        for sock in self.http_sockets:
            sock.close()
        for member in self.frontends:
            member.stop(deadline)

    def link(self, sock: socket.socket, serving: Callable[[], None]) -> FrontendLink:
        """Serves a new frontend: first what it must know before it serves."""
        link = FrontendLink(self.dataplane, sock, serving)
        link.start([
            (messages.Control(self.control.SIZE), self.control.share()),
            (self.regions_message(), None),
            (self.models_message(), None),
            (messages.LogSettings(logs.settings()), None),
            *([(messages.TraceSpans(tracing.enabled), None)] if self.traces.mode == "opentelemetry" else []),
        ])
        return link

    def frontend_failed(self, member: FrontendProcess) -> None:
        log.error("frontend %d could not start: stopping the server", member.index)
        self.failed = True
        self.lifecycle.shut_down(self)

    # ------------------------------------------------------------ what every frontend follows

    def models_message(self) -> messages.ModelsChanged:
        return messages.ModelsChanged(self._models_generation, list(self.repository.models))

    def regions_message(self) -> messages.Regions:
        regions = self.dataplane.regions
        return messages.Regions(regions.changes, [messages.Region(*entry) for entry in regions.registrations()])

    def models_changed(self) -> None:
        """The repository changed (a model loaded, unloaded or unavailable): frontends drop what they cached."""
        self._models_generation += 1
        self._follow(MODELS, self._models_generation, self.models_message())

    def regions_changed(self) -> None:
        """A region was registered or unregistered: every frontend maps what the registry holds now."""
        self._follow(REGIONS, self.dataplane.regions.changes, self.regions_message())

    def log_settings_changed(self, settings: dict[str, Any]) -> None:
        """A client changed the log settings (applied here): every frontend applies them too."""
        self._broadcast(messages.LogSettings(settings), flush=True)

    def trace_spans_changed(self) -> None:
        """A client changed the trace level (opentelemetry mode): every frontend's edges start spans, or not."""
        self._broadcast(messages.TraceSpans(tracing.enabled), flush=True)

    def _follow(self, count: int, value: int, message: messages.Message) -> None:
        # The message first, then the count that tells a frontend to read it (see `control`).
        self._broadcast(message, flush=True)
        self.control.count(count, value)

    def _broadcast(self, message: messages.Message, flush: bool = False) -> None:
        for member in self.frontends:
            member.send(message)
            if flush and member.link is not None:
                member.link.channel.flush()

    def read_frontends(self) -> None:
        """Handles what every frontend has sent so far, before statistics are read.

        A frontend reports a request done (`messages.Done`) before it writes the answer, so a
        client that asks any frontend for statistics after its answer finds the request counted.
        """
        for member in self.frontends:
            if member.link is not None:
                member.link.channel.drain()


class EngineDataPlane(LocalDataPlane):
    """The engine's data plane, which the frontends forward to: ready once every frontend serves too; statistics
    and metrics count what the frontends have reported; a change of the shared memory registry reaches them all."""

    def __init__(self, engine: Engine, metrics_registry):
        super().__init__(engine.repository, engine.args.model_control_mode == "explicit", metrics_registry, engine.traces)
        self.engine = engine

    async def ready(self) -> bool:
        # Also every frontend, at start-up: a client that waits for readiness then finds each of them accepting.
        return await super().ready() and all(member.served.is_set() for member in self.engine.frontends)

    async def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        self.engine.read_frontends()
        return await super().statistics(name, version)

    async def metrics(self) -> bytes:
        self.engine.read_frontends()
        return await super().metrics()

    async def log_settings(self, changes: dict[str, Any] | None = None) -> dict[str, Any]:
        # Applied here, then in every frontend before the one that asked has its answer (the same channel, in order).
        settings = await super().log_settings(changes)
        if changes:
            self.engine.log_settings_changed(settings)
        return settings

    async def trace_settings(self, model: str = "", changes: dict[str, Any] | None = None) -> dict[str, Any]:
        # The engine samples and writes Triton's traces; OpenTelemetry's start in the frontends' edges.
        settings = await super().trace_settings(model, changes)
        if changes and self.traces.mode == "opentelemetry":
            self.engine.trace_spans_changed()
        return settings

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await super().shm_register(name, key, offset, byte_size)
        self.engine.regions_changed()

    async def shm_unregister(self, name: str = "") -> None:
        await super().shm_unregister(name)
        self.engine.regions_changed()


def listening_sockets(port: int, count: int) -> list[socket.socket]:
    """`count` HTTP sockets on `port`, one per frontend, bound with SO_REUSEPORT (listening once their frontend serves)."""
    sockets = []
    for _ in range(count):
        # IPPROTO_TCP named, as uvicorn names it: asyncio sets TCP_NODELAY on accepted connections only then.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(("0.0.0.0", port))  # as uvicorn binds KServe's host
        except OSError as error:  # main found it free: another process took it since
            sock.close()
            ports.refuse(port, ports.HTTP, error)
        sock.set_inheritable(True)
        sockets.append(sock)
    return sockets

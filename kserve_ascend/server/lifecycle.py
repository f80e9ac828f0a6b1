"""The models' lifecycle, owned once per pod: the start-up load, poll mode's watch, the drain at
shutdown and the release of the devices. The one-process server and the engine of `--workers N`
each own one, and shut down through it (`shut_down`), with their own edges.

Shutdown (SIGTERM, SIGINT, SIGQUIT), within --shutdown_timeout_s: the data plane turns unready
and refuses new inferences at once (503 / UNAVAILABLE), the edges are told (answers close their
connections from then on), every request accepted is answered (or, at the deadline, failed with
503), then the edges stop accepting and get what is left of the timeout to write their answers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable
from typing import Protocol

from ..core import heap
from ..core.errors import AscendError, Unavailable
from ..core.models.repository import Repository
from .dataplane import SHUTTING_DOWN
from .dataplane.local import LocalDataPlane

log = logging.getLogger(__name__)

#: What stops the server, as Kubernetes (SIGTERM), a terminal (SIGINT) and KServe's own server (SIGQUIT) do.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
#: Of --shutdown_timeout_s, what the edges keep after the drain (at most half of it): time to write the
#: answers of the requests failed at the drain's end and to close their connections.
EDGES_STOP_S = 1.0


class Edges(Protocol):
    """What serves the data plane's clients: the one process's REST and gRPC servers, or the frontends."""

    def shutting_down(self) -> None:
        """Shutdown has begun: answers close their connections from now on (new requests are refused)."""

    async def stop_serving(self, grace: float) -> None:
        """Stop accepting, and answer what was accepted, within `grace` seconds."""


class Lifecycle:
    """Loads, watches, drains and closes the models of `dataplane`'s repository.

    `control_mode` is Triton's: none loads the repository once, poll follows its changes on
    disk, explicit loads `startup_models` ('*': all) and then what the repository extension asks.
    With the repository's `load_on_demand`, only `startup_models` load at start (pinned), the
    others when a request asks for them.
    """

    def __init__(
        self, dataplane: LocalDataPlane, control_mode: str, startup_models: list[str], shutdown_timeout_s: float
    ):
        self.dataplane = dataplane
        self.repository: Repository = dataplane.repository
        self.control_mode = control_mode
        self.startup_models = startup_models
        self.shutdown_timeout_s = shutdown_timeout_s
        self._watching = asyncio.Event()  # set to end poll mode's watch, so shutdown is not held up by it
        self._shutdown: asyncio.Task | None = None
        self.stopped = asyncio.Event()

    async def run(self, listening: Awaitable[object] | None = None) -> None:
        """The start-up load, then (poll mode) the repository followed until shutdown begins. Once the models are
        loaded and the edges `listening`, the ready line: the last a user sees at start."""
        following = None
        if self.control_mode == "poll":
            # Watching before the load, not after the ready line: a model copied in as soon as the server answered
            # ready (with `--workers N`, one frontend may serve while the others start) was missed. The sleep lets
            # the task take its first step, which starts the watch (watchfiles' awatch opens it before suspending).
            following = asyncio.get_running_loop().create_task(self._follow())
            await asyncio.sleep(0)
        names = list(self.repository.models)
        if (self.control_mode == "explicit" or self.repository.load_on_demand) and "*" not in self.startup_models:
            names = self.startup_models  # on demand, the others load when a request asks for them
        # All LOADING at once: one waiting for its turn must not show in the index as unloaded meanwhile.
        for name in names:
            if name in self.repository.models:
                self.repository.models[name].mark_loading()
        for name in names:
            try:
                await self.repository.load(name, reason="startup")
            except AscendError as error:  # the model's reason is in the index; the others load
                log.error("model '%s' did not load: %s", name, error)
        self.dataplane.loaded = True
        heap.settle("repository loaded")
        if listening is not None:
            await listening
        log.info("repository loaded, serving: %s", {m.name: m.state.value for m in self.repository.models.values()})
        if following is not None:
            await following  # until shutdown begins

    async def _follow(self) -> None:
        async for _ in self.repository.follow(self._watching):
            pass

    def shut_down(self, edges: Edges) -> None:
        """Begins the shutdown, once (on the loop); `stopped` is set once the edges are told to stop."""
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(self._shut_down(edges))

    async def _shut_down(self, edges: Edges) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.shutdown_timeout_s
        deadline = loop.time() + timeout
        log.info("shutting down: unready, refusing new requests, answering those accepted within %g s", timeout)
        self._watching.set()
        self.dataplane.stopping = True
        edges.shutting_down()
        try:
            await self.drain(timeout - min(EDGES_STOP_S, timeout / 2))
        except Exception:  # a fault of the drain must not keep the server from stopping
            log.exception("draining the models failed: stopping now")
        await edges.stop_serving(max(deadline - loop.time(), 0))
        self.stopped.set()

    async def drain(self, timeout_s: float) -> None:
        """Waits until every request accepted has been answered, `timeout_s` at most; then fails what is
        left (queued or executing) with Unavailable, for the edges to answer it before they stop."""
        versions = [v for model in list(self.repository.models.values()) for v in list(model.versions.values())]
        waiting = sum(v.scheduler.outstanding for v in versions)
        if not waiting:
            return
        log.info("answering the %d requests accepted before shutdown (%g s at most)", waiting, timeout_s)
        try:
            await asyncio.wait_for(asyncio.gather(*(v.scheduler.drain() for v in versions)), max(timeout_s, 0))
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            left = Unavailable(f"{SHUTTING_DOWN}: the request was not answered within the shutdown timeout")
            log.error("%d requests were not answered within the shutdown timeout: failing them",
                      sum(v.scheduler.outstanding for v in versions))
            for version in versions:
                version.abandon(left)

    def close(self) -> None:
        """Releases every model's devices and the shared memory mapped (blocking; once nothing is in flight)."""
        for model in list(self.repository.models.values()):
            model.close()
        self.dataplane.close()

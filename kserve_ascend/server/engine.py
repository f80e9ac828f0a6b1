"""`--workers N`: this process owns the NPUs; N frontend processes speak the protocols.

The engine holds what must exist once per pod: the repository and its lifecycle (poll and
explicit control), every version's batcher and instances (so one queue per version
batches the requests of every frontend), the statistics and metrics, and the system
shared memory registry. It serves no HTTP or gRPC itself. It starts N frontends
(`frontend.run`, with multiprocessing's `spawn`: a fresh interpreter, never a fork of a
process that holds onnxruntime, ACL or gRPC state) and talks to each over two Unix
sockets (`ipc`): a channel for inferences and calls, and one for the calls its edges make
synchronously. Tensors cross in shared memory (`arena`).

Ports: the engine makes one HTTP listening socket per frontend, bound with SO_REUSEPORT so
the kernel spreads connections over the frontends, and keeps them: a frontend that dies is
started again on the same socket, so connections waiting for it are served, not reset.
grpcio cannot serve a socket it is given, so each frontend binds the gRPC port itself,
with `grpc.so_reuseport`. Before anything binds, `app.main` checks that no other process
holds a port (`ports`: an exclusive bind), so the group is this server's frontends alone
(Linux admits only sockets of the same user to it; the one-process server binds the gRPC
port exclusively).

Shutdown (SIGTERM, SIGINT, SIGQUIT), within --shutdown_timeout_s: the engine's data plane
turns unready and refuses new inferences at once, so the frontends go on accepting and
answer those 503 / UNAVAILABLE, while the engine answers every request it accepted (or,
at the deadline, fails what is left); then it holds new connections off the HTTP sockets,
waits until the frontends have accepted every connection queued on them (`listeners`:
Linux resets those still queued when a socket closes), closes its copies and tells every
frontend to stop: each stops accepting, writes the answers it has, and exits;
then the engine releases the models and exits. A frontend that exits otherwise is started
again (its clients' connections fail; the other frontends serve on); one that cannot
start at all stops the server.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import mmap
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from typing import Any

import numpy as np
from opentelemetry import context as otel_context
from opentelemetry import propagate

from ..core import datatypes
from ..core.errors import AscendError
from ..core.stats import RequestTiming, now_ns
from . import frontend, listeners, logs, metrics
from . import ports
from .app import EDGES_STOP_S
from .arena import Arena, Mapped, write
from .codec import InferRequest
from .ipc import Channel, error_reply

log = logging.getLogger(__name__)

SPAWN = multiprocessing.get_context("spawn")
#: A frontend that died is started again after this long (so one that cannot live does not spin).
RESTART_DELAY_S = 1.0


class Engine:
    """Runs `server` (an AscendModelServer: its repository, flags and start-up load) with `args.workers` frontends."""

    def __init__(self, server, args):
        self.server = server
        self.args = args
        self.dataplane = server.ascend_dataplane
        self.calls = Calls(self)
        self.frontends: list[Frontend] = []
        self.failed = False
        self.stopping = False
        self._stopped: asyncio.Event | None = None
        self._shutdown: asyncio.Task | None = None
        self._control = Control()

    def run(self) -> None:
        # KServe's histograms, counted in the frontends, summed by the engine (prometheus_client's multiprocess mode).
        metrics_dir = tempfile.mkdtemp(prefix="kserve-ascend-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each frontend as it starts
        try:
            self.registry = metrics.engine_registry(self.server.repository, metrics_dir, self.server.metrics_port)
            asyncio.run(self._serve())
        finally:
            self.dataplane.shm.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if self.failed:
            raise SystemExit(1)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.server.setup_event_loop()  # KServe's executor size and exception handler, on this loop
        self._stopped = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, self.stop)
        self.http_sockets = listening_sockets(self.server.http_port, self.args.workers)
        self.frontends = [Frontend(self, index) for index in range(self.args.workers)]
        for member in self.frontends:
            member.start()
        loading = asyncio.create_task(self.server.load_models())
        await self._stopped.wait()
        await asyncio.gather(*(member.exited.wait() for member in self.frontends))
        loading.cancel()
        # Every frontend has answered what it accepted: nothing is in flight, the models go.
        self.dataplane.close()
        log.info("engine stopped")

    def stop(self) -> None:
        """Begins the shutdown, once (see the module's doc)."""
        if self.stopping:
            return
        self.stopping = True
        self._shutdown = asyncio.get_running_loop().create_task(self._shut_down())

    async def _shut_down(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.server.grace_period  # --shutdown_timeout_s
        deadline = loop.time() + timeout
        log.info("shutting down: unready, refusing new requests, answering those accepted within %g s", timeout)
        self.server.stop_watching()
        self.dataplane.stop_accepting()
        for member in self.frontends:
            if member.connection is not None:
                member.connection.channel.send(["stopping"])  # their REST answers close their connections from now on
        try:
            await self.dataplane.drain(timeout - min(EDGES_STOP_S, timeout / 2))
        except Exception:  # a fault of the drain must not keep the server from stopping
            log.exception("draining the models failed: stopping now")
        # Stops accepting, with nothing left queued (listeners: closing resets what is), then every frontend
        # (the HTTP sockets close once the frontends close theirs).
        await listeners.drain(self.http_sockets, max(deadline - loop.time(), 0) / 2)
        for sock in self.http_sockets:
            sock.close()
        for member in self.frontends:
            member.stop(deadline)
        self._stopped.set()

    def read_frontends(self) -> None:
        """Handles what every frontend has sent so far, before statistics are read.

        A frontend reports a request done as it writes the answer, and its messages leave with
        its loop's iteration: before any call it makes (so a client that asks a frontend for
        statistics after an answer from it finds the request counted) and, through another
        frontend, as long as that iteration takes (microseconds unless it is busy serving).
        """
        for member in self.frontends:
            if member.connection is not None:
                member.connection.channel.drain()

    def shm_changed(self) -> None:
        """Every frontend maps what the registry holds now: at once if it uses a region, else when it reads this."""
        shm = self.dataplane.shm
        self._control.count(shm.changes)
        for member in self.frontends:
            if member.connection is not None:
                member.connection.channel.send(["regions", shm.changes, shm.registrations()])

    def frontend_failed(self, member: Frontend) -> None:
        log.error("frontend %d could not start: stopping the server", member.index)
        self.failed = True
        self.stop()


class Frontend:
    """The engine's side of one frontend process: starts it (again), serves its requests."""

    def __init__(self, engine: Engine, index: int):
        self.engine = engine
        self.index = index
        self.process: multiprocessing.process.BaseProcess | None = None
        self.connection: Connection | None = None
        self.exited = asyncio.Event()
        self.served = False  # whether any process of this frontend ever started serving
        self._deadline: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.engine.stopping:
            self.exited.set()
            return
        channel, their_channel = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        calls, their_calls = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = SPAWN.Process(
            target=frontend.run,
            args=(self.engine.args, self.index, their_channel, their_calls, self.engine.http_sockets[self.index]),
            name=f"kserve-ascend-frontend-{self.index}",
            daemon=True,  # ended by multiprocessing should the engine itself fail
        )
        self.process.start()
        their_channel.close()
        their_calls.close()
        self.exited.clear()
        self.connection = Connection(self.engine, channel, calls, self.serving)
        self.connection.start()
        asyncio.get_running_loop().add_reader(self.process.sentinel, self._process_exited)
        log.info("frontend %d started (pid %d)", self.index, self.process.pid)

    def serving(self) -> None:
        self.served = True
        log.info("frontend %d (pid %d) serving", self.index, self.process.pid)

    def stop(self, deadline: float) -> None:
        """Tells the frontend to stop; kills it if it has not exited by `deadline` (the loop's time)."""
        if self.process is None or self.process.exitcode is not None:  # gone, or waiting to be started again
            self.exited.set()
            return
        self.connection.channel.send(["stop"])
        self._deadline = asyncio.get_running_loop().call_at(deadline, self._kill, "did not exit in time")

    def _kill(self, why: str) -> None:
        if self.process is not None and self.process.exitcode is None:
            log.error("frontend %d (pid %d) %s: killing it", self.index, self.process.pid, why)
            self.process.kill()

    def _process_exited(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.process.sentinel)
        self.process.join()
        if self._deadline is not None:
            self._deadline.cancel()
        self.connection.close()
        code = self.process.exitcode
        if self.engine.stopping:
            (log.info if code == 0 else log.warning)("frontend %d (pid %d) exited with code %s", self.index, self.process.pid, code)
            self.exited.set()
        elif not self.served:
            self.exited.set()
            self.engine.frontend_failed(self)
        else:
            log.error(
                "frontend %d (pid %d) exited with code %s: its clients' connections are lost; starting it again",
                self.index, self.process.pid, code,
            )
            loop.call_later(RESTART_DELAY_S, self.start)


class Connection:
    """One frontend's requests and calls, served on the engine's loop; `serving()` once the frontend says it serves."""

    def __init__(self, engine: Engine, channel: socket.socket, calls: socket.socket, serving=lambda: None):
        self.engine = engine
        self.serving = serving
        self.channel = Channel(channel, self._received, self._closed)
        self.calls = Channel(calls, self._call_blocking)
        self.inputs = Mapped(lambda block: self.channel.send(["free", block[0], block[1]]))  # the frontend's arena
        self.outputs = Arena(self.channel.send)  # the answers', written here
        self.tasks: dict[int, asyncio.Task] = {}
        #: Requests answered, whose statistics await the time the frontend spent encoding them.
        self.answered: dict[int, Any] = {}

    def start(self) -> None:
        self.channel.start()
        self.calls.start()
        self.channel.send(*self.engine._control.share())
        shm = self.engine.dataplane.shm
        self.channel.send(["regions", shm.changes, shm.registrations()])

    def close(self) -> None:
        self.channel.close()
        self.calls.close()
        self.inputs.close()
        self.outputs.close()

    def _closed(self) -> None:
        # The frontend is gone: nobody waits for its requests any more, nor has one had the answers it was sent.
        for task in list(self.tasks.values()):
            task.cancel()
        for timing in self.answered.values():
            timing.record(0, False)
        self.answered.clear()

    def _received(self, message: list) -> None:
        kind = message[0]
        if kind == "infer":
            self._spawn(message[1], self._infer(message))
        elif kind == "call":
            self._spawn(message[1], self._call(message[1], message[2], message[3]))
        elif kind == "done":
            timing = self.answered.pop(message[1], None)
            if timing is not None:
                timing.record(message[2], message[3])
        elif kind == "free":
            self.outputs.free(message[1], message[2])
        elif kind == "cancel":
            task = self.tasks.get(message[1])
            if task is not None:
                # After its first step (queued before this): a task cancelled before it starts would neither
                # answer nor free the inputs the frontend wrote for it.
                asyncio.get_running_loop().call_soon(task.cancel)
        elif kind == "segment":
            self.inputs.add(message[1], message[2], self.channel.take_fd())
        elif kind == "drop":
            self.inputs.drop(message[1])
        elif kind == "serving":
            self.serving()

    def _spawn(self, call: int, work) -> None:
        task = asyncio.create_task(work)
        self.tasks[call] = task
        task.add_done_callback(lambda _, call=call: self.tasks.pop(call, None))

    async def _infer(self, message: list) -> None:
        (_, call, name, version, request_id, parameters, outputs, classification, start, log_id, carrier, block, inputs) = message
        logs.begin_request(log_id)
        token = otel_context.attach(propagate.extract(carrier)) if carrier is not None else None
        try:
            request = InferRequest(
                self._tensors(block, inputs), request_id, dict.fromkeys(outputs, False),
                parameters=parameters, classification=classification,
            )
            timing = AnsweredRemotely()
            if start is not None:
                timing.start = start  # the frontend's clock: CLOCK_MONOTONIC, the same in every process of the host
            served, (out_block, out_tensors) = await self.engine.dataplane.infer(name, version, request, timing, self._write)
            del request  # its inputs: the frontend may reuse their memory once the last array over it is gone
            self.answered[call] = timing
            self.channel.send(["ok", call, [served.name, served.version, out_block, out_tensors]])
        except asyncio.CancelledError:
            self.channel.send(["error", call, "cancelled", "the client went away"])
        except Exception as error:  # a fault is logged by the frontend's edge, with this traceback
            self.channel.send(["error", call, *error_reply(error)])
        finally:
            if token is not None:
                otel_context.detach(token)

    def _tensors(self, block: list | None, inputs: list[list]) -> dict[str, np.ndarray]:
        """The request's inputs, in its order: in the frontend's arena, or in a registered shared memory region."""
        in_arena = self.inputs.tensors(block, [entry for entry in inputs if len(entry) == 5])
        arrays = {}
        for entry in inputs:
            name = entry[0]
            if len(entry) == 5:
                arrays[name] = in_arena[name]
            else:
                _, datatype, shape, offset, nbytes, region = entry
                view = self.engine.dataplane.shm.view(region, offset, nbytes, f"input '{name}'")
                arrays[name] = np.frombuffer(view.toreadonly(), datatypes.to_numpy(datatype)).reshape(shape)
        return arrays

    def _write(self, model_name: str, version: int, request: InferRequest, outputs: dict[str, np.ndarray]) -> tuple:
        """The engine's `encode`: the answer's tensors into this frontend's output arena, and where they lie."""
        return write(self.outputs, outputs.items())

    async def _call(self, call: int, method: str, args: list) -> None:
        try:
            value = self.engine.calls.run(method, args)
            if asyncio.iscoroutine(value):
                value = await value
        except asyncio.CancelledError:
            self.channel.send(["error", call, "cancelled", "the caller went away"])
        except Exception as error:
            self.channel.send(["error", call, *error_reply(error)])
        else:
            self.channel.send(["ok", call, value])

    def _call_blocking(self, message: list) -> None:
        """A call a frontend waits for (its calls socket): answered at once, from the loop."""
        method, args = message[0], message[1:]
        try:
            value = self.engine.calls.run(method, args, blocking=True)
        except Exception as error:
            self.calls.send(["error", *error_reply(error)])
        else:
            self.calls.send(["ok", value])


class AnsweredRemotely(RequestTiming):
    """A request's timing in the engine, recorded once its frontend has encoded the answer (`record`).

    The one-process server records a request once its answer is encoded, as a failure if
    that fails (an output too large for its shared memory region); so does the engine, with
    the frontend's encoding time added to compute_output and to the request's duration.
    """

    __slots__ = ("answer_started", "answer_ns")

    def __enter__(self) -> None:
        self.answer_started = now_ns()

    def __exit__(self, kind, error, traceback) -> None:
        self.answer_ns = now_ns() - self.answer_started
        if kind is not None:
            self.record(0, False)  # failed here: the frontend is told, and will not report it done

    def record(self, frontend_ns: int, answered: bool | None) -> None:
        """`answered`: whether the frontend encoded the answer; None if its client had left (counted nowhere,
        as a cancelled request is)."""
        if self.stats is None or self.execution is None or answered is None:
            return  # refused before a scheduler took it: counted nowhere, as in Triton
        end = now_ns()
        if answered:
            self.stats.record_success(self, end, self.answer_ns + frontend_ns)
        else:
            self.stats.record_failure(end - self.start, "OTHER")
        self.stats = None  # recorded once


class Calls:
    """What a frontend may ask the engine, by name: its data plane's methods, and what KServe's routes need besides."""

    BLOCKING = frozenset({
        "ready", "unready_reason", "model_metadata", "model_config", "model_version", "model_state", "model_names",
        "statistics", "index", "shm_status", "shm_register", "shm_unregister", "shm_registrations", "metrics",
    })
    AWAITED = frozenset({"load_model", "unload_model", "model_state"})

    def __init__(self, engine: Engine):
        self.engine = engine
        self.dataplane = engine.dataplane

    def run(self, method: str, args: list, blocking: bool = False):
        if method not in (self.BLOCKING if blocking else self.AWAITED):
            raise AscendError(f"the engine has no call '{method}'")
        return getattr(self, method)(*args)

    def ready(self) -> bool:
        # Also every frontend, at start-up: a client that waits for readiness then finds each of them accepting.
        return self.dataplane.ready() and all(member.served for member in self.engine.frontends)

    def unready_reason(self, name: str, version: str | None = None) -> str:
        return self.dataplane.unready_reason(name, version)

    def model_metadata(self, name: str, version: str | None = None) -> dict:
        return self.dataplane.model_metadata(name, version)

    def model_config(self, name: str, version: str | None = None) -> dict:
        return self.dataplane.model_config(name, version)

    def model_version(self, name: str, version: str | None = None) -> list:
        """The version a request names (or `version_weights` picks) and its config, serialized."""
        served = self.dataplane.model(name).version(version)
        return [served.version, base64.b64encode(served.config.SerializeToString()).decode()]

    def model_state(self, name: str) -> bool | None:
        model = self.dataplane.repository.models.get(name)
        return None if model is None else model.ready and not self.dataplane.stopping

    def model_names(self) -> list[str]:
        return list(self.dataplane.repository.models)

    def statistics(self, name: str | None = None, version: str | None = None) -> dict:
        self.engine.read_frontends()
        return self.dataplane.statistics(name, version)

    def index(self) -> list[dict]:
        return self.dataplane.index()

    def shm_status(self, name: str = "") -> list[dict]:
        return self.dataplane.shm.status(name)

    def shm_register(self, name: str, key, offset, byte_size) -> None:
        self.dataplane.shm.register(name, key, offset, byte_size)
        self.engine.shm_changed()

    def shm_unregister(self, name: str = "") -> None:
        self.dataplane.shm.unregister(name)
        self.engine.shm_changed()

    def shm_registrations(self) -> list:
        return [self.dataplane.shm.changes, self.dataplane.shm.registrations()]

    def metrics(self) -> list:
        self.engine.read_frontends()
        return metrics.families(self.engine.registry)

    async def load_model(self, name: str, config_json: str | None = None) -> None:
        await self.dataplane.load_model(name, config_json)

    async def unload_model(self, name: str) -> None:
        await self.dataplane.unload_model(name)


class Control:
    """A page of shared memory the engine writes and every frontend reads: how many times the shared
    memory registry has changed (a frontend maps the regions again when the count moves)."""

    SIZE = mmap.PAGESIZE

    def __init__(self):
        self._fd = os.memfd_create("kserve-ascend-control", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.SIZE)
        self._mapping = mmap.mmap(self._fd, self.SIZE)
        self._registry_changes = np.frombuffer(self._mapping, np.int64, 1)

    def share(self) -> tuple[list, int]:
        """The message (and its descriptor) that gives a frontend this page, read-only."""
        return ["control", self.SIZE], os.dup(self._fd)

    def count(self, changes: int) -> None:
        self._registry_changes[0] = changes


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
        except OSError as error:  # app.main found it free: another process took it since
            sock.close()
            ports.refuse(port, ports.HTTP, error)
        sock.set_inheritable(True)
        sockets.append(sock)
    return sockets


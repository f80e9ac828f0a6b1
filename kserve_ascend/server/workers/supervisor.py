"""The engine's handle on one frontend process (`--workers N`): starts it, starts it again if it dies, stops it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import socket
from typing import Callable, Protocol

from . import frontend, messages
from .link import FrontendLink

log = logging.getLogger(__name__)

#: A fresh interpreter, never a fork of a process that holds onnxruntime, ACL or gRPC state.
SPAWN = multiprocessing.get_context("spawn")
#: A frontend that died is started again after this long (so one that cannot live does not spin).
RESTART_DELAY_S = 1.0


class Supervisor(Protocol):
    """What a frontend process's handle asks of the engine."""

    args: argparse.Namespace
    #: Shutdown has begun: a frontend that exits is not started again.
    stopping: bool
    #: The HTTP listening socket of each frontend, by index.
    http_sockets: list[socket.socket]

    def link(self, sock: socket.socket, serving: Callable[[], None]) -> FrontendLink:
        """The engine's end of a new frontend's socket, started."""

    def frontend_failed(self, member: FrontendProcess) -> None:
        """The frontend exited before it ever served."""


class FrontendProcess:
    """Frontend `index`: its process, and the link the engine serves it over."""

    def __init__(self, engine: Supervisor, index: int):
        self.engine = engine
        self.index = index
        self.process: multiprocessing.process.BaseProcess | None = None
        self.link: FrontendLink | None = None
        self.exited = asyncio.Event()
        self.served = asyncio.Event()  # set once any process of this frontend starts serving
        self._deadline: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.engine.stopping:
            self.exited.set()
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = SPAWN.Process(
            target=frontend.run,
            args=(self.engine.args, self.index, theirs, self.engine.http_sockets[self.index]),
            name=f"kserve-ascend-frontend-{self.index}",
            daemon=True,  # ended by multiprocessing should the engine itself fail
        )
        self.process.start()
        theirs.close()
        self.exited.clear()
        self.link = self.engine.link(ours, self._serving)
        asyncio.get_running_loop().add_reader(self.process.sentinel, self._process_exited)
        log.info("frontend %d started (pid %d)", self.index, self.process.pid)

    def _serving(self) -> None:
        self.served.set()
        log.info("frontend %d (pid %d) serving", self.index, self.process.pid)

    def send(self, message) -> None:
        """To the frontend, if it runs."""
        if self.link is not None:
            self.link.channel.send(message)

    def stop(self, deadline: float) -> None:
        """Tells the frontend to stop; kills it if it has not exited by `deadline` (the loop's time)."""
        if self.process is None or self.process.exitcode is not None:  # gone, or waiting to be started again
            self.exited.set()
            return
        self.link.channel.send(messages.Stop())
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
        self.link.close()
        self.link = None
        code = self.process.exitcode
        if self.engine.stopping:
            (log.info if code == 0 else log.warning)("frontend %d (pid %d) exited with code %s", self.index, self.process.pid, code)
            self.exited.set()
        elif not self.served.is_set():
            self.exited.set()
            self.engine.frontend_failed(self)
        else:
            log.error(
                "frontend %d (pid %d) exited with code %s: its clients' connections are lost; starting it again",
                self.index, self.process.pid, code,
            )
            loop.call_later(RESTART_DELAY_S, self.start)

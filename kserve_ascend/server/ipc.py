"""Messages between the engine and its frontends (`--workers N`): JSON over a Unix stream socket, descriptors alongside.

A message is a JSON array written by orjson, which refuses numpy arrays: control data
crosses here (names, shapes, offsets, parameters, timings), tensor bytes never do, they
cross in shared memory (`arena`). A message may carry a file descriptor, a memfd that
the receiver maps (SCM_RIGHTS: the kernel passes it, nothing is named on disk).

`Channel` is one end on an event loop: messages written in one loop iteration leave in
one `send`, and a reader callback parses every message a `recv` brought. `Caller` is the
blocking end a frontend uses for the calls its edges make synchronously (readiness,
metadata, statistics...): one at a time, answered in order.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import socket
import struct
import threading
import traceback
from typing import Any, Callable

import orjson

from ..core.errors import AscendError, InvalidInput, ModelLoadError, ModelNotFound, ModelNotReady, Unavailable

log = logging.getLogger(__name__)

#: A message on the wire: its length, then that many bytes of JSON.
_LENGTH = struct.Struct("<I")
_RECV_SIZE = 1 << 18
#: At most one descriptor rides on a message; a read may complete a few of them.
_MAX_FDS = 16

#: Errors that keep their type across the channel, so the edges answer them with their own status.
_ERRORS = {cls.__name__: cls for cls in (InvalidInput, ModelNotFound, ModelNotReady, Unavailable, ModelLoadError)}


def frame(message: list) -> bytes:
    payload = orjson.dumps(message)
    return _LENGTH.pack(len(payload)) + payload


def error_reply(error: Exception) -> list:
    """An error as it crosses the channel: [kind, message] of a core error; of any other (a fault), also its
    type's name and traceback (call it in the `except` block)."""
    if isinstance(error, AscendError):
        return [type(error).__name__, str(error)]
    return ["unexpected", str(error), type(error).__name__, traceback.format_exc()]


def remote_error(kind: str, message: str, name: str = "", trace: str = "") -> Exception:
    """The error the engine raised, rebuilt in a frontend.

    A core error keeps its type if the edges map it to a status (else it is a 500 with its
    message). Any other error is a fault: rebuilt under its own type's name, which the
    edges show (`errors.unexpected`), and caused by its traceback in the engine, which they
    log, as concurrent.futures shows a process pool worker's.
    """
    if kind != "unexpected":
        return _ERRORS.get(kind, AscendError)(message)
    error = _fault_type(name)(message)
    error.__cause__ = RemoteTraceback(trace)
    return error


class RemoteTraceback(Exception):
    """The traceback of an error raised in the engine process."""

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.args[0]}\"\"\""


@functools.lru_cache(maxsize=64)
def _fault_type(name: str) -> type:
    return type(name, (Exception,), {"__module__": "engine"})


class ChannelClosed(Unavailable):
    """The engine is gone (it is stopping, or died): nothing more can be served."""


class Channel:
    """One end of a Unix stream socket on the running loop: `send` messages, `on_message` for each received.

    `on_message(message)` runs on the loop for every message, in order. `on_close()` runs
    once when the peer goes away (or the channel is closed). Descriptors that arrive are
    queued for `take_fd`, in the order they were sent: the message that announces one is
    read after the descriptor itself has arrived, since the kernel delivers it with the
    first byte of the `sendmsg` that carried it.
    """

    def __init__(self, sock: socket.socket, on_message: Callable[[list], None], on_close: Callable[[], None] = lambda: None):
        self.sock = sock
        self.on_message = on_message
        self.on_close = on_close
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._in = bytearray()
        self._fds: collections.deque[int] = collections.deque()
        self._out: collections.deque[tuple[bytes, int | None]] = collections.deque()
        self._flushing = False
        self._writing = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self.sock.setblocking(False)
        self._loop.add_reader(self.sock.fileno(), self._readable)

    # ------------------------------------------------------------ sending

    def send(self, message: list, fd: int | None = None) -> None:
        """Queues a message (and a descriptor, which the channel closes once sent); callable from any thread."""
        if self.closed:
            if fd is not None:
                os.close(fd)
            return
        self._out.append((frame(message), fd))
        if not self._flushing:
            self._flushing = True
            try:
                if threading.get_ident() == self._thread:
                    self._loop.call_soon(self._flush)
                else:  # an array over the peer's memory dropped on another thread, say
                    self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop has closed: the process is stopping
                pass

    def flush(self) -> None:
        """Writes what is queued now rather than at the end of the loop's iteration (if the socket takes it)."""
        self._flush()

    def _flush(self) -> None:
        self._flushing = False
        if self._writing or self.closed:
            return  # the writer callback flushes once the socket has room
        while self._out:
            data, fd = self._out.popleft()
            if fd is None:
                # Every message queued since the last flush, in one write.
                parts = [data]
                while self._out and self._out[0][1] is None:
                    parts.append(self._out.popleft()[0])
                data = b"".join(parts)
            try:
                sent = self.sock.send(data) if fd is None else socket.send_fds(self.sock, [data], [fd])
            except BlockingIOError:
                self._out.appendleft((data, fd))
                self._wait_writable()
                return
            except OSError as error:
                if fd is not None:
                    os.close(fd)
                log.debug("channel: the peer went away while sending: %s", error)
                self.close()
                return
            if fd is not None:
                os.close(fd)  # sent: the peer has its own copy
            if sent < len(data):
                self._out.appendleft((data[sent:], None))
                self._wait_writable()
                return

    def _wait_writable(self) -> None:
        self._writing = True
        self._loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        self._loop.remove_writer(self.sock.fileno())
        self._writing = False
        self._flush()

    # ------------------------------------------------------------ receiving

    def drain(self) -> None:
        """Handles every message the peer has sent so far (what is in the socket now), before going on."""
        while not self.closed and not self._reading and self._readable():
            pass

    _reading = False

    def _readable(self) -> bool:
        """Reads once and handles every message completed; whether anything was read."""
        try:
            data, fds, flags, _ = socket.recv_fds(self.sock, _RECV_SIZE, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as error:
            log.debug("channel: the peer went away while receiving: %s", error)
            data, fds, flags = b"", [], 0
        self._fds.extend(fds)
        if not data:
            self.close()
            return False
        if flags & socket.MSG_CTRUNC:
            log.error("channel: descriptors were lost in transit; closing the channel")
            self.close()
            return False
        self._reading = True
        buffer = self._in
        buffer += data
        start, end = 0, len(buffer)
        view = memoryview(buffer)
        try:
            while end - start >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(buffer, start)
                if end - start - _LENGTH.size < length:
                    break
                start += _LENGTH.size
                message = orjson.loads(view[start : start + length])
                start += length
                self.on_message(message)
                if self.closed:
                    return False
        finally:
            self._reading = False
            view.release()
            del buffer[:start]
        return True

    def take_fd(self) -> int:
        """The next descriptor received (the one the message being handled announces)."""
        return self._fds.popleft()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
            if self._writing:
                self._loop.remove_writer(self.sock.fileno())
        for _, fd in self._out:
            if fd is not None:
                os.close(fd)
        self._out.clear()
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()
        self.on_close()


class Caller:
    """A frontend's blocking calls to the engine, for what its edges ask synchronously.

    The engine answers from its event loop, which never waits on a frontend, so a call
    takes one round trip plus whatever the engine's loop is doing (well under a millisecond
    while it batches). The caller's loop waits meanwhile: these are control-plane calls
    (probes, metadata, statistics, scrapes), never on an inference's path.
    """

    def __init__(self, sock: socket.socket, timeout: float = 30.0, before: Callable[[], None] = lambda: None):
        self.sock = sock
        self.sock.settimeout(timeout)
        self.before = before
        self._lock = threading.Lock()  # KServe's metrics scrape and the loop may both call

    def call(self, method: str, *args: Any) -> Any:
        self.before()
        with self._lock:
            try:
                self.sock.sendall(frame([method, *args]))
                reply = self._read()
            except (OSError, EOFError) as error:
                raise ChannelClosed(f"the engine process did not answer '{method}': {error or 'it has gone'}") from None
        if reply[0] == "ok":
            return reply[1]
        raise remote_error(*reply[1:])

    def _read(self) -> list:
        (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        return orjson.loads(self._exactly(length))

    def _exactly(self, size: int) -> bytes:
        chunks, remaining = [], size
        while remaining:
            chunk = self.sock.recv(remaining)
            if not chunk:
                raise EOFError("the engine closed the connection")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()

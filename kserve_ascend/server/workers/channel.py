"""One end of the engine-frontend socket (`--workers N`) on an event loop: typed messages (`messages`) framed by
their length, descriptors alongside.

Messages queued in one loop iteration leave in one `send`; a read parses every message it
completed, in order. Nothing here blocks: a full socket waits for the loop to say it has room.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import struct
import threading
from typing import Callable

import msgspec

from ...core.errors import Unavailable
from . import messages
from .messages import Message

log = logging.getLogger(__name__)

#: A message on the wire: its length, then that many bytes of msgpack.
_LENGTH = struct.Struct("<I")
_RECV_SIZE = 1 << 18
#: At most one descriptor rides on a message; a read may complete a few of them.
_MAX_FDS = 16


def frame(message: Message) -> bytes:
    payload = messages.encoder.encode(message)
    return _LENGTH.pack(len(payload)) + payload


class ChannelClosed(Unavailable):
    """The peer is gone: what was asked of it cannot be answered (503 / UNAVAILABLE)."""


class Channel:
    """One end of a Unix stream socket on the running loop: `send` messages, `on_message` for each received.

    `on_message(message)` runs on the loop for every message, in order. `on_close()` runs
    once when the peer goes away (or the channel is closed). Descriptors that arrive are
    queued for `take_fd`, in the order they were sent: the message that announces one is
    read after the descriptor itself has arrived, since the kernel delivers it with the
    first byte of the `sendmsg` that carried it.
    """

    def __init__(self, sock: socket.socket, on_message: Callable[[Message], None], on_close: Callable[[], None] = lambda: None):
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

    def send(self, message: Message, fd: int | None = None) -> None:
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
                try:
                    message = messages.decoder.decode(view[start : start + length])
                except msgspec.DecodeError as error:
                    log.error("channel: the peer sent what is no message of this version (%s): closing", error)
                    self.close()
                    return False
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

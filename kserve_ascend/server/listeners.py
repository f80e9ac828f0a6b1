"""Closing the HTTP listening sockets at shutdown without resetting a connection the kernel accepted.

Linux completes TCP handshakes on a listening socket by itself and queues the connections
for accept(); when the socket closes, every connection still queued is answered with a
reset (`inet_csk_listen_stop`, net/ipv4/inet_connection_sock.c), and with SO_REUSEPORT so
is each socket's own queue, whatever the group's other sockets do (unless the host enables
net.ipv4.tcp_migrate_req). The client's connect() had succeeded: it sees its request end in
ConnectionResetError or BrokenPipeError and cannot tell whether it was served. So, before
the server closes them, `drain` makes each listening socket

1. stop completing new handshakes: a classic BPF socket filter (SO_ATTACH_FILTER; no
   privilege, no eBPF) drops every segment that opens a connection (SYN without ACK).
   `tcp_v4_rcv`/`tcp_v6_rcv` run a listener's filter on each segment with the TCP header
   at offset 0 (net/ipv4/tcp_ipv4.c, `tcp_filter`). The client's kernel sends its SYN
   again a second later, by when the socket has closed: the connection is refused, never
   accepted. The handshakes already under way complete (their ACKs pass);
2. empty its queue: the server goes on accepting meanwhile and answers what comes
   503 "the server is shutting down" with `Connection: close`, until the socket's accept
   queue is empty (TCP_INFO of a listener: `tcpi_unacked` is the number of connections
   ready for accept(), `tcp_get_info` in net/ipv4/tcp.c; `ss -lt` shows it as Recv-Q).

Then the socket closes with nothing queued. A client sees 200, 503 or a refused connection.
Left to chance: a handshake whose last ACK takes longer than HANDSHAKE_S, and a connection
accepted whose request has not arrived by when uvicorn stops (it closes a connection that
has not begun a request), at least uvicorn's tick (0.1 s) after the queue emptied.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import socket
import struct
from typing import Iterable

log = logging.getLogger(__name__)

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h> (x86-64 and arm64); Python's socket module lacks it
#: A handshake whose SYN passed before the filter completes within a round trip; this is far above one
#: inside a cluster. Only a connection whose final ACK takes longer than this can still be reset.
HANDSHAKE_S = 0.1
POLL_S = 0.01


class _SockFilter(ctypes.Structure):  # struct sock_filter, <linux/filter.h>
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


# BPF_LD|BPF_B|BPF_ABS, BPF_ALU|BPF_AND|BPF_K, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K (<linux/bpf_common.h>).
_LDB, _AND, _JEQ, _RET = 0x30, 0x54, 0x15, 0x06
_TCP_FLAGS, _SYN, _ACK = 13, 0x02, 0x10
_NO_NEW_CONNECTIONS = (
    (_LDB, 0, 0, _TCP_FLAGS),  # A = the segment's flags
    (_AND, 0, 0, _SYN | _ACK),
    (_JEQ, 0, 1, _SYN),  # a SYN without ACK: a new connection
    (_RET, 0, 0, 0),  # dropped
    (_RET, 0, 0, 0xFFFFFFFF),  # anything else, whole
)


def refuse_new_connections(sock) -> None:
    """Makes the kernel drop the segments that open a connection on `sock` (a listening TCP socket, or
    asyncio's TransportSocket over one); what it has queued stays to be accepted."""
    program = (_SockFilter * len(_NO_NEW_CONNECTIONS))(*(_SockFilter(*op) for op in _NO_NEW_CONNECTIONS))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(_SockFprog(len(program), program)))


def queued(sock) -> int:
    """The connections waiting in `sock`'s accept queue (a listening TCP socket)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
    return struct.unpack_from("I", info, 24)[0]  # tcpi_unacked, after 8 bytes and 4 u32 fields


async def drain(sockets: Iterable, timeout: float) -> None:
    """Stops new connections on every listening socket and waits, up to `timeout` seconds, until the
    server has accepted every connection queued on them (see the module's doc). The server must
    go on accepting meanwhile; it closes the sockets after this."""
    sockets = list(sockets)
    if not sockets:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        for sock in sockets:
            refuse_new_connections(sock)
    except OSError as error:  # not Linux: the sockets close as they are
        log.warning("cannot hold new connections off the HTTP port before it closes: %s", error)
        return
    await asyncio.sleep(min(HANDSHAKE_S, timeout))
    while (left := sum(queued(sock) for sock in sockets)) and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    if left:
        log.warning("%d connections were still queued when the HTTP port closed: they are reset", left)

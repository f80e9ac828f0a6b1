"""The server's listening ports: each is its own and free before anything binds it, or the server exits naming it.

A second server started on a busy port must not come up beside the first: grpcio binds with
SO_REUSEPORT by default, so two servers on one gRPC port would share its connections (the
kernel splits them), and a busy HTTP or metrics port would fail later with a traceback that
names no port. So every port is checked before the server starts, with a probe bound
exclusively (without SO_REUSEPORT, no other socket can share its port), and a bind that
fails anyway (a race with another process) exits with the same one line.
"""

from __future__ import annotations

import errno
import socket
from typing import NoReturn

#: Where each port is bound: REST (uvicorn) and the metrics port (prometheus_client) on 0.0.0.0,
#: gRPC (grpcio) on [::], both families where the host has IPv6.
HTTP, GRPC, METRICS = "HTTP", "gRPC", "metrics"
_DUAL_STACK = {GRPC}


def check_distinct(flags: dict[str, int]) -> None:
    """Exits (one line naming both flags) when two of the server's ports are one: each server binds its own."""
    seen: dict[int, str] = {}
    for flag, port in flags.items():
        if port in seen:
            raise SystemExit(f"kserve-ascend: {seen[port]} and {flag} are both {port}: give each its own port")
        seen[port] = flag


def check_free(port: int, what: str) -> None:
    """Exits (SystemExit, one line naming the port) unless `port` can be bound exclusively now."""
    for family in (socket.AF_INET6, socket.AF_INET) if what in _DUAL_STACK else (socket.AF_INET,):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here: grpcio binds IPv4 alone then, and so does the probe
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no use
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
            except OSError as error:
                refuse(port, what, error)
        return


def refuse(port: int, what: str, error: OSError) -> NoReturn:
    """Exits with one line saying why `port` cannot be bound."""
    if error.errno == errno.EADDRINUSE:
        raise SystemExit(f"kserve-ascend: the {what} port {port} is in use: {error.strerror}") from None
    raise SystemExit(f"kserve-ascend: cannot listen on the {what} port {port}: {error.strerror or error}") from None

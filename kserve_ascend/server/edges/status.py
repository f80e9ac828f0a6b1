"""Core errors -> HTTP status and gRPC code, and the message of an unexpected error, in one place for both edges."""

from __future__ import annotations

import logging

import grpc

from ...core.errors import AscendError, InvalidInput, ModelNotFound, ModelNotReady, Unavailable, Unsupported

# Triton answers 400 for a model that exists but is unavailable; so does this server.
_STATUS = {InvalidInput: 400, ModelNotFound: 404, ModelNotReady: 400, Unavailable: 503, Unsupported: 501}
_CODE = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    ModelNotReady: grpc.StatusCode.UNAVAILABLE,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
}


def http_status(error: BaseException) -> int:
    """4xx for client mistakes; 503 for a full queue or a queue timeout (retry); 500 for faults."""
    return _STATUS.get(type(error), 500)


def grpc_code(error: BaseException) -> grpc.StatusCode:
    return _CODE.get(type(error), grpc.StatusCode.INTERNAL)


def unexpected(error: Exception) -> str:
    """The message of an error no code path expected (a fault of a runtime or of the server): 500 / INTERNAL.

    Named by its type, since the text of many exceptions (a KeyError's) says little alone.
    """
    return f"{type(error).__name__}: {error}"


def logged(log: logging.Logger, where: str, error: BaseException) -> str:
    """The message of an error answered within a response already under way (a stream's, whose status is sent),
    logged as the edges log errors: a fault at error (an unexpected one with its traceback), a client's at info."""
    if not isinstance(error, AscendError):
        log.error("%s: unexpected error", where, exc_info=error)
        return unexpected(error)
    (log.error if http_status(error) == 500 else log.info)("%s: %s", where, error)
    return str(error)

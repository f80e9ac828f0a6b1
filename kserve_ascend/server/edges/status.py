"""Core errors -> HTTP status and gRPC code, and the message of an unexpected error, in one place for both edges."""

from __future__ import annotations

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


def http_status(error: AscendError) -> int:
    """4xx for client mistakes; 503 for a full queue or a queue timeout (retry); 500 for faults."""
    return _STATUS.get(type(error), 500)


def grpc_code(error: AscendError) -> grpc.StatusCode:
    return _CODE.get(type(error), grpc.StatusCode.INTERNAL)


def unexpected(error: Exception) -> str:
    """The message of an error no code path expected (a fault of a runtime or of the server): 500 / INTERNAL.

    Named by its type, since the text of many exceptions (a KeyError's) says little alone.
    """
    return f"{type(error).__name__}: {error}"

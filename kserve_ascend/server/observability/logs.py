"""Log lines that name their request: its id in a ContextVar, on every line; `--log_format json`.

Each edge calls `begin_request` as a request starts (each request runs in a task of its
own, so the id follows it through every await and into `asyncio.to_thread`). The id is
the OIP request `id` the client gave, else its `x-request-id` header (gRPC metadata), as
KServe and Envoy propagate it, else a fresh random one, made only if a line of it is logged.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time

import orjson

#: Loggers whose handlers write the process's lines: KServe's, uvicorn's (and this package's, which shares KServe's).
LOGGERS = ("kserve", "kserve.trace", "uvicorn", "uvicorn.error", "uvicorn.access", "")


class _Request:
    """The request a task serves; without an id from the client, one is made when first asked for."""

    __slots__ = ("_id",)

    def __init__(self, given: str | None):
        self._id = given

    @property
    def id(self) -> str:
        if self._id is None:
            self._id = os.urandom(16).hex()  # as unique as a UUID4, at a fifth of its cost
        return self._id


_request: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("kserve_ascend_request", default=None)


def begin_request(given: str | None = None) -> None:
    """The current task now serves a request with the id the client `given` (if any)."""
    _request.set(_Request(given or None))


def request_id() -> str | None:
    """The id of the request the current task serves; None outside requests."""
    request = _request.get()
    return None if request is None else request.id


def _add_request_id(record: logging.LogRecord) -> bool:
    """Handler filter: `record.request_id`, for the formatters (runs only for lines that are written)."""
    record.request_id = request_id()
    return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id, exception."""

    converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if getattr(record, "request_id", None) is not None:
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(entry).decode()


class TextFormatter(logging.Formatter):
    """The handler's own format, with ` request_id=<id>` ending the first line of a request's lines."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        line = self.inner.format(record)
        rid = getattr(record, "request_id", None)
        if rid is None:
            return line
        first, newline, rest = line.partition("\n")
        return f"{first} request_id={rid}{newline}{rest}"


def configure(log_format: str) -> None:
    """Puts the request id on the lines of every handler KServe and uvicorn write with.

    `json` also makes those handlers, and one on the root logger for every other library
    (and Python's warnings), write one JSON object per line, so a log collector parses
    every line the process writes through logging.
    """
    root = logging.getLogger()
    if log_format == "json":
        if not root.handlers:
            root.addHandler(logging.StreamHandler())
        logging.captureWarnings(True)
    handlers = {handler for name in LOGGERS for handler in logging.getLogger(name).handlers}
    for handler in handlers:
        handler.addFilter(_add_request_id)
        handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(handler.formatter))

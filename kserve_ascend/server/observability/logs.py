"""Log lines that name their request: its id in a ContextVar, on every line; `--log_format`; Triton's log settings.

Each edge calls `begin_request` as a request starts (each request runs in a task of its
own, so the id follows it through every await and into `asyncio.to_thread`). The id is
the OIP request `id` the client gave, else its `x-request-id` header (gRPC metadata), as
KServe and Envoy propagate it, else a fresh random one, made only if a line of it is logged.

The logging extension (Triton's `extension_logging.md`: `GET/POST /v2/logging`, gRPC
`LogSettings`) changes the settings here at run time: which levels are written (`log_info`,
`log_warning`, `log_error`, each on its own as in Triton), verbose lines (`log_verbose_level`
> 0 writes this package's and KServe's DEBUG lines) and the line format. `checked` validates a
client's change, `apply` makes one take effect in this process.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import os
import time
from typing import Any

import orjson

from ...core.errors import InvalidInput, Unsupported

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


def _admit(record: logging.LogRecord) -> bool:
    """Handler filter: drops a line of a level switched off; puts `record.request_id` on the others, for the
    formatters (runs only for lines a logger passes on)."""
    level = record.levelno
    if not (_settings["log_error"] if level >= logging.ERROR else _settings["log_warning"] if level >= logging.WARNING
            else _settings["log_info"] if level >= logging.INFO else _settings["log_verbose_level"] > 0):
        return False
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
    """The handler's own format (KServe's lines: `default`), with ` request_id=<id>` ending the first line of a
    request's lines."""

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


#: The values of `log_format`: KServe's lines (Triton's name for its own), the same with the time in
#: ISO 8601 UTC (Triton's `ISO8601`), or one JSON object per line.
LOG_FORMATS = ("default", "ISO8601", "json")

#: The log settings as Triton names them; `log_file` is always "" (the console: the pod's log).
_settings: dict[str, Any] = {
    "log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0, "log_format": "default",
}
#: What a client may change, and the type each must have: Python's bool is an int, so types are compared exactly.
_TYPES = {"log_info": bool, "log_warning": bool, "log_error": bool, "log_verbose_level": int, "log_format": str}
_EXPECTED = {bool: "a boolean", int: "an unsigned integer", str: "a string"}
#: The handlers every line is written by, with the formatter KServe (or uvicorn) gave each.
_handlers: dict[logging.Handler, logging.Formatter] = {}
#: Whether verbose lines are written: one check where a verbose line would cost on the hot path.
verbose = False


def settings() -> dict[str, Any]:
    """The log settings now, as Triton answers them."""
    return dict(_settings)


def checked(changes: dict[str, Any]) -> dict[str, Any]:
    """A client's change of the settings, validated whole before any of it applies (a null leaves a setting as
    it is, as in Triton). Unsupported for `log_file` (Triton's refusal, word for word); InvalidInput for the
    rest of what is wrong, an unknown name included (Triton ignores one: a misspelt setting would be lost)."""
    if changes.get("log_file") is not None:
        raise Unsupported("log file location can not be updated through network protocol")
    valid = {}
    for name, value in changes.items():
        if value is None or name == "log_file":
            continue
        expected = _TYPES.get(name)
        if expected is None:
            raise InvalidInput(f"unknown log setting '{name}': the settings are {', '.join(_settings)}")
        if type(value) is not expected or (expected is int and value < 0):
            raise InvalidInput(f"expect {_EXPECTED[expected]} for '{name}'")
        if name == "log_format" and value not in LOG_FORMATS:
            raise InvalidInput(f"invalid argument for log_format, got: {value} (the formats are {', '.join(LOG_FORMATS)})")
        valid[name] = value
    return valid


def apply(changes: dict[str, Any]) -> None:
    """Makes checked settings take effect in this process: from its next line on."""
    global verbose
    _settings.update(changes)
    if "log_verbose_level" in changes:
        verbose = _settings["log_verbose_level"] > 0
        level = logging.DEBUG if verbose else logging.INFO
        for name in ("kserve", "kserve_ascend"):
            logging.getLogger(name).setLevel(level)
    if "log_format" in changes:
        _format(_settings["log_format"])


def _format(log_format: str) -> None:
    if log_format == "json":
        root = logging.getLogger()
        if not root.handlers:  # every other library's lines (and Python's warnings) as JSON too
            root.addHandler(handler := logging.StreamHandler())
            _handlers[handler] = handler.formatter or logging.Formatter()
            handler.addFilter(_admit)
        logging.captureWarnings(True)
    for handler, kserves in _handlers.items():
        if log_format == "json":
            handler.setFormatter(JsonFormatter())
        else:
            handler.setFormatter(TextFormatter(kserves if log_format == "default" else _iso8601(kserves)))


def _iso8601(formatter: logging.Formatter) -> logging.Formatter:
    """`formatter` with its time in ISO 8601, UTC (`2024-05-20T20:03:26.123Z`)."""
    iso = copy.copy(formatter)
    iso.converter, iso.datefmt = time.gmtime, "%Y-%m-%dT%H:%M:%S"
    iso._style = copy.copy(formatter._style)
    iso._style._fmt = iso._fmt = formatter._style._fmt.replace("%(msecs)03d", "%(msecs)03dZ")
    return iso


def configure(log_format: str) -> None:
    """Puts the request id on the lines of every handler KServe and uvicorn write with, and the settings'
    filter and format (`log_format`, one of LOG_FORMATS) on them.

    `json` also makes those handlers, and one on the root logger for every other library
    (and Python's warnings), write one JSON object per line, so a log collector parses
    every line the process writes through logging.
    """
    for handler in {handler for name in LOGGERS for handler in logging.getLogger(name).handlers}:
        if handler not in _handlers:
            _handlers[handler] = handler.formatter or logging.Formatter()
            handler.addFilter(_admit)
    apply({"log_format": log_format})

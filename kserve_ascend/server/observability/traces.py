"""Triton's trace extension (`extension_trace.md`): the trace settings, global and per model, and with
`trace_mode triton` the requests they sample, written to Triton's JSON trace file.

Lives where the models are (the one process, or the engine of `--workers N`): a request is sampled
as the data plane takes it (`sample`), and its trace is made, when the request is recorded, of the
times its `RequestTiming` holds already (`Trace.end`): no clock is read for a trace. While no setting
traces (every level OFF) the data plane pays one check of `TraceManager.active` per request.

Semantics follow Triton's TraceManager (server/src/tracer.cc): every change of a setting makes it
anew, its counts with it (the traces it had collected are written out first); a model's setting is
the global one with the fields given for the model, which follow the global ones until given; a
request is traced when it is the `trace_rate`-th since the setting was made, while `trace_count`
(-1: no limit) lasts; `log_frequency` N > 0 writes every N traces to `<trace_file>.<index>`; a
`trace_count` that runs out writes what was collected to the next indexed file; otherwise the traces
go to `<trace_file>` itself, one JSON array closed when the server stops.

With `trace_mode opentelemetry` the requests' OpenTelemetry spans (`core.tracing`) are the traces:
the global `trace_level` switches them on and off in every process, and the standard
`OTEL_TRACES_SAMPLER` environment samples them.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from ...core import datatypes
from ...core.errors import InvalidInput, Unsupported
from ...core.stats import RequestTiming

log = logging.getLogger(__name__)

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1


@dataclass
class Setting:
    """One trace setting: its values, and (triton mode) the sampling and the traces collected under it."""

    level: tuple[str, ...] = ()  # the levels traced; () is OFF
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    sampled: int = 0  # requests seen since the setting was made
    traced: int = 0  # of those, traces begun
    ended: int = 0  # and ended
    collected: list[bytes] = field(default_factory=list)  # ended traces not written yet, each its entries in JSON

    def answer(self, file: str, mode: str) -> dict[str, Any]:
        """As Triton answers a setting: strings (the level a list of them); the file and frequency only in triton mode."""
        answer: dict[str, Any] = {"trace_level": list(self.level) or ["OFF"], "trace_rate": str(self.rate), "trace_count": str(self.count)}
        if mode == "triton":
            answer |= {"log_frequency": str(self.log_frequency), "trace_file": file}
        return answer | {"trace_mode": mode}

    def values(self) -> dict[str, Any]:
        return {"level": self.level, "rate": self.rate, "count": self.count, "log_frequency": self.log_frequency}


class TraceFile:
    """`<trace_file>` and its indexed siblings `<trace_file>.<n>`, each one JSON array of trace entries."""

    def __init__(self, path: str):
        self.path = path
        self.index = 0
        self._main = None  # `<trace_file>`, open once its first trace is written, closed by `close`

    def write_indexed(self, traces: list[bytes]) -> None:
        with open(f"{self.path}.{self.index}", "wb") as out:
            out.write(b"[" + b",".join(traces) + b"]")
        self.index += 1

    def append(self, traces: list[bytes]) -> None:
        if self._main is None:
            self._main = open(self.path, "wb")  # noqa: SIM115  (open until the server stops: Triton's one array)
            self._main.write(b"[" + b",".join(traces))
        else:
            self._main.write(b"," + b",".join(traces))

    def close(self) -> None:
        if self._main is not None:
            self._main.write(b"]")
            self._main.close()
            self._main = None


class Trace:
    """One sampled request, ended once (`end`) when its timing is recorded: then its entries are written, as Triton
    writes them for the protocol it came by (HTTP, GRPC)."""

    __slots__ = ("_ended", "id", "manager", "model_name", "model_version", "protocol", "request_id", "setting", "tensors")

    def __init__(self, manager: TraceManager, setting: Setting, id: int, model_name: str, request_id: str, protocol: str):
        self.manager, self.setting, self.id = manager, setting, id
        self.model_name, self.model_version, self.request_id, self.protocol = model_name, 0, request_id, protocol
        self.tensors: list[dict] | None = [] if "TENSORS" in setting.level else None
        self._ended = False

    def inputs(self, served_version: int, arrays: Mapping[str, np.ndarray]) -> None:
        """The version that serves the request, and (level TENSORS) its inputs as they enter the queue."""
        self.model_version = served_version
        if self.tensors is not None:
            self.tensors += [self._tensor("TENSOR_QUEUE_INPUT", name, array) for name, array in arrays.items()]

    def outputs(self, arrays: Mapping[str, np.ndarray]) -> None:
        if self.tensors is not None:
            self.tensors += [self._tensor("TENSOR_BACKEND_OUTPUT", name, array) for name, array in arrays.items()]

    def _tensor(self, activity: str, name: str, array: np.ndarray) -> dict:
        datatype = datatypes.from_numpy(array.dtype)
        shape = ",".join(map(str, array.shape))
        return {"id": self.id, "activity": activity, "tensor": {"name": name, "data": _data(datatype, array), "shape": shape, "dtype": datatype}}

    def end(self, timing: RequestTiming, end: int) -> None:
        """The request is recorded at `end` (its answer made, or its failure): its trace is complete."""
        if self._ended:
            return
        self._ended = True
        self.manager.collect(self.setting, orjson.dumps(self._entries(timing, end))[1:-1])

    def _entries(self, timing: RequestTiming, end: int) -> list[dict]:
        if "TIMESTAMPS" not in self.setting.level:
            return self.tensors  # level TENSORS alone: Triton writes the tensors only

        def at(name: str, ns: int) -> dict:
            return {"id": self.id, "timestamps": [{"name": name, "ns": ns}]}

        info = {"id": self.id, "model_name": self.model_name, "model_version": self.model_version}
        if self.request_id:
            info["request_id"] = self.request_id
        # Triton writes an HTTP request's sending between its start (and queueing) and the rest: kept apart, as a
        # request refused before it was queued has no QUEUE_START.
        started = [at("REQUEST_START", timing.start)]
        if timing.enqueued:
            started.append(at("QUEUE_START", timing.enqueued))
        core = list(self.tensors or ())
        execution = timing.execution
        if execution is not None:
            input_end = execution.start + execution.input_ns
            output_start = input_end + execution.infer_ns
            core += [at("COMPUTE_START", execution.start), at("COMPUTE_INPUT_END", input_end),
                     at("COMPUTE_OUTPUT_START", output_start), at("COMPUTE_END", output_start + execution.output_ns)]  # fmt: skip
        answered = [at("INFER_RESPONSE_COMPLETE", timing.answer_start)] if timing.answer_start else []
        # The server times neither the read of a request's body nor the write of its answer: a request is received
        # when its body is in (REQUEST_START) and sent when its answer is made (REQUEST_END).
        if self.protocol == "GRPC":
            return [info, *started, *core, at("REQUEST_END", end), at("GRPC_WAITREAD_START", timing.start),
                    at("GRPC_WAITREAD_END", timing.start), *answered, at("GRPC_SEND_START", end), at("GRPC_SEND_END", end)]  # fmt: skip
        return [at("HTTP_RECV_START", timing.start), at("HTTP_RECV_END", timing.start), info, *started, *answered,
                at("HTTP_SEND_START", end), at("HTTP_SEND_END", end), *core, at("REQUEST_END", end)]  # fmt: skip


class TraceManager:
    """The trace settings of this server, and the traces (triton mode) they sample."""

    def __init__(self, mode: str = "triton", file: str = ""):
        self.mode = mode
        self.file = TraceFile(file) if file else None
        self.fields: dict[str, set[str]] = {}  # model -> the fields given for it (Setting's names: level, rate, ...)
        #: "": the global setting; a model's, if fields were given for it. Spans are sampled by OTEL_TRACES_SAMPLER.
        self.settings: dict[str, Setting] = {"": Setting(rate=1) if mode == "opentelemetry" else Setting()}
        self._ids = 0
        #: Whether any setting traces (triton mode): the data plane samples only then.
        self.active = False
        #: What a null clears the global setting's field back to: its value at start (`--trace_config`).
        self.initial = self.settings[""].values()
        self._changed()

    # ------------------------------------------------------------ the settings

    def answer(self, model: str = "") -> dict[str, Any]:
        return self.settings.get(model, self.settings[""]).answer(self.file.path if self.file else "", self.mode)

    def update(self, model: str, changes: Mapping[str, Any]) -> dict[str, Any]:
        """A client's change of the global setting (`model` "") or of a model's, Triton's names and values (strings,
        the level a list of them; None clears a model's field back to the global one). Validated whole first."""
        parsed = self._parse(changes)
        if self.mode == "opentelemetry" and (model or set(parsed) - {"level"}):
            raise InvalidInput(
                "with trace_mode opentelemetry only the global trace_level changes at run time: the OTEL_TRACES_SAMPLER "
                "environment samples the spans"
            )
        if model:
            given = (self.fields.get(model, set()) | parsed.keys()) - {k for k, v in parsed.items() if v is None}
            values = {**self._model_values(model, self.settings[""].values()), **parsed}
            setting = self._checked(Setting(**{**self.settings[""].values(), **{k: values[k] for k in given}}))
            self._retire(self.settings.pop(model, None))
            if given:
                self.fields[model], self.settings[model] = given, setting
            else:
                self.fields.pop(model, None)
        elif parsed:
            values = {**self.settings[""].values(), **{k: self.initial[k] if v is None else v for k, v in parsed.items()}}
            made = {"": self._checked(Setting(**values))}
            made |= {m: self._checked(Setting(**self._model_values(m, values))) for m in self.fields}
            for setting in self.settings.values():
                self._retire(setting)
            self.settings = made
        self._changed()
        return self.answer(model)

    def _model_values(self, model: str, global_values: dict[str, Any]) -> dict[str, Any]:
        """A model's setting's values: the global ones, and those given for it as they are now (a count, counted down)."""
        current = self.settings.get(model)
        return {**global_values, **{k: current.values()[k] for k in self.fields.get(model, ())}} if current else global_values

    def _checked(self, setting: Setting) -> Setting:
        if setting.level and setting.rate == 0:
            raise InvalidInput("Attempting to set invalid trace setting :sample rate must be non-zero")
        if setting.level and self.mode == "triton" and self.file is None:
            raise InvalidInput("Attempting to set invalid trace setting :trace file name is not given")
        return setting

    def _changed(self) -> None:
        self.active = self.mode == "triton" and any(setting.level for setting in self.settings.values())

    @property
    def spans_on(self) -> bool:
        """Whether OpenTelemetry's spans are on (opentelemetry mode): `core.tracing.enabled` in every process."""
        return self.mode == "opentelemetry" and bool(self.settings[""].level)

    @staticmethod
    def _parse(changes: Mapping[str, Any]) -> dict[str, Any]:
        """Triton's names -> Setting's fields, checked as Triton checks them (its words), and more strictly:
        a number must be all digits, a level known (Triton reads "12abc" as 12 and skips an unknown level)."""
        if "trace_file" in changes:
            raise Unsupported("trace file location can not be updated through network protocol")
        if "trace_mode" in changes:
            raise Unsupported("trace mode can not be updated through network protocol: it is --trace_config mode=...")
        parsed: dict[str, Any] = {}
        for name, value in changes.items():
            if name == "trace_level":
                parsed["level"] = None if value is None else _levels(value)
            elif name in _NUMBERS:
                parsed[_NUMBERS[name][0]] = None if value is None else _number(name, value)
            else:
                raise InvalidInput(f"unknown trace setting '{name}': the settings are trace_level, trace_rate, "
                                   "trace_count, log_frequency, trace_file, trace_mode")  # fmt: skip
        return parsed

    # ------------------------------------------------------------ the traces (triton mode)

    def sample(self, model_name: str, request_id: str, protocol: str) -> Trace | None:
        """A trace of the request the data plane takes now, if its setting samples it."""
        setting = self.settings.get(model_name) or self.settings[""]
        if not setting.level or setting.count == 0:
            return None
        setting.sampled += 1
        if setting.sampled % setting.rate:
            return None
        if setting.count > 0:
            setting.count -= 1
        setting.traced += 1
        self._ids += 1
        return Trace(self, setting, self._ids, model_name, request_id, protocol)

    def collect(self, setting: Setting, trace: bytes) -> None:
        setting.ended += 1
        if setting.log_frequency == 0 and setting.count < 0 and self._current(setting):
            self._write(setting, [trace], indexed=False)  # straight on: a file that grows, not memory
            return
        setting.collected.append(trace)
        frequency_reached = setting.log_frequency and len(setting.collected) >= setting.log_frequency
        count_spent = setting.count == 0 and setting.ended == setting.traced
        if frequency_reached or count_spent:
            self._write(setting, setting.collected, indexed=True)
        elif not self._current(setting):  # of a setting changed since: written as it ended
            self._retire(setting)

    def _current(self, setting: Setting) -> bool:
        return any(s is setting for s in self.settings.values())

    def _retire(self, setting: Setting | None) -> None:
        """Writes what a setting that is changed (or at shutdown) collected, as Triton does when it drops one."""
        if setting is not None and setting.collected:
            self._write(setting, setting.collected, indexed=bool(setting.log_frequency) or setting.count >= 0)

    def _write(self, setting: Setting, traces: list[bytes], indexed: bool) -> None:
        try:
            (self.file.write_indexed if indexed else self.file.append)(traces)
        except OSError as error:
            log.error("cannot write the trace file: %s", error)
        setting.collected = []

    def close(self) -> None:
        """The server stops: every trace collected is written, and `<trace_file>` closed."""
        for setting in self.settings.values():
            self._retire(setting)
        if self.file is not None:
            self.file.close()


def _data(datatype: str, array: np.ndarray) -> str:
    """A tensor's values as Triton's tracer writes them (server/src/tracer.cc, TraceTensorActivity): C++'s default
    stream format (a float to 6 significant digits, a bool 0 or 1), a BYTES element in quotes, FP16 none; integers
    as numbers (Triton 2.51 writes an INT8 or UINT8 element as a raw character, which its trace_summary.py cannot
    read back)."""
    values = np.asarray(array).ravel().tolist()
    if datatype in ("FP32", "FP64"):
        return ",".join(f"{v:g}" for v in values)
    if datatype == "BOOL":
        return ",".join("1" if v else "0" for v in values)
    if datatype == "BYTES":
        return ",".join(f'"{v.decode(errors="replace") if isinstance(v, bytes) else v}"' for v in values)
    if datatype in ("FP16", "BF16"):
        return ""
    return ",".join(map(str, values))


#: Triton's numeric settings: (Setting's field, lowest, highest).
_NUMBERS = {"trace_rate": ("rate", 0, _UINT32_MAX), "trace_count": ("count", -1, _INT32_MAX), "log_frequency": ("log_frequency", 0, _UINT32_MAX)}


def _number(name: str, value: Any) -> int:
    if not isinstance(value, str):
        raise InvalidInput(f"expect one string for '{name}', got: {orjson.dumps(value).decode()}")
    _, lowest, highest = _NUMBERS[name]
    try:
        number = int(value)
    except ValueError:
        raise InvalidInput(f"Unable to parse '{name}', got: {value}") from None
    if name == "trace_count" and number < lowest:
        raise InvalidInput(f"Unable to parse 'trace_count'. Expecting value >= -1, got:{value}")
    if not lowest <= number <= highest:
        raise InvalidInput(f"Unable to parse '{name}', value is out of range [ {lowest}, {highest} ], got: {value}")
    return number


def _levels(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(level, str) for level in value):
        raise InvalidInput(f"expect 'trace_level' to be a list of levels ({', '.join(LEVELS)}), got: {orjson.dumps(value).decode()}")
    unknown = [level for level in value if level not in LEVELS]
    if unknown:
        raise InvalidInput(f"unknown trace level '{unknown[0]}': the levels are {', '.join(LEVELS)}")
    if "OFF" in value:
        if len(value) > 1:
            raise InvalidInput("Expect only one trace level 'OFF' is specified")
        return ()
    return tuple(level for level in LEVELS if level in value)


# ---------------------------------------------------------------- --trace_config


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace_config",
        action="append",
        default=[],
        metavar="[MODE,]SETTING=VALUE",
        help="Triton's --trace-config (repeatable): mode=triton|opentelemetry, level=OFF|TIMESTAMPS|TENSORS (repeat for "
        "both), rate=N, count=N, triton,file=PATH, triton,log-frequency=N. Changed at run time by /v2/trace/setting.",
    )


def manager_of(configs: list[str], enable_tracing: bool = False) -> TraceManager:
    """The trace manager `--trace_config` asks for (`--enable_tracing`: opentelemetry mode, level TIMESTAMPS);
    ValueError names what is wrong."""
    mode, file, levels, changes = ("opentelemetry" if enable_tracing else "triton"), "", [], {}
    for config in configs:
        scope, _, setting = config.rpartition(",")
        name, equals, value = setting.partition("=")
        name = name.replace("_", "-")
        if not equals or scope not in ("", *MODES):
            raise ValueError(f"--trace_config {config}: expected [triton,|opentelemetry,]SETTING=VALUE")
        if scope == "opentelemetry":
            raise ValueError(f"--trace_config {config}: OpenTelemetry's exporter is configured by the OTEL_* environment")
        if (name in ("file", "log-frequency")) != (scope == "triton"):  # Triton's scoping: the file's settings are triton's
            raise ValueError(f"--trace_config {config}: {'triton,' if scope == '' else ''}{name}={value} is how it is given")
        if name == "mode" and value in MODES:
            mode = value
        elif name == "file":
            file = value
        elif name == "level":
            levels.append(value)
        elif name in _FLAGS:
            changes[_FLAGS[name]] = value
        else:
            raise ValueError(f"--trace_config {config}: unknown setting or value")
    if enable_tracing and not levels:
        levels = ["TIMESTAMPS"]
    manager = TraceManager(mode, file)
    try:  # checked as a change of the defaults is checked
        manager.update("", {**changes, **({"trace_level": levels} if levels else {})})
    except InvalidInput as error:
        raise ValueError(f"--trace_config: {error}") from None
    manager.initial = manager.settings[""].values()
    return manager


#: --trace_config's names of the numeric settings -> the extension's.
_FLAGS = {"rate": "trace_rate", "count": "trace_count", "log-frequency": "log_frequency"}

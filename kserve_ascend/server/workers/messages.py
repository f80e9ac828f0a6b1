"""The messages between the engine and its frontends (`--workers N`): one msgspec Struct per kind, msgpack on the wire.

Control data crosses here (names, shapes, offsets, parameters, timings); tensor bytes never
do, they cross in shared memory (`arena`), and a message says where they lie. A message may
ride with a file descriptor (a memfd the receiver maps), passed by the kernel (SCM_RIGHTS).

The first message each way is `Hello`: an engine and a frontend of different `VERSION`s (a
frontend restarted from a package upgraded in place) refuse each other, naming both.
"""

from __future__ import annotations

import functools
import traceback
from typing import Any, Union

import msgspec
from tritonclient.grpc import model_config_pb2 as mc

from ...core.errors import AscendError, InvalidInput, ModelLoadError, ModelNotFound, ModelNotReady, Unavailable, Unsupported

#: Changes with any message's fields.
VERSION = 3


class Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Every message; `tag` names its kind on the wire."""


class Hello(Message):
    version: int


# ---------------------------------------------------------------- tensors


class Block(msgspec.Struct, array_like=True):
    """Where a message's tensors lie in the sender's arena: a span of one of its segments."""

    segment: int
    offset: int
    size: int


class Tensor(msgspec.Struct, array_like=True, omit_defaults=True):
    """One tensor: at `offset` of its message's block, or (`region`) of a shared memory region a client registered."""

    name: str
    datatype: str
    shape: list[int]
    offset: int
    nbytes: int
    region: str | None = None


class Segment(Message):
    """A new segment of the sender's arena: its memfd rides with this message."""

    number: int
    size: int


class Drop(Message):
    """A segment of the sender's arena is gone: unmap it once nothing refers to it."""

    number: int


class Free(Message):
    """The receiver of a block no longer reads it: the sender may write there again."""

    segment: int
    offset: int


# ---------------------------------------------------------------- frontend -> engine


class Infer(Message):
    """A decoded inference request, its tensors in the frontend's arena (`block`) or in registered regions."""

    call: int
    model_name: str
    model_version: str
    id: str
    outputs: list[str]
    parameters: dict[str, Any]
    classification: dict[str, int]
    received_ns: int
    block: Block | None
    inputs: list[Tensor]
    #: The request's log id, and (while tracing) its trace context: the engine's lines and spans join them.
    log_id: str | None = None
    trace: dict[str, str] | None = None
    #: What it came in by (HTTP or GRPC), for the trace extension's timestamps.
    protocol: str = "HTTP"
    #: Whether a decoupled model may answer with its responses (`DataPlane.infer`'s `streaming`): then `Streaming`,
    #: a `Response` each and `Final` answer it, not `Inferred`.
    streaming: bool = False


class Done(Message):
    """The frontend made the answer of an inference (or not, `answered` false; None: its client had left)."""

    call: int
    answer_ns: int
    answered: bool | None


class Call(Message):
    """A data-plane method other than `infer`, by name (`remote.FORWARDED`)."""

    call: int
    method: str
    args: list[Any]


class Cancel(Message):
    """The caller of `call` went away."""

    call: int


class Serving(Message):
    """The frontend listens."""


# ---------------------------------------------------------------- engine -> frontend


class Inferred(Message):
    """An inference's answer: its outputs in the engine's arena."""

    call: int
    model_name: str
    model_version: int
    block: Block | None
    outputs: list[Tensor]


class Streaming(Message):
    """A decoupled model took the request (`Infer` with `streaming`): its responses follow, then `Final` (or `Failed`)."""

    call: int
    model_name: str
    model_version: int


class Response(Message):
    """One response of a decoupled model: its outputs in the engine's arena."""

    call: int
    block: Block | None
    outputs: list[Tensor]


class Final(Message):
    """The final flag of a decoupled model's request: no response follows."""

    call: int


class Returned(Message):
    call: int
    value: Any = None


class Failed(Message):
    """A call or inference failed: a core error keeps its kind; a fault is "unexpected", with its type and traceback."""

    call: int
    kind: str
    message: str
    type_name: str = ""
    trace: str = ""


class Region(msgspec.Struct, array_like=True):
    """A registered system shared memory region; `serial` tells registrations under one name apart."""

    name: str
    key: str
    offset: int
    byte_size: int
    serial: int


class Regions(Message):
    """The shared memory regions registered, after `changes` changes."""

    changes: int
    regions: list[Region]


class ModelsChanged(Message):
    """The repository's models, after `generation` changes (loads, unloads): cached metadata and configs go."""

    generation: int
    names: list[str]


class Control(Message):
    """The engine's control page (`control.ControlPage`): its memfd rides with this message."""

    size: int


class LogSettings(Message):
    """The log settings now (`logs.settings()`), after a client changed them: every process applies them."""

    settings: dict[str, Any]


class TraceSpans(Message):
    """OpenTelemetry spans on or off (trace_mode opentelemetry): a client changed the trace level."""

    on: bool


class Stopping(Message):
    """Shutdown has begun: answers close their connections from now on."""


class Stop(Message):
    """Stop accepting, answer what was accepted, and exit."""


AnyMessage = Union[
    Hello, Segment, Drop, Free, Infer, Done, Call, Cancel, Serving, Inferred, Streaming, Response, Final, Returned, Failed,
    Regions, ModelsChanged, Control, LogSettings, TraceSpans, Stopping, Stop,
]

_CONFIG = 1  # msgpack extension code of a ModelConfig (a data-plane call's value)


def _encode_other(value: Any) -> Any:
    if isinstance(value, mc.ModelConfig):
        return msgspec.msgpack.Ext(_CONFIG, value.SerializeToString())
    raise NotImplementedError(f"{type(value).__name__} cannot cross between the engine and a frontend")


def _decode_ext(code: int, data: memoryview) -> Any:
    if code == _CONFIG:
        return mc.ModelConfig.FromString(data)
    raise ValueError(f"unknown msgpack extension {code}")


encoder = msgspec.msgpack.Encoder(enc_hook=_encode_other)
decoder = msgspec.msgpack.Decoder(AnyMessage, ext_hook=_decode_ext)


def mismatch(hello: Message, side: str) -> str | None:
    """Why the peer's first message refuses it (None if it is this version's Hello)."""
    if not isinstance(hello, Hello):
        return f"the {side} sent {type(hello).__name__} before Hello: it speaks another version of the messages"
    if hello.version != VERSION:
        return (
            f"the {side} speaks version {hello.version} of the messages, this process {VERSION}: "
            "restart the server so that every process runs the same kserve-ascend"
        )
    return None


# ---------------------------------------------------------------- errors across the processes

#: Core errors that keep their type across, so the edges answer them with their own status.
_ERRORS = {cls.__name__: cls for cls in (InvalidInput, ModelNotFound, ModelNotReady, Unavailable, ModelLoadError, Unsupported)}


def failure(call: int, error: BaseException) -> Failed:
    """An error as it crosses: a core error's kind and message; of any other (a fault), also its type's name and
    traceback (call it in the `except` block)."""
    if isinstance(error, AscendError):
        return Failed(call, type(error).__name__, str(error))
    return Failed(call, "unexpected", str(error), type(error).__name__, traceback.format_exc())


def raised(failed: Failed) -> Exception:
    """The error the engine raised, rebuilt in a frontend.

    A core error keeps its type if the edges map it to a status (else it is a 500 with its
    message). Any other error is a fault: rebuilt under its own type's name, which the edges
    show, and caused by its traceback in the engine, which they log, as concurrent.futures
    shows a process pool worker's.
    """
    if failed.kind != "unexpected":
        return _ERRORS.get(failed.kind, AscendError)(failed.message)
    error = _fault_type(failed.type_name)(failed.message)
    error.__cause__ = RemoteTraceback(failed.trace)
    return error


class RemoteTraceback(Exception):
    """The traceback of an error raised in the engine process."""

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.args[0]}\"\"\""


@functools.lru_cache(maxsize=64)
def _fault_type(name: str) -> type:
    return type(name, (Exception,), {"__module__": "engine"})

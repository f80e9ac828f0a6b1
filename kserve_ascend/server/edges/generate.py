"""Triton's generate extension (`POST /v2/models/{model}[/versions/{v}]/generate` and `/generate_stream`): a flat
JSON object in, a flat JSON object out per response, the stream as Server-Sent Events.

As Triton 2.51 converts them (server src/http_server.cc, `GenerateRequestClass`; docs/protocol/
extension_generate.md), checked against it on the wire:
- a key naming a model input is that input: a scalar or a list, of the input's datatype, shaped from the
  model's metadata shape: its fixed dimensions take the elements first (innermost out), then the innermost
  variable dimension takes what is left, the others 1 (`[-1, 16]` and 16 values: `[1, 16]`), else 400 "The
  schema can not convert input '<name>' to tensor with proper shape";
- any other key is a request parameter (a string, a number or a bool; else 400 in Triton's words), `id` is
  also the request's id, and the members of an object under `parameters` are read the same way;
- an answer is one object: `model_name`, `model_version`, `id` if the request had one, and each output by
  name, a lone element as a scalar and more as a flat list, keys in byte order (Triton writes a std::map);
- /generate answers an ordinary model's one response; a decoupled model must send exactly one response,
  else the answer (its status already 200) is Triton's error "generate expects model to produce exactly 1
  response, ..."; /generate_stream sends `data: {...}` and a blank line per response
  (`text/event-stream; charset=utf-8`), an error of the model as `data: {"error": "..."}`, and the status is
  that of the first response (an error's own status when the model fails at once).
A request refused before the model (malformed, unknown model, missing input) is a plain JSON error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import numpy as np
import orjson

from ...core.errors import InvalidInput
from ..dataplane import InferRequest, ResponseStream
from .codec import _from_json_data, _json_strings, json_object
from .status import http_status, logged

log = logging.getLogger(__name__)

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json")]
#: Triton's answer on /generate when a decoupled model does not send exactly one response (server src/http_server.cc).
NOT_ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that generates various number of responses"
)
#: The key whose object holds more inputs and parameters (Triton's provisional generate schema).
PARAMETERS = "parameters"


def decode_generate(
    body: bytes, inputs: list[Mapping[str, Any]], model_name: str, model_version: str, received_ns: int
) -> InferRequest:
    """A generate request as an inference request; `inputs`: the model's metadata inputs (name, datatype, shape)."""
    obj = json_object(body)
    request_id = obj.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidInput("Unable to parse 'id': the request's 'id' must be a string")
    declared = {tensor["name"]: tensor for tensor in inputs}
    tensors: dict[str, np.ndarray] = {}
    parameters: dict[str, Any] = {}
    _read(obj, declared, tensors, parameters, nested=True)
    return InferRequest(model_name, tensors, model_version, request_id, (), parameters, received_ns=received_ns)


def _read(obj: Mapping[str, Any], declared: Mapping, tensors: dict, parameters: dict, nested: bool) -> None:
    for key, value in obj.items():
        if nested and key == PARAMETERS:
            if key in declared:
                raise InvalidInput(f"Keyword '{key}' for nested schema also given as input tensor name")
            if not isinstance(value, dict):
                raise InvalidInput(f"Expected JSON object for keyword: '{key}'")
            _read(value, declared, tensors, parameters, nested=False)
        elif key in declared:
            if key in tensors:
                raise InvalidInput(f"input '{key}' appears twice")
            tensors[key] = _tensor(key, value, declared[key])
        elif isinstance(value, (str, int, float)):  # a bool is an int
            parameters[key] = value
        else:
            raise InvalidInput(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")


def _tensor(name: str, value: Any, declared: Mapping[str, Any]) -> np.ndarray:
    """A key's value as the input, shaped as Triton's ExactMappingInput shapes it."""
    values = value if isinstance(value, list) else [value]
    count = len(values)
    shape = list(declared["shape"])
    refused = InvalidInput(f"The schema can not convert input '{name}' to tensor with proper shape")
    for dimension in reversed(shape):
        if dimension != -1:
            if count % dimension:
                raise refused
            count //= dimension
    for index in reversed(range(len(shape))):
        if shape[index] == -1:
            shape[index], count = count, 1
    if count != 1:
        raise refused
    return _from_json_data(values, declared["datatype"], tuple(shape), f"input '{name}'")


def encode_generate(model_name: str, model_version: int, request_id: str, outputs: Mapping[str, np.ndarray]) -> bytes:
    """One response as generate's JSON object."""
    answer: dict[str, Any] = {"model_name": model_name, "model_version": str(model_version)}
    if request_id:
        answer["id"] = request_id
    for name, array in outputs.items():
        values = _json_strings(array, name) if array.dtype == np.object_ else np.ascontiguousarray(array).ravel().tolist()
        answer[name] = values[0] if len(values) == 1 else values
    return orjson.dumps(answer, option=orjson.OPT_SORT_KEYS)


def event(payload: bytes) -> bytes:
    """One Server-Sent Event carrying `payload`."""
    return b"data: " + payload + b"\n\n"


def error_json(error: BaseException) -> bytes:
    """A model's error within an answer already under way (logged)."""
    return orjson.dumps({"error": logged(log, "generate", error)})


async def decoupled_answer(stream: ResponseStream, request_id: str) -> tuple[int, bytes]:
    """/generate of a decoupled model: its one response, or Triton's error when it sends another number of them;
    the status is that of the first response (200 when there is none)."""
    answers, status = [], None
    try:
        async for outputs in stream:
            answers.append(encode_generate(stream.model_name, stream.model_version, request_id, outputs))
            status = status or 200
    except Exception as error:  # the model's error: its last response
        answers.append(error_json(error))
        status = status or http_status(error)
    finally:
        await stream.aclose()
    return status or 200, answers[0] if len(answers) == 1 else orjson.dumps({"error": NOT_ONE_RESPONSE})


class Events:
    """/generate_stream of a decoupled model: its Server-Sent Events, each sent as the model produces it. `opened`
    reads the first response, whose status is the answer's; `aclose` stops the model (also if never iterated)."""

    def __init__(self, stream: ResponseStream, request_id: str):
        self.stream, self.request_id = stream, request_id
        self._responses = stream.__aiter__()
        self._first: bytes | None = None
        self.status = 200

    async def opened(self) -> Events:
        try:
            self._first = self._event(await anext(self._responses))
        except StopAsyncIteration:
            pass
        except Exception as error:  # the model failed at once: the answer has its status
            self._first, self.status = event(error_json(error)), http_status(error)
        return self

    def _event(self, outputs: Mapping[str, np.ndarray]) -> bytes:
        return event(encode_generate(self.stream.model_name, self.stream.model_version, self.request_id, outputs))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._first is None:
            return
        yield self._first
        if self.status != 200:
            return
        try:
            async for outputs in self._responses:
                yield self._event(outputs)
        except Exception as error:  # the model's error ends its stream
            yield event(error_json(error))

    async def aclose(self) -> None:
        await self.stream.aclose()

"""KServe's V1 protocol bodies <-> numpy, for any model of the repository.

Two layouts, as TF Serving defines them (and KServe V1 follows):
- columnar: `{"inputs": {"name": tensor, ...}}` (or a bare tensor, see `named`),
  answered with `{"outputs": {"name": tensor, ...}}`;
- row: `{"instances": [row, ...]}`, each row `{"name": value, ...}` (or a bare value, see
  `named`), answered with `{"predictions": [{"name": value, ...}, ...]}`.
Outputs are always named, whatever their number. BYTES values are strings, or
`{"b64": "..."}` for binary data (an encoded image). An optional `"parameters"` object
is the request's parameters, as in OIP v2.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Mapping

import numpy as np
import orjson

from ...core.errors import InvalidInput
from ...core.signature import Signature
from .codec import json_numbers


def parse(body: Any) -> tuple[str, Any, dict]:
    """The layout ("inputs" or "instances"), its value and the request parameters of a V1 body."""
    if isinstance(body, (bytes, bytearray)):
        # KServe decodes only a body sent as JSON; `curl -d` sends it as a form, as the OIP routes accept.
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError as error:
            raise InvalidInput(f"a V1 request body must be JSON: {error}") from None
    if not isinstance(body, dict):
        raise InvalidInput('a V1 request body is a JSON object with "instances" (rows) or "inputs" (columns)')
    layouts = [key for key in ("instances", "inputs") if key in body]
    if len(layouts) != 1:
        raise InvalidInput('a V1 request body has exactly one of "instances" (rows) and "inputs" (columns)')
    parameters = body.get("parameters")
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise InvalidInput('"parameters" of a V1 request must be a JSON object')
    layout = layouts[0]
    if layout == "instances" and (not isinstance(body[layout], list) or not body[layout]):
        raise InvalidInput('"instances" must be a non-empty list of rows')
    return layout, body[layout], parameters


def named(value: Any, signature: Signature, what: str) -> dict[str, Any]:
    """`{"name": value}` as given, or a bare value named after the one input it can be for."""
    if isinstance(value, dict) and "b64" not in value:
        for name in value:
            if name not in signature.inputs:
                raise InvalidInput(f"unexpected input '{name}' in {what}, the model's inputs are {sorted(signature.inputs)}")
        return value
    name = _bare_input(value, signature)
    if name is None:
        raise InvalidInput(f'{what} must name its inputs, as {{"name": value}}: the model has {sorted(signature.inputs)}')
    return {name: value}


def _bare_input(value: Any, signature: Signature) -> str | None:
    """The model's only input; else its only required one; else, when every input is optional (one
    of them per request, as the detection ensemble's image or tensor), the only one of the value's
    kind: BYTES for text or `{"b64": ...}`, a numeric input for numbers. None when that is not one input."""
    decls = list(signature.inputs.values())
    required = [decl for decl in decls if not decl.optional]
    if len(decls) == 1:
        return decls[0].name
    if required:
        return required[0].name if len(required) == 1 else None
    text = _holds_text(value)
    fitting = [decl.name for decl in decls if text is not None and (decl.datatype == "BYTES") == text]
    return fitting[0] if len(fitting) == 1 else None


def _holds_text(value: Any) -> bool | None:
    """Whether a JSON (nested) value holds text (BYTES) or numbers, by its first element; None if neither."""
    while isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, (str, dict)):
        return True
    return False if isinstance(value, (int, float)) else None


def tensor(value: Any, datatype: str, what: str) -> np.ndarray:
    """A JSON (nested) list or scalar as an array of the input's datatype."""
    if datatype != "BYTES":
        return json_numbers(value, datatype, what)
    try:
        array = np.asarray(value, dtype=object)
    except ValueError:
        raise InvalidInput(f"{what} is not a regular array") from None
    elements = np.empty(array.shape, dtype=object)
    for index, item in np.ndenumerate(array):
        elements[index] = _bytes(item, what)
    return elements


def _bytes(item: Any, what: str) -> bytes:
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, dict) and set(item) == {"b64"} and isinstance(item["b64"], str):
        try:
            return base64.b64decode(item["b64"], validate=True)
        except binascii.Error:
            raise InvalidInput(f"'b64' of {what} is not base64") from None
    raise InvalidInput(f"{what} holds BYTES: strings, or {{\"b64\": \"...\"}} for binary data")


def inputs(columns: Mapping[str, Any], signature: Signature) -> dict[str, np.ndarray]:
    """Named JSON tensors as the model's inputs.

    A model that does not batch and takes [1, ...] also takes the tensor without that
    leading 1 (the CANN design's clients send a YOLO input either way).
    """
    arrays = {}
    for name, value in columns.items():
        decl = signature.inputs[name]
        array = tensor(value, decl.datatype, f"input '{name}'")
        if not signature.batching and decl.dims[:1] == (1,) and array.ndim == len(decl.dims) - 1:
            array = array[None]
        arrays[name] = array
    return arrays


def rows(instances: list, signature: Signature) -> dict[str, np.ndarray]:
    """Rows stacked along a new batch dimension, for a model that batches."""
    named_rows = [named(row, signature, f"instance {i}") for i, row in enumerate(instances)]
    names = set(named_rows[0])
    if any(set(row) != names for row in named_rows):
        raise InvalidInput("every instance must name the same inputs")
    return {name: tensor([row[name] for row in named_rows], signature.inputs[name].datatype, f"input '{name}'") for name in names}


_TEXT = np.frompyfunc(lambda x: x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x), 1, 1)


def jsonable(array: np.ndarray) -> Any:
    return (_TEXT(array) if array.dtype == np.object_ else array).tolist()


def columns(outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return {"outputs": {name: jsonable(array) for name, array in outputs.items()}}


def predictions(outputs: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """A batching model's outputs split into one named row per instance."""
    count = len(next(iter(outputs.values())))
    return [{name: jsonable(array[i]) for name, array in outputs.items()} for i in range(count)]

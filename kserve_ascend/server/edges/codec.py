"""Tensors on the wire <-> numpy: OIP JSON, the binary tensor data extension, and gRPC.

Decoding is where client mistakes are caught: every malformed field raises
`InvalidInput` with a message naming it. Nothing here knows about models. Tensors in
shared memory (Triton's extension) are looked up in the regions the edge passes in.
A request decodes to the data plane's `InferRequest` and to how its answer is to be written
(`AnswerFormat`), which stays at the edge.

The edges decode and encode a large body off the event loop (`offload`).
"""

from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np
import orjson
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from ...core import datatypes
from ...core.errors import InvalidInput
from ...core.models.classification import classification_count
from ..dataplane import RAW_INPUT, InferRequest, RegionViews

log = logging.getLogger(__name__)

#: Header of the binary tensor data extension: length of the JSON part of the body.
HEADER_LENGTH = "inference-header-content-length"


class ShmSlice(NamedTuple):
    """Where a tensor lives in a registered shared memory region."""

    region: str
    offset: int
    view: memoryview


@dataclass(slots=True)
class AnswerFormat:
    """How the edge writes a request's answer."""

    #: Requested outputs, each with whether it is wanted as binary data.
    binary: dict[str, bool] = field(default_factory=dict)
    #: For an output not requested by name: whether binary (REST's `binary_data_output`; gRPC's are all raw).
    binary_default: bool = False
    #: Requested outputs to write into shared memory rather than into the response.
    shm_outputs: dict[str, ShmSlice] = field(default_factory=dict)


#: A decoded request: what the data plane runs, and how its answer is to be written.
Decoded = tuple[InferRequest, AnswerFormat]


# ---------------------------------------------------------------- REST (JSON and binary)


def _field(obj: Mapping, key: str, kind: type | tuple, what: str, required: bool = True):
    value = obj.get(key)
    if value is None:
        if required:
            raise InvalidInput(f"{what} has no '{key}'")
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise InvalidInput(f"'{key}' of {what} must be {getattr(kind, '__name__', kind)}")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise InvalidInput(f"'shape' of {what} must be a list of non-negative integers")
    return _bounded(tuple(value), what)


#: numpy's limits on an array (1.x): its rank, and its size in bytes (at up to 8 bytes an element)
#: in an intp. They bind even an empty tensor, whose other dimensions are still allocated for.
_MAX_RANK = 32
_MAX_ELEMENTS = np.iinfo(np.intp).max // 8


def _bounded(shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """The shape, if an array can have it; checked before any count is taken of it."""
    if len(shape) > _MAX_RANK:
        raise InvalidInput(f"'shape' of {what} has {len(shape)} dimensions, more than the {_MAX_RANK} a tensor can have")
    if math.prod(d for d in shape if d) > _MAX_ELEMENTS:
        raise InvalidInput(f"'shape' of {what} {list(shape)} is larger than a tensor can be")
    return shape


def _datatype(value: Any, what: str) -> str:
    if value not in datatypes.OIP_DATATYPES:
        raise InvalidInput(f"'datatype' of {what} must be one of {', '.join(datatypes.OIP_DATATYPES)}, got {value!r}")
    return value


def _from_json_data(data: Any, datatype: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        flat = np.asarray(data, dtype=object).ravel()
        if not all(isinstance(x, (str, bytes)) for x in flat):
            raise InvalidInput(f"'data' of {what} must hold strings for datatype BYTES")
        array = np.array([x.encode() if isinstance(x, str) else x for x in flat] or [], dtype=object)
    else:
        array = json_numbers(data, datatype, f"'data' of {what}")
    if array.size != count:
        raise InvalidInput(f"{what} has {array.size} elements in 'data' but shape {list(shape)} needs {count}")
    return array.reshape(shape)


def json_numbers(data: Any, datatype: str, what: str) -> np.ndarray:
    """JSON numbers (a scalar or nested lists) as an array of a numeric `datatype`, in their own shape.

    Refused unless regular, of a kind the datatype holds exactly, and in its range.
    """
    try:
        array = np.asarray(data)
    except ValueError:
        raise InvalidInput(f"{what} is not a regular array") from None
    dtype = datatypes.to_numpy(datatype)
    if dtype.kind in "iu" and array.dtype.kind in "fO":
        array = _exact_integers(data, what, datatype)  # e.g. UINT64 values past INT64's range
    if array.size and array.dtype.kind not in _JSON_KINDS[dtype.kind]:
        raise InvalidInput(f"{what} holds {array.dtype.kind!r}-kind values, not {datatype}")
    if dtype.kind in "iu" and array.size and not np.can_cast(array.dtype, dtype):
        low, high = _INTEGER_RANGES[dtype]
        if array.min() < low or array.max() > high:
            raise InvalidInput(f"{what} has values out of the range of {datatype}")
    return array.astype(dtype, copy=False)


def _exact_integers(data: Any, what: str, datatype: str) -> np.ndarray:
    """Integers numpy widened to float or object (mixed magnitudes): kept exact, or refused."""
    values = np.asarray(data, dtype=object)
    flat = values.ravel()
    if not all(type(x) is int for x in flat):
        raise InvalidInput(f"{what} holds values that are not integers, not {datatype}")
    low, high = min(flat, default=0), max(flat, default=0)
    dtype = datatypes.to_numpy(datatype)
    if low < np.iinfo(dtype).min or high > np.iinfo(dtype).max:
        raise InvalidInput(f"{what} has values out of the range of {datatype}")
    return np.array(flat.tolist(), dtype=dtype).reshape(values.shape)


# numpy kinds of JSON values acceptable for each target kind: ints widen to floats, never the reverse.
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_INTEGER_RANGES = {
    dtype: (np.iinfo(dtype).min, np.iinfo(dtype).max)
    for dtype in map(datatypes.to_numpy, datatypes.OIP_DATATYPES)
    if dtype.kind in "iu"
}


def _from_binary(
    chunk: memoryview, datatype: str, shape: tuple[int, ...], what: str, source: str = "binary data"
) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        try:
            array = deserialize_bytes_tensor(bytes(chunk))
        except (struct.error, ValueError):
            raise InvalidInput(f"{source} of {what} is not a length-prefixed BYTES tensor") from None
        if array.size != count:
            raise InvalidInput(f"{what} has {array.size} BYTES elements but shape {list(shape)} needs {count}")
        return array.reshape(shape)
    dtype = datatypes.to_numpy(datatype)
    if len(chunk) != count * dtype.itemsize:
        raise InvalidInput(
            f"{what} has {len(chunk)} bytes of {source} but shape {list(shape)} of {datatype} needs {count * dtype.itemsize}"
        )
    return np.frombuffer(chunk, dtype=dtype).reshape(shape)


_SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


def _shm_slice(params: Mapping[str, Any], regions: RegionViews, what: str) -> ShmSlice | None:
    """The shared memory a tensor's parameters place it in, bounds-checked; None if they place it nowhere."""
    if not any(key in params for key in _SHM_PARAMETERS):
        return None
    region, size, offset = (params.get(key) for key in _SHM_PARAMETERS)
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{what} has shared memory parameters but no 'shared_memory_region' name")
    if size is None:
        raise InvalidInput(f"{what} names shared memory region '{region}' but has no 'shared_memory_byte_size'")
    offset = 0 if offset is None else offset
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInput(f"'{key}' of {what} must be a non-negative integer, got {value!r}")
    return ShmSlice(region, offset, regions.view(region, offset, size, what))


def _from_shm(placed: ShmSlice, datatype: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    # Zero-copy, and read-only so that no model can write into the client's memory.
    return _from_binary(placed.view.toreadonly(), datatype, shape, what, source="shared memory")


def _to_shm(placed: ShmSlice, array: np.ndarray, what: str) -> None:
    """Writes an output where the request placed it.

    The response then names the output with its datatype and shape only, as Triton's does
    (server src/http_server.cc, src/grpc/infer_handler.h): no `parameters`, which Triton's
    C++ HTTP client would take for binary data lacking its `binary_data_size`.
    """
    blob = _tensor_bytes(array) if array.dtype == np.object_ else None
    size = len(blob) if blob is not None else array.nbytes
    if size > len(placed.view):
        raise InvalidInput(
            f"{what} needs {size} bytes but its 'shared_memory_byte_size' in region '{placed.region}' is {len(placed.view)}"
        )
    if blob is not None:
        placed.view[:size] = blob
    else:
        np.frombuffer(placed.view[:size], dtype=array.dtype).reshape(array.shape)[...] = array


def json_object(body: bytes | memoryview) -> dict:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise InvalidInput(f"malformed JSON in request body: {error}") from None
    if not isinstance(obj, dict):
        raise InvalidInput("request body must be a JSON object")
    return obj


def _new_input_name(name: str, inputs: Mapping[str, np.ndarray]) -> str:
    """An input's name, refused when empty (no model input has that name: it stands for a raw binary
    request's body, `RAW_INPUT`) or when an earlier input of the request has it."""
    if not name:
        raise InvalidInput("an input has an empty 'name'")
    if name in inputs:
        raise InvalidInput(f"input '{name}' appears twice")
    return name


def decode_rest(
    body: bytes, header_length: str | None, regions: RegionViews, model_name: str, model_version: str, received_ns: int
) -> Decoded:
    """Decodes an OIP REST infer request: JSON, JSON header plus binary tensor data, or shared memory."""
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise InvalidInput(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise InvalidInput(f"Inference-Header-Content-Length {length} is outside the body of {len(body)} bytes")
        if length == 0:  # a raw binary request: the body is the model's one input, answered all binary
            request = InferRequest(model_name, {RAW_INPUT: np.frombuffer(body, np.uint8)}, model_version, received_ns=received_ns)
            return request, AnswerFormat(binary_default=True)
        view = memoryview(body)
        header, binary = view[:length], view[length:]
    obj = json_object(header)
    request_id = _field(obj, "id", str, "the request", required=False) or ""
    parameters = _field(obj, "parameters", dict, "the request", required=False) or {}
    raw_inputs = _field(obj, "inputs", list, "the request")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for item in raw_inputs:
        if not isinstance(item, dict):
            raise InvalidInput("each element of 'inputs' must be a JSON object")
        name = _new_input_name(_field(item, "name", str, "an input"), inputs)
        what = f"input '{name}'"
        shape = _shape(item.get("shape"), what)
        datatype = _datatype(item.get("datatype"), what)
        params = _field(item, "parameters", dict, what, required=False) or {}
        placed = _shm_slice(params, regions, what) if params else None
        size = params.get("binary_data_size") if params else None
        if placed is not None:
            if size is not None or item.get("data") is not None:
                raise InvalidInput(f"{what} is in shared memory and must not also have 'data' or 'binary_data_size'")
            inputs[name] = _from_shm(placed, datatype, shape, what)
        elif size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInput(f"'binary_data_size' of {what} must be a non-negative integer")
            if offset + size > len(binary):
                raise InvalidInput(f"{what} needs {size} bytes of binary data, only {len(binary) - offset} remain")
            inputs[name] = _from_binary(binary[offset : offset + size], datatype, shape, what)
            offset += size
        elif item.get("data") is not None:
            inputs[name] = _from_json_data(item["data"], datatype, shape, what)
        else:
            raise InvalidInput(f"{what} has neither 'data' nor a 'binary_data_size' parameter")
    if offset != len(binary):
        raise InvalidInput(f"the request carries {len(binary) - offset} bytes of binary data that no input claims")
    outputs: dict[str, bool] = {}
    shm_outputs: dict[str, ShmSlice] = {}
    classification: dict[str, int] = {}
    for item in _field(obj, "outputs", list, "the request", required=False) or []:
        if not isinstance(item, dict):
            raise InvalidInput("each element of 'outputs' must be a JSON object")
        name = _field(item, "name", str, "a requested output")
        params = _field(item, "parameters", dict, f"output '{name}'", required=False) or {}
        if "classification" in params:
            classification[name] = _classification(name, params["classification"], "shared_memory_region" in params)
        outputs[name] = bool(params.get("binary_data", False))
        placed = _shm_slice(params, regions, f"output '{name}'")
        if placed is not None:
            shm_outputs[name] = placed
    request = InferRequest(
        model_name, inputs, model_version, request_id, tuple(outputs), parameters, classification, received_ns
    )
    return request, AnswerFormat(outputs, bool(parameters.get("binary_data_output", False)), shm_outputs)


def _classification(name: str, count: Any, in_shared_memory: bool) -> int:
    """How many classes a requested output returns; in shared memory goes what the model wrote, never classes."""
    if in_shared_memory:
        raise InvalidInput(f"output '{name}' can't set both 'shared_memory_region' and 'classification'")
    return classification_count(count, name)


def _tensor_bytes(array: np.ndarray) -> bytes:
    if array.dtype == np.object_:
        # tritonclient returns a 0-d object array holding the serialized bytes.
        return serialize_byte_tensor(array).item()
    return np.ascontiguousarray(array).tobytes()


def encode_rest(
    model_name: str, version: int, request_id: str, outputs: Mapping[str, np.ndarray], answer: AnswerFormat
) -> tuple[bytes, int | None]:
    """Encodes an infer response; returns the body and the JSON header's length if binary parts follow."""
    entries, blobs = [], []
    for name, array in outputs.items():
        entry: dict[str, Any] = {"name": name, "datatype": datatypes.from_numpy(array.dtype), "shape": array.shape}
        if name in answer.shm_outputs:
            _to_shm(answer.shm_outputs[name], array, f"output '{name}'")
        elif answer.binary.get(name, answer.binary_default):
            blob = _tensor_bytes(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif array.dtype == np.object_:
            entry["data"] = _json_strings(array, name)
        else:
            entry["data"] = np.ascontiguousarray(array).ravel()
        entries.append(entry)
    response: dict[str, Any] = {"model_name": model_name, "model_version": str(version), "outputs": entries}
    if request_id:
        response["id"] = request_id
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _json_strings(array: np.ndarray, name: str) -> list[str]:
    """A BYTES output as JSON strings, which hold only text: bytes that are not UTF-8 are refused, not altered."""
    strings = []
    for index, value in enumerate(array.ravel()):
        try:
            strings.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidInput(
                f"output '{name}' element {index} is not UTF-8 text, which JSON cannot carry:"
                " request the output as binary data (parameters binary_data: true)"
            ) from None
    return strings


# ---------------------------------------------------------------- gRPC

#: InferTensorContents field holding each datatype (FP16 travels only as raw contents).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

#: Carried in 32-bit contents fields: a value past the type's range would silently wrap.
_NARROWER_THAN_CONTENTS = frozenset({"INT8", "INT16", "UINT8", "UINT16"})


def _grpc_parameter(value: pb.InferParameter) -> Any:
    choice = value.WhichOneof("parameter_choice")
    return getattr(value, choice) if choice else None


def _grpc_parameters(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {key: _grpc_parameter(value) for key, value in parameters.items()}


def decode_grpc(request: pb.ModelInferRequest, regions: RegionViews, received_ns: int) -> Decoded:
    """Decodes a gRPC ModelInferRequest, with raw or typed input contents, or in shared memory."""
    raw = request.raw_input_contents
    tensors = request.inputs
    placements = [
        _shm_slice(_grpc_parameters(t.parameters), regions, f"input '{t.name}'") if t.parameters else None for t in tensors
    ]
    mixed = next((t.name for t in tensors if t.HasField("contents")), None) if raw else None
    if mixed is not None:
        # Triton's words (server src/grpc/infer_handler.cc), which its grpc_explicit_*_content_client examples check.
        raise InvalidInput(
            f"contents field must not be specified when using raw_input_contents for '{mixed}' for model '{request.model_name}'"
        )
    # raw_input_contents holds, in order, the inputs that are not in shared memory (as in Triton).
    in_band = placements.count(None)
    if raw and len(raw) != in_band:
        outside = " outside shared memory" if in_band < len(placements) else ""
        raise InvalidInput(f"{len(raw)} raw_input_contents for {in_band} inputs{outside}")
    contents = iter(raw)
    inputs: dict[str, np.ndarray] = {}
    for tensor, placed in zip(tensors, placements):
        what = f"input '{_new_input_name(tensor.name, inputs)}'"
        datatype = _datatype(tensor.datatype, what)
        shape = tuple(tensor.shape)
        if shape and min(shape) < 0:
            raise InvalidInput(f"'shape' of {what} must be non-negative")
        shape = _bounded(shape, what)
        if placed is not None:
            if tensor.HasField("contents"):
                raise InvalidInput(f"{what} is in shared memory and must not also have contents")
            inputs[tensor.name] = _from_shm(placed, datatype, shape, what)
            continue
        if raw:
            inputs[tensor.name] = _from_binary(memoryview(next(contents)), datatype, shape, what)
            continue
        if datatype == "FP16":
            raise InvalidInput(f"{what} is FP16, which gRPC carries only in raw_input_contents")
        values = getattr(tensor.contents, _CONTENTS_FIELD[datatype])
        dtype = datatypes.to_numpy(datatype)
        if datatype in _NARROWER_THAN_CONTENTS:
            wide = np.array(values, dtype=np.int64)
            if wide.size and (wide.min() < np.iinfo(dtype).min or wide.max() > np.iinfo(dtype).max):
                raise InvalidInput(f"contents of {what} have values out of the range of {datatype}")
        array = np.array(values, dtype=dtype) if datatype != "BYTES" else np.array(list(values), dtype=object)
        if array.size != math.prod(shape):
            raise InvalidInput(f"{what} has {array.size} elements in contents but shape {list(shape)} needs {math.prod(shape)}")
        inputs[tensor.name] = array.reshape(shape)
    outputs = {}
    shm_outputs: dict[str, ShmSlice] = {}
    classification: dict[str, int] = {}
    for requested in request.outputs:
        parameters = requested.parameters
        if not parameters:
            outputs[requested.name] = True
            continue
        if "classification" in parameters:
            count = parameters["classification"]
            if count.WhichOneof("parameter_choice") != "int64_param":
                raise InvalidInput(f"'classification' of output '{requested.name}' must be an int64_param")
            classification[requested.name] = _classification(
                requested.name, count.int64_param, "shared_memory_region" in parameters
            )
        outputs[requested.name] = True
        placed = _shm_slice(_grpc_parameters(parameters), regions, f"output '{requested.name}'")
        if placed is not None:
            shm_outputs[requested.name] = placed
    parameters = _grpc_parameters(request.parameters) if request.parameters else {}
    decoded = InferRequest(
        request.model_name, inputs, request.model_version, request.id, tuple(outputs), parameters, classification, received_ns, "GRPC"
    )
    return decoded, AnswerFormat(outputs, True, shm_outputs)


def encode_grpc(
    model_name: str, version: int, request_id: str, outputs: Mapping[str, np.ndarray], answer: AnswerFormat
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model_name, model_version=str(version), id=request_id)
    for name, array in outputs.items():
        response.outputs.add(name=name, datatype=datatypes.from_numpy(array.dtype), shape=array.shape)
        if name in answer.shm_outputs:
            _to_shm(answer.shm_outputs[name], array, f"output '{name}'")
            # An empty entry keeps raw_output_contents aligned with outputs, as Triton does.
            response.raw_output_contents.append(b"")
        else:
            response.raw_output_contents.append(_tensor_bytes(array))
    return response

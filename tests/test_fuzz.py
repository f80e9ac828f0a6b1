"""Property-based fuzzing of request parsing: whatever a client sends, it gets a success or a client error.

Hypothesis generates OIP v2 inference requests that are mostly well formed but wrong in
many ways (datatypes, shapes, nesting, JSON types, missing and extra keys, parameters,
binary lengths, shared memory placements), and plain garbage, and sends them over the
wire to a real server process serving `simple` (INT32 [16] twice, max_batch_size 8) and
`sim` (FP32 [4]), with one shared memory region registered. The properties:

- REST answers 200 or 4xx, and a 4xx body is `{"error": "<message>"}`;
- gRPC answers OK or a client status, never INTERNAL or UNKNOWN, except for bytes that
  are not a protobuf message at all: grpcio rejects those before the servicer runs;
  on ModelStreamInfer each request gets its response or its error, and the stream goes on;
- after each run the server still answers a good request correctly.

Runs are derandomized and keep no example database, so every run sends the same requests.
"""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Callable
from urllib.parse import quote

import grpc
import numpy as np
import pytest
import requests
import tritonclient.utils.shared_memory as shm
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from conftest import copy_model, start_server, stop_server

#: Each served model's inputs (datatype, dims after the batch dimension) and outputs; both batch up to 8.
MODELS = {
    "simple": ({"INPUT0": ("INT32", (16,)), "INPUT1": ("INT32", (16,))}, ("OUTPUT0", "OUTPUT1")),
    "sim": ({"INPUT0": ("FP32", (4,))}, ("OUTPUT0",)),
}
DATATYPES = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES",
)
ODD_DATATYPES = ("INT33", "", "int32", "TYPE_INT32", "FP8", "BF16", "STRING")
#: The region the fixture registers, so that shared memory placements can be right or wrong in every way.
REGION, REGION_BYTES = "fuzz", 256
CLIENT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}


def fuzz(examples: int):
    """Settings of one run: reproducible (derandomized, no database), no per-example deadline."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module, with region REGION of a shared memory object registered."""
    repository = tmp_path_factory.mktemp("fuzz_models")
    for name in MODELS:
        copy_model(name, repository)
    key = f"/kserve_ascend_fuzz_{os.getpid()}"
    handle = shm.create_shared_memory_region(REGION, key, REGION_BYTES, create_only=True)
    try:
        srv = start_server(repository, repository.parent / "fuzz_server.log")
        try:
            registered = requests.post(
                f"{srv.url}/v2/systemsharedmemory/region/{REGION}/register",
                json={"key": key, "byte_size": REGION_BYTES},
            )
            assert registered.status_code == 200, registered.text
            yield srv
        finally:
            stop_server(srv)
    finally:
        shm.destroy_shared_memory_region(handle)


@pytest.fixture(scope="module")
def http(server):
    with requests.Session() as session:
        yield session


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc) as chan:
        yield chan


GOOD = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]
}


def assert_serves(server, channel) -> None:
    """The server is alive and answers a good request correctly, on both edges."""
    assert server.process.poll() is None, server.output()[-3000:]
    response = requests.post(f"{server.url}/v2/models/simple/infer", json=GOOD, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [i + 1 for i in range(16)]
    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    answer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], np.int32), np.arange(16) * 2)


def check_rest(response: requests.Response) -> int:
    """200 with an inference response, or 4xx with `{"error": str}`; returns the status."""
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:2000]}"
    if status == 200:
        length = int(response.headers.get("Inference-Header-Content-Length", len(response.content)))
        assert json.loads(response.content[:length])["model_name"] in MODELS
    else:
        assert 400 <= status < 500, status
        body = response.json()
        assert isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str), body
    return status


def check_grpc(call: Callable[[], object]) -> grpc.StatusCode:
    """OK, or a client status with details; returns the code."""
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() in CLIENT_CODES, f"{error.code()}: {error.details()}"
        assert error.details()
        return error.code()
    return grpc.StatusCode.OK


# ---------------------------------------------------------------- JSON values, wrong in every way

INTEGERS = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from([2**31, -(2**31) - 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
SCALARS = st.one_of(st.none(), st.booleans(), INTEGERS, FINITE, st.text(max_size=12))
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
#: What JSON has no words for (json.dumps writes NaN and Infinity, which are not JSON) and values at the edges.
SPECIAL = st.sampled_from(
    [math.nan, math.inf, -math.inf, "NaN", "Infinity", "-Infinity", 1e308, -0.0, 2**64, 10**30, None, True, "", "\u0661"],
)
DIMS = st.one_of(
    st.integers(0, 20),
    st.sampled_from([-1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]),
)
#: Shapes of at most one element that numpy cannot make an array of: too many dimensions, or
#: an empty tensor whose other dimensions overflow (numpy allocates for them all the same).
EDGE_SHAPES = st.one_of(
    st.lists(st.sampled_from([0, 1]), min_size=33, max_size=70),
    st.lists(st.sampled_from([1, 16, 2**31, 2**62, 2**63 - 1]), min_size=1, max_size=5).map(lambda dims: [0, *dims]),
)
SHAPES = st.one_of(st.lists(DIMS, max_size=6), EDGE_SHAPES, st.lists(JSON, max_size=4), JSON)
SIZES = st.one_of(st.integers(-4, REGION_BYTES + 8), st.sampled_from([2**63, 2**64]), SCALARS)
SHM_PARAMETERS = st.fixed_dictionaries(
    {},
    optional={
        "shared_memory_region": st.sampled_from([REGION, "missing", ""]) | SCALARS,
        "shared_memory_byte_size": SIZES,
        "shared_memory_offset": SIZES,
    },
)
TENSOR_PARAMETERS = st.one_of(
    SHM_PARAMETERS,
    st.fixed_dictionaries({}, optional={"binary_data_size": SIZES, "binary_data": SCALARS, "classification": SCALARS}),
    st.dictionaries(st.text(max_size=8), JSON, max_size=3),
    JSON,
)
REQUEST_PARAMETERS = st.one_of(
    st.fixed_dictionaries(
        {}, optional={"binary_data_output": SCALARS, "priority": INTEGERS | SCALARS, "timeout": INTEGERS | SCALARS}
    ),
    st.dictionaries(st.text(max_size=8), JSON, max_size=3),
    JSON,
)
OUTPUTS = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["OUTPUT0", "OUTPUT1", "OUTPUT9", ""]) | JSON},
        optional={
            "parameters": st.fixed_dictionaries({}, optional={"binary_data": SCALARS, "classification": SCALARS})
            | SHM_PARAMETERS
            | JSON
        },
    )
    | JSON,
    max_size=3,
)
ELEMENTS = {
    "INT32": st.integers(-(2**31), 2**31 - 1),
    "FP32": st.floats(width=32, allow_nan=False, allow_infinity=False),
}


def _nested(draw, tensor):
    """`data` as nested lists: row-major in the shape (as OIP allows), or ragged."""
    data = tensor.get("data")
    if isinstance(data, list) and isinstance(tensor.get("shape"), list):
        try:
            tensor["data"] = np.array(data, dtype=object).reshape(tensor["shape"]).tolist()
            return tensor
        except (ValueError, TypeError, OverflowError):
            pass
    cut = draw(st.integers(1, 5))
    tensor["data"] = [data[i : i + cut] for i in range(0, len(data), cut)] if isinstance(data, list) else [[data]]
    return tensor


def _deep(draw, tensor):
    """`data` nested deeper than numpy's 32 dimensions (and than the shape)."""
    for _ in range(draw(st.integers(1, 100))):
        tensor["data"] = [tensor.get("data")]
    return tensor


def _reshaped(draw, tensor):
    """Another shape, with as many elements in `data` as it needs (when that is few): only the shape is wrong."""
    shape = tensor["shape"] = draw(SHAPES)
    if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and math.prod(shape) <= 256:
        tensor["data"] = [0] * math.prod(shape)
    return tensor


def _set(key: str, strategy):
    def mutate(draw, tensor):
        tensor[key] = draw(strategy)
        return tensor

    return mutate


def _drop_key(draw, obj):
    if obj:
        del obj[draw(st.sampled_from(sorted(obj)))]
    return obj


def _extra_key(draw, obj):
    obj[draw(st.text(max_size=8))] = draw(JSON)
    return obj


TENSOR_MUTATIONS = {
    "datatype": _set("datatype", st.sampled_from(DATATYPES + ODD_DATATYPES) | JSON),
    "shape": _set("shape", SHAPES),
    "reshaped": _reshaped,
    "data": _set("data", st.lists(SCALARS, max_size=40) | JSON),
    "special": _set("data", st.lists(SPECIAL, min_size=1, max_size=20)),
    "name": _set("name", st.sampled_from(["INPUT0", "INPUT1", "OUTPUT0", "input0", ""]) | JSON),
    "parameters": _set("parameters", TENSOR_PARAMETERS),
    "nested": _nested,
    "deep": _deep,
    "drop": _drop_key,
    "extra": _extra_key,
    "whole": lambda draw, tensor: draw(JSON),
}


#: Which mutations to draw from; a wrong shape (with data to match) often, as numpy's limits are behind it.
TENSOR_MUTATION_CHOICES = st.sampled_from(sorted(TENSOR_MUTATIONS) + ["reshaped"] * 3)


@st.composite
def json_tensors(draw, name: str, datatype: str, dims: tuple[int, ...], rows: int):
    count = rows * math.prod(dims)
    tensor = {"name": name, "shape": [rows, *dims], "datatype": datatype}
    tensor["data"] = draw(st.lists(ELEMENTS[datatype], min_size=count, max_size=count))
    for mutation in mostly(draw, [], st.lists(TENSOR_MUTATION_CHOICES, min_size=1, max_size=2)):
        tensor = TENSOR_MUTATIONS[mutation](draw, tensor)
        if not isinstance(tensor, dict):
            break
    return tensor


def _inputs_op(change):
    def mutate(draw, body):
        if isinstance(body.get("inputs"), list) and body["inputs"]:
            change(draw, body["inputs"])
        return body

    return mutate


REQUEST_MUTATIONS = {
    "id": _set("id", st.text(max_size=30) | JSON),
    "parameters": _set("parameters", REQUEST_PARAMETERS),
    "outputs": _set("outputs", OUTPUTS | JSON),
    "inputs": _set("inputs", JSON),
    "drop input": _inputs_op(lambda draw, inputs: inputs.pop(draw(st.integers(0, len(inputs) - 1)))),
    "repeat input": _inputs_op(lambda draw, inputs: inputs.append(inputs[draw(st.integers(0, len(inputs) - 1))])),
    "reverse inputs": _inputs_op(lambda draw, inputs: inputs.reverse()),
    "drop": _drop_key,
    "extra": _extra_key,
    "whole": lambda draw, body: draw(JSON),
}


def mostly(draw, good, other):
    """`good` about three times in four, else a draw of `other`; examples shrink towards `good`."""
    return good if draw(st.integers(0, 3)) < 3 else draw(other)


BATCH_SIZES = st.sampled_from([0, 9])  # outside the models' 1..8 (huge shapes come from the shape mutations)
VERSIONS = st.sampled_from(["1", "2", "0", "-1", "x", "01", "9" * 50])


@st.composite
def infer_paths(draw, model: str) -> str:
    """Mostly the model's own infer path; sometimes another model's, an unknown one, or a bad version."""
    other = st.sampled_from(sorted(MODELS) + ["nope", "x" * 200]) | st.text("abcXYZ019-_.", max_size=10)
    name = mostly(draw, model, other)
    version = mostly(draw, None, VERSIONS)
    path = f"/v2/models/{quote(name, safe='')}"
    if version is not None:
        path += f"/versions/{quote(version, safe='')}"
    return path + "/infer"


@st.composite
def rest_requests(draw):
    """(path, body bytes, headers) of a JSON infer request."""
    model = draw(st.sampled_from(sorted(MODELS)))
    inputs, _ = MODELS[model]
    rows = mostly(draw, draw(st.integers(1, 8)), BATCH_SIZES)
    body = {"inputs": [draw(json_tensors(name, datatype, dims, rows)) for name, (datatype, dims) in inputs.items()]}
    for mutation in mostly(draw, [], st.lists(st.sampled_from(sorted(REQUEST_MUTATIONS)), min_size=1, max_size=2)):
        body = REQUEST_MUTATIONS[mutation](draw, body)
        if not isinstance(body, dict):
            break
    content = json.dumps(body, allow_nan=True, ensure_ascii=draw(st.booleans())).encode()
    content_type = draw(st.sampled_from([None, "application/json", "text/plain", "application/octet-stream"]))
    return draw(infer_paths(model)), content, {"Content-Type": content_type} if content_type else {}


HEADER_LENGTHS = st.one_of(
    st.integers(-10, 10**6).map(str),
    st.sampled_from(["", "abc", "1.5", "0x10", "1e3", "1_0", "+5", "-0", "9" * 5000, "18446744073709551617"]),
)


@st.composite
def binary_requests(draw):
    """(path, body bytes, headers) of a binary tensor data request: JSON header, then the tensors' bytes."""
    model = draw(st.sampled_from(sorted(MODELS)))
    inputs, outputs = MODELS[model]
    rows = mostly(draw, draw(st.integers(1, 8)), BATCH_SIZES)
    header: dict = {"inputs": []}
    blobs = []
    for name, (datatype, dims) in inputs.items():
        tensor = {"name": name, "shape": [rows, *dims], "datatype": datatype}
        nbytes = rows * math.prod(dims) * 4
        kind = draw(st.sampled_from(["exact"] * 4 + ["length", "size", "bytes", "json", "shm", "edge", "mutated"]))
        if kind == "edge":
            tensor["shape"] = draw(EDGE_SHAPES)
            nbytes = math.prod(tensor["shape"]) * 4
        blob = draw(st.binary(min_size=nbytes, max_size=nbytes) if kind != "length" else st.binary(max_size=nbytes + 8))
        size = len(blob) if kind != "size" else draw(SIZES)
        if kind == "bytes":  # a BYTES tensor, well serialized or not
            tensor["datatype"] = "BYTES"
            strings = draw(st.lists(st.binary(max_size=6), max_size=rows * math.prod(dims) + 1))
            if draw(st.booleans()):
                blob = serialize_byte_tensor(np.array(strings, dtype=object)).item() if strings else b""
            else:
                blob = draw(st.binary(max_size=40))
            size = len(blob)
        tensor["parameters"] = {"binary_data_size": size}
        if kind == "json":
            tensor["data"] = [0] * (nbytes // 4)
            if draw(st.booleans()):
                del tensor["parameters"]
                blob = b""
        if kind == "shm":
            tensor["parameters"].update(draw(SHM_PARAMETERS))
        if kind == "mutated":
            tensor = TENSOR_MUTATIONS[draw(st.sampled_from(sorted(TENSOR_MUTATIONS)))](draw, tensor)
        header["inputs"].append(tensor)
        blobs.append(blob)
    if draw(st.booleans()):
        header["outputs"] = [{"name": n, "parameters": {"binary_data": draw(st.booleans())}} for n in outputs]
    if draw(st.booleans()):
        header["parameters"] = {"binary_data_output": draw(st.booleans())}
    head = json.dumps(header).encode()
    body = head + b"".join(blobs) + draw(st.sampled_from([b""] * 4 + [b"\0", b"\xff" * 9]))
    length = mostly(draw, str(len(head)), HEADER_LENGTHS)
    return draw(infer_paths(model)), body, {"Inference-Header-Content-Length": length}


#: Garbage with a structure: past orjson's 1024 levels of nesting, past numpy's 32 dimensions, encodings, numbers.
GARBAGE = [
    b"[" * 2000 + b"]" * 2000,
    b'{"inputs":' + b"[" * 1100 + b"]" * 1100 + b"}",
    b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32","data":' + b"[" * 40 + b"1" + b"]" * 40 + b"}]}",
    b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"BYTES","data":' + b"[" * 40 + b'"a"' + b"]" * 40 + b"}]}",
    b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32","data":[1e999]}]}',
    b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32","data":[' + b"9" * 5000 + b"]}]}",
    b'{"inputs":[{"name":"INPUT0","shape":[0,' + b"9" * 40 + b'],"datatype":"INT32","data":[]}]}',
    b'{"inputs": [], "inputs": 1}',
    b'{"id": "\\ud800", "inputs": []}',
    b"\xef\xbb\xbf{}",
    '{"inputs": []}'.encode("utf-16"),
    b"\x00",
    b"null",
    b"1e999999",
]


# ---------------------------------------------------------------- REST


@pytest.mark.parametrize("strategy, examples", [(rest_requests, 600), (binary_requests, 300)], ids=["json", "binary"])
def test_rest_requests(server, http, channel, strategy, examples):
    outcomes = collections.Counter()

    @fuzz(examples)
    @given(strategy())
    def run(request):
        path, body, headers = request
        outcomes[check_rest(http.post(server.url + path, data=body, headers=headers, timeout=10))] += 1

    run()
    # The strategies reach the models, not only the parser's first checks.
    assert outcomes[200] and outcomes[400], outcomes
    assert_serves(server, channel)


def test_rest_garbage(server, http, channel):
    @fuzz(200)
    @given(
        st.sampled_from(GARBAGE) | st.binary(max_size=300),
        st.none() | HEADER_LENGTHS,
        st.sampled_from(["simple", "sim"]),
    )
    def run(body, header_length, model):
        headers = {} if header_length is None else {"Inference-Header-Content-Length": header_length}
        check_rest(http.post(f"{server.url}/v2/models/{model}/infer", data=body, headers=headers, timeout=10))

    run()
    assert_serves(server, channel)


# ---------------------------------------------------------------- gRPC

PARAMETER_KEYS = st.sampled_from(
    ["priority", "timeout", "binary_data_output", "binary_data", "classification", "sequence_id",
     "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"]
) | st.text(max_size=8)
PARAMETER_VALUES = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(2**63, 2**64 - 1),
    st.text(max_size=8),
    st.floats(),
)
#: InferTensorContents fields and what each holds.
CONTENTS = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=8),
}
RIGHT_CONTENTS = {"INT32": "int_contents", "FP32": "fp32_contents"}
GRPC_SHAPES = st.lists(st.integers(-3, 20) | st.sampled_from([-(2**63), 2**31, 2**62, 2**63 - 1]), max_size=6)
GRPC_TENSOR_MUTATIONS = [
    "drop", "name", "datatype", "shape", "edge shape", "length", "field", "count", "both", "shm", "parameters",
]


def set_parameter(parameter: pb.InferParameter, value) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        setattr(parameter, "int64_param" if value < 2**63 else "uint64_param", value)
    elif isinstance(value, str):
        parameter.string_param = value
    else:
        parameter.double_param = value


def set_parameters(target, values: dict) -> None:
    for key, value in values.items():
        set_parameter(target[key], value)


SHM_PLACEMENTS = st.fixed_dictionaries(
    {"shared_memory_region": st.sampled_from([REGION, "missing", ""]) | PARAMETER_VALUES},
    optional={
        "shared_memory_byte_size": st.integers(0, REGION_BYTES + 8) | PARAMETER_VALUES,
        "shared_memory_offset": st.integers(0, REGION_BYTES + 8) | PARAMETER_VALUES,
    },
)


@st.composite
def grpc_requests(draw) -> pb.ModelInferRequest:
    model = draw(st.sampled_from(sorted(MODELS)))
    inputs, outputs = MODELS[model]
    request = pb.ModelInferRequest(
        model_name=mostly(draw, model, st.sampled_from(sorted(MODELS) + ["nope", ""]) | st.text(max_size=10)),
        model_version=mostly(draw, "", VERSIONS | st.text(max_size=5)),
        id=draw(st.text(max_size=20)),
    )
    set_parameters(request.parameters, draw(st.dictionaries(PARAMETER_KEYS, PARAMETER_VALUES, max_size=3)))
    raw = draw(st.booleans())  # inputs in raw_input_contents, else in typed contents
    rows = mostly(draw, draw(st.integers(1, 8)), BATCH_SIZES)
    for name, (datatype, dims) in inputs.items():
        mutations = mostly(draw, [], st.lists(st.sampled_from(GRPC_TENSOR_MUTATIONS), min_size=1, max_size=2))
        if "drop" in mutations:
            continue
        tensor = request.inputs.add(
            name=name if "name" not in mutations else draw(st.sampled_from(["INPUT0", "INPUT1", "", "x"]) | st.text(max_size=6)),
            datatype=datatype if "datatype" not in mutations else draw(st.sampled_from(DATATYPES + ODD_DATATYPES)),
            shape=draw(GRPC_SHAPES) if "shape" in mutations else draw(EDGE_SHAPES) if "edge shape" in mutations else [rows, *dims],
        )
        # Contents for the shape sent, so that a wrong shape is the only thing wrong (unless it needs too many).
        count = math.prod(tensor.shape) if 0 <= math.prod(tensor.shape) <= 256 else rows * math.prod(dims)
        if "shm" in mutations:
            set_parameters(tensor.parameters, draw(SHM_PLACEMENTS))
        if "parameters" in mutations:
            set_parameters(tensor.parameters, draw(st.dictionaries(PARAMETER_KEYS, PARAMETER_VALUES, max_size=3)))
        if raw:
            size = count * 4
            request.raw_input_contents.append(
                draw(st.binary(max_size=size + 8) if "length" in mutations else st.binary(min_size=size, max_size=size))
            )
        if not raw or "both" in mutations:
            field = RIGHT_CONTENTS[datatype] if "field" not in mutations else draw(st.sampled_from(sorted(CONTENTS)))
            lengths = {"max_size": count + 4} if "count" in mutations else {"min_size": count, "max_size": count}
            getattr(tensor.contents, field).extend(draw(st.lists(CONTENTS[field], **lengths)))
    if draw(st.integers(0, 9)) == 0:
        request.raw_input_contents.append(draw(st.binary(max_size=16)))  # one no input claims
    for _ in range(draw(st.integers(0, 2))):
        output = request.outputs.add(name=draw(st.sampled_from([*outputs, "OUTPUT9", ""]) | st.text(max_size=6)))
        set_parameters(output.parameters, draw(SHM_PLACEMENTS | st.dictionaries(PARAMETER_KEYS, PARAMETER_VALUES, max_size=2)))
    return request


def test_grpc_requests(server, channel):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    outcomes = collections.Counter()

    @fuzz(600)
    @given(grpc_requests())
    def run(request):
        outcomes[check_grpc(lambda: stub.ModelInfer(request, timeout=10))] += 1

    run()
    assert outcomes[grpc.StatusCode.OK] and outcomes[grpc.StatusCode.INVALID_ARGUMENT], outcomes
    assert_serves(server, channel)


def test_grpc_stream(server, channel):
    """On ModelStreamInfer a bad request's error travels in its response; the stream goes on."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    @fuzz(100)
    @given(st.lists(grpc_requests(), min_size=1, max_size=4))
    def run(requests_):
        responses = list(stub.ModelStreamInfer(iter(requests_), timeout=10))
        assert len(responses) == len(requests_)
        for response in responses:
            assert response.error_message or response.infer_response.model_name in MODELS, response

    run()
    assert_serves(server, channel)


@st.composite
def corrupted_messages(draw) -> bytes:
    """A serialized ModelInferRequest with bytes flipped, cut or appended; or bytes from nowhere."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=300))
    message = bytearray(draw(grpc_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if message and draw(st.booleans()):
            message[draw(st.integers(0, len(message) - 1))] = draw(st.integers(0, 255))
        elif draw(st.booleans()):
            del message[draw(st.integers(0, len(message))) :]
        else:
            message += draw(st.binary(min_size=1, max_size=8))
    return bytes(message)


def test_grpc_undecodable_messages(server, channel):
    """Bytes that are not a ModelInferRequest never reach the servicer: grpcio answers for it.

    The gRPC status table says "Error parsing request proto" is INTERNAL; grpcio's asyncio
    server answers UNKNOWN "Unexpected <class '...DecodeError'>" (and logs the traceback).
    Either is the transport's answer to a client that did not speak protobuf, not a fault
    of this server; bytes that do parse must get a client status like any request.
    """
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
    outcomes = collections.Counter()

    @fuzz(300)
    @given(corrupted_messages())
    def run(message):
        try:
            pb.ModelInferRequest.FromString(message)
        except DecodeError:
            with pytest.raises(grpc.RpcError) as raised:
                infer(message, timeout=10)
            assert raised.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), raised.value.details()
            assert "DecodeError" in raised.value.details() or "deserializ" in raised.value.details()
            outcomes["undecodable"] += 1
        else:
            outcomes[check_grpc(lambda: infer(message, timeout=10))] += 1

    run()
    assert outcomes["undecodable"] and len(outcomes) > 1, outcomes
    assert_serves(server, channel)


# ---------------------------------------------------------------- shared memory registration

#: Keys of objects that do not exist, and keys that try to leave /dev/shm.
KEYS = st.one_of(
    st.text(max_size=12).map(lambda s: f"/kserve_ascend_fuzz_missing_{s}"),
    st.sampled_from(["", "/", "//", ".", "..", "/..", "../etc/passwd", "/dev/null", "a/b", "/a\x00b", "\x00"]),
)


def test_shared_memory_registration(server, http, channel):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    @fuzz(200)
    @given(
        st.text("abcXYZ019-_.", min_size=1, max_size=10) | st.just(REGION),
        st.fixed_dictionaries({}, optional={"key": KEYS | JSON, "offset": SIZES | JSON, "byte_size": SIZES | JSON}),
        st.booleans(),
    )
    def run(name, body, over_grpc):
        if over_grpc:
            key, offset, byte_size = (body.get(k) for k in ("key", "offset", "byte_size"))
            request = pb.SystemSharedMemoryRegisterRequest(
                name=name,
                key=key if isinstance(key, str) else "",
                offset=offset if type(offset) is int and 0 <= offset < 2**64 else 0,
                byte_size=byte_size if type(byte_size) is int and 0 <= byte_size < 2**64 else 0,
            )
            check_grpc(lambda: stub.SystemSharedMemoryRegister(request, timeout=10))
        else:
            url = f"{server.url}/v2/systemsharedmemory/region/{quote(name, safe='')}/register"
            check_rest(http.post(url, data=json.dumps(body, allow_nan=True).encode(), timeout=10))

    run()
    status = requests.get(f"{server.url}/v2/systemsharedmemory/status", timeout=10).json()
    assert [region["name"] for region in status] == [REGION]  # no key of another object was mapped
    assert_serves(server, channel)

"""String (BYTES) tensors end to end, and Triton's classification extension.

The string cases check what Triton's string examples check (simple_http_string_infer_client.py,
simple_grpc_string_infer_client.py, simple_http_shm_string_client.py): `simple_string` adds and
subtracts integers written as text, and a BYTES identity gives back any bytes unchanged.
"""

import os

import grpc as grpclib
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

STRINGS = "OIP v2 required_api.md §Tensor Data (BYTES); Triton simple_*_string_infer_client.py"
SHM = "Triton extension_shared_memory.md; simple_http_shm_string_client.py"
CLASSIFICATION = "Triton extension_classification.md"

A = np.array([[0, 1, -7, 2**20, 15, -(2**20), 3, 99, 100, 5, 6, 7, 8, 9, 10, 11], list(range(16))], np.int32)
B = np.array([[1] * 16, [-3] * 16], np.int32)
#: Every byte value, an embedded NUL, an empty element and bytes that are not UTF-8.
ARBITRARY = np.array([bytes(range(256)), b"he\x00llo", b"", b"\xff\xfe\xc3", "ascend \u00e9".encode()], dtype=object)


def text(array: np.ndarray) -> np.ndarray:
    return np.array([str(x).encode() for x in array.ravel()], dtype=object).reshape(array.shape)


def numbers(array: np.ndarray) -> np.ndarray:
    return np.array([int(x) for x in array.ravel()], np.int64).reshape(array.shape)


def check_sums(out0: np.ndarray, out1: np.ndarray) -> None:
    np.testing.assert_array_equal(numbers(out0), A + B)
    np.testing.assert_array_equal(numbers(out1), A - B)


@pytest.fixture(scope="module")
def stub(target):
    with grpclib.insecure_channel(target.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.spec(f"{STRINGS} (REST: a binary and a JSON input, a binary and a JSON output)")
def test_simple_string_over_rest(http):
    inputs = [httpclient.InferInput(name, list(A.shape), "BYTES") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(text(A), binary_data=True)
    inputs[1].set_data_from_numpy(text(B), binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True), httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = http.infer("simple_string", inputs, outputs=outputs)
    check_sums(result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1"))
    assert {o["name"]: o["datatype"] for o in result.get_response()["outputs"]} == {"OUTPUT0": "BYTES", "OUTPUT1": "BYTES"}


@pytest.mark.spec(f"{STRINGS} (gRPC raw_input_contents)")
def test_simple_string_over_grpc(grpc):
    inputs = [grpcclient.InferInput(name, list(A.shape), "BYTES") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(text(A))
    inputs[1].set_data_from_numpy(text(B))
    result = grpc.infer("simple_string", inputs)
    check_sums(result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1"))


@pytest.mark.spec(f"{STRINGS} (gRPC typed bytes_contents)")
def test_simple_string_over_grpc_typed_contents(stub):
    request = pb.ModelInferRequest(model_name="simple_string")
    for name, array in (("INPUT0", A), ("INPUT1", B)):
        request.inputs.add(name=name, datatype="BYTES", shape=list(A.shape)).contents.bytes_contents.extend(text(array).ravel())
    response = stub.ModelInfer(request)
    got = {}
    for index, output in enumerate(response.outputs):
        assert output.datatype == "BYTES" and list(output.shape) == list(A.shape)
        values = deserialize_bytes_tensor(response.raw_output_contents[index]) if response.raw_output_contents else output.contents.bytes_contents
        got[output.name] = np.array(list(values), dtype=object).reshape(A.shape)
    check_sums(got["OUTPUT0"], got["OUTPUT1"])


@pytest.mark.spec(f"{STRINGS} (any bytes: REST binary, gRPC raw and typed)")
def test_bytes_identity_returns_any_bytes_unchanged(http, grpc, stub):
    data = ARBITRARY.reshape(1, -1)
    tensor = httpclient.InferInput("INPUT0", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data, binary_data=True)
    result = http.infer("identity_bytes", [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
    assert result.as_numpy("OUTPUT0").tolist() == data.tolist()
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    assert grpc.infer("identity_bytes", [tensor]).as_numpy("OUTPUT0").tolist() == data.tolist()
    request = pb.ModelInferRequest(model_name="identity_bytes")
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=list(data.shape)).contents.bytes_contents.extend(ARBITRARY)
    response = stub.ModelInfer(request)
    returned = deserialize_bytes_tensor(response.raw_output_contents[0]) if response.raw_output_contents else response.outputs[0].contents.bytes_contents
    assert list(returned) == list(ARBITRARY)


@pytest.mark.spec(f"{STRINGS} (JSON strings, with an embedded NUL and non-ASCII text)")
def test_bytes_identity_returns_json_text_unchanged(url):
    strings = ["he\x00llo", "", "ascend \u00e9", "\u6607\u817e", "\x00\x01\x02\x03"]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, len(strings)], "datatype": "BYTES", "data": strings}]}
    response = requests.post(f"{url}/v2/models/identity_bytes/infer", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == strings


def _shm_region(target, name: str, size: int):
    key = f"/conformance_{target.name}_{os.getpid()}_{name}"
    return shm.create_shared_memory_region(name, key, size), key


@pytest.mark.spec(f"{SHM} (BYTES inputs and outputs in system shared memory, REST and gRPC)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_simple_string_in_system_shared_memory(target, requires, protocol):
    requires("system_shared_memory")
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(target.http if protocol == "http" else target.grpc)
    blobs = {
        "INPUT0": serialize_byte_tensor(text(A)).item(),
        "INPUT1": serialize_byte_tensor(text(B)).item(),
        "OUTPUT0": serialize_byte_tensor(text(A + B)).item(),
        "OUTPUT1": serialize_byte_tensor(text(A - B)).item(),
    }
    handles, registered = {}, []
    try:
        for name, blob in blobs.items():
            # Output regions are exactly the size of the serialized answer, as in Triton's example.
            handle, key = _shm_region(target, f"strings_{protocol}_{name}", len(blob))
            handles[name] = handle
            if name.startswith("INPUT"):
                shm.set_shared_memory_region(handle, [np.frombuffer(blob, np.uint8)])
            client.register_system_shared_memory(f"strings_{name}", key, len(blob))
            registered.append(f"strings_{name}")
        inputs, outputs = [], []
        for name in ("INPUT0", "INPUT1"):
            inputs.append(module.InferInput(name, list(A.shape), "BYTES"))
            inputs[-1].set_shared_memory(f"strings_{name}", len(blobs[name]))
        for name in ("OUTPUT0", "OUTPUT1"):
            outputs.append(module.InferRequestedOutput(name))
            outputs[-1].set_shared_memory(f"strings_{name}", len(blobs[name]))
        result = client.infer("simple_string", inputs, outputs=outputs)
        for name in ("OUTPUT0", "OUTPUT1"):
            output = result.get_output(name)
            datatype, shape = (output["datatype"], output["shape"]) if protocol == "http" else (output.datatype, list(output.shape))
            assert (datatype, shape) == ("BYTES", list(A.shape))
        check_sums(*(shm.get_contents_as_numpy(handles[n], np.object_, list(A.shape)) for n in ("OUTPUT0", "OUTPUT1")))
    finally:
        for name in registered:
            client.unregister_system_shared_memory(name)
        client.close()
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


# ---------------------------------------------------------------- classification

#: Scores exact in FP32, so that `%f` prints them the same everywhere.
SCORES = np.array([[0.5, 0.25, 0.125, 2.0], [1.5, 3.0, -1.0, 0.0]], np.float32)
#: "<value>:<index>[:<label>]" of the top 2 per row; the classifier labels classes 0-2 only.
TOP2 = [[b"2.000000:3", b"0.500000:0:cat"], [b"3.000000:1:dog", b"1.500000:0:cat"]]


def _scores(module, array=SCORES, datatype="FP32"):
    tensor = module.InferInput("INPUT0", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return [tensor]


@pytest.mark.spec(f"{CLASSIFICATION} (REST JSON and binary, gRPC; labels from label_filename)")
def test_classification_returns_the_top_classes_with_labels(http, grpc, requires):
    requires("classification")
    for binary in (False, True):
        output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=2)
        result = http.infer("classifier", _scores(httpclient), outputs=[output])
        assert result.as_numpy("OUTPUT0").tolist() == (TOP2 if binary else [[s.decode() for s in row] for row in TOP2])
        assert result.get_output("OUTPUT0")["datatype"] == "BYTES"
    result = grpc.infer("classifier", _scores(grpcclient), outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)])
    assert result.as_numpy("OUTPUT0").tolist() == TOP2
    assert (result.get_output("OUTPUT0").datatype, list(result.get_output("OUTPUT0").shape)) == ("BYTES", [2, 2])


@pytest.mark.spec(f"{CLASSIFICATION} (no labels; integer values; a count beyond the classes)")
def test_classification_without_labels(url, requires):
    requires("classification")
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "INT32", "data": [7, -2, 40, 3]}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 9}}],
    }
    output = requests.post(f"{url}/v2/models/identity_int32/infer", json=body).json()["outputs"][0]
    assert (output["datatype"], output["shape"], output["data"]) == ("BYTES", [1, 4], ["40:2", "7:0", "3:3", "-2:1"])
    body["inputs"][0].update(datatype="FP32", data=[0.75, 0.5, 8.0, 0.0])
    body["outputs"][0]["parameters"]["classification"] = 1
    output = requests.post(f"{url}/v2/models/identity_fp32/infer", json=body).json()["outputs"][0]
    assert (output["shape"], output["data"]) == ([1, 1], ["8.000000:2"])


@pytest.mark.spec(f"{CLASSIFICATION} (with shared memory, or a count below 1 over gRPC: 4xx)")
def test_classification_refusals(url, stub, requires):
    requires("classification")
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 1, "shared_memory_region": "r", "shared_memory_byte_size": 64}}],
    }
    response = requests.post(f"{url}/v2/models/classifier/infer", json=body)
    assert response.status_code == 400 and "'shared_memory_region' and 'classification'" in response.json()["error"]
    for count in (0, -1):
        request = pb.ModelInferRequest(model_name="classifier")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1, 2, 3, 4])
        request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = count
        with pytest.raises(grpclib.RpcError) as error:
            stub.ModelInfer(request)
        assert error.value.code() == grpclib.StatusCode.INVALID_ARGUMENT and "classification" in error.value.details()

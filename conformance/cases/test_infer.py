"""Inference over REST (JSON and the binary tensor data extension) and gRPC, for every datatype."""

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
import grpc as grpclib

from conftest import DATATYPES, SAMPLES, identity, simple_body

OIP = "OIP v2 required_api.md"
BINARY = "Triton extension_binary_data.md"

#: simple's answer to simple_body(): OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1.
SUM = [i + 1 for i in range(16)]
DIFFERENCE = [i - 1 for i in range(16)]


def json_data(array: np.ndarray) -> list:
    if array.dtype == object:
        return [x.decode() for x in array.ravel()]
    return array.ravel().tolist()


@pytest.mark.spec(f"{OIP} §Inference Request/Response JSON Object, §Tensor Data")
@pytest.mark.parametrize("datatype", DATATYPES)
def test_json_infer_round_trips_each_datatype(url, datatype):
    array = SAMPLES[datatype].reshape(1, 3)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": datatype, "data": json_data(array)}]}
    response = requests.post(f"{url}/v2/models/{identity(datatype)}/infer", json=body)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    assert (output["name"], output["datatype"], output["shape"]) == ("OUTPUT0", datatype, [1, 3])
    if datatype == "BYTES":
        assert output["data"] == json_data(array)
    else:  # numbers compare at the tensor's precision (3.4e38 and 3.3999999521443642e38 are one FP32)
        np.testing.assert_array_equal(np.asarray(output["data"], dtype=array.dtype), array.ravel())


@pytest.mark.spec(f"{BINARY} (binary inputs and outputs)")
@pytest.mark.parametrize("datatype", DATATYPES)
def test_binary_infer_round_trips_each_datatype(http, datatype):
    array = SAMPLES[datatype].reshape(1, 3)
    tensor = httpclient.InferInput("INPUT0", [1, 3], datatype)
    tensor.set_data_from_numpy(array, binary_data=True)
    result = http.infer(identity(datatype), [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), array)
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] > 0


@pytest.mark.spec(f"{OIP} §GRPC ModelInfer with raw_input_contents")
@pytest.mark.parametrize("datatype", DATATYPES)
def test_grpc_raw_contents_round_trip_each_datatype(grpc, datatype):
    array = SAMPLES[datatype].reshape(1, 3)
    tensor = grpcclient.InferInput("INPUT0", [1, 3], datatype)
    tensor.set_data_from_numpy(array)
    np.testing.assert_array_equal(grpc.infer(identity(datatype), [tensor]).as_numpy("OUTPUT0"), array)


TYPED = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


@pytest.fixture(scope="module")
def stub(target):
    with grpclib.insecure_channel(target.grpc) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.spec(f"{OIP} §GRPC InferTensorContents (typed contents)")
@pytest.mark.parametrize("datatype", list(TYPED))
def test_grpc_typed_contents_each_datatype(stub, datatype):
    array = SAMPLES[datatype].reshape(1, 3)
    request = pb.ModelInferRequest(model_name=identity(datatype))
    tensor = request.inputs.add(name="INPUT0", datatype=datatype, shape=[1, 3])
    getattr(tensor.contents, TYPED[datatype]).extend(array.ravel().tolist())
    response = stub.ModelInfer(request)
    output = response.outputs[0]
    assert (output.name, output.datatype, list(output.shape)) == ("OUTPUT0", datatype, [1, 3])
    if response.raw_output_contents:
        from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

        raw = response.raw_output_contents[0]
        got = deserialize_bytes_tensor(raw) if datatype == "BYTES" else np.frombuffer(raw, triton_to_np_dtype(datatype))
    else:
        got = np.array(getattr(output.contents, TYPED[datatype]))
    np.testing.assert_array_equal(got.reshape(1, 3), array)


def simple_tensors(module) -> list:
    """simple's INPUT0 and INPUT1, both [1, 16] of 3: its OUTPUT0 is 6s, its OUTPUT1 0s."""
    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.full((1, 16), 3, np.int32))
        tensors.append(tensor)
    return tensors


def json_outputs(response: requests.Response) -> dict[str, list]:
    assert response.status_code == 200, response.text
    return {o["name"]: o["data"] for o in response.json()["outputs"]}


@pytest.mark.spec(f"{OIP} §HTTP/REST /v2/models/{{m}}/versions/{{v}}/infer; §Inference Response (model_version)")
def test_infer_with_explicit_version(url, grpc):
    response = requests.post(f"{url}/v2/models/simple/versions/1/infer", json=simple_body())
    assert json_outputs(response) == {"OUTPUT0": SUM, "OUTPUT1": DIFFERENCE}
    assert response.json()["model_version"] == "1"
    result = grpc.infer("simple", simple_tensors(grpcclient), model_version="1")
    assert result.get_response().model_version == "1"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 6, np.int32))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 16), np.int32))


@pytest.mark.spec(f"{OIP} §Inference Response JSON Object (id echoes the request id)")
def test_request_id_is_echoed(url, grpc):
    response = requests.post(f"{url}/v2/models/simple/infer", json=simple_body(id="conf-42"))
    assert json_outputs(response) == {"OUTPUT0": SUM, "OUTPUT1": DIFFERENCE} and response.json()["id"] == "conf-42"
    data = np.array([[7, -8, 9]], np.int32)
    tensor = grpcclient.InferInput("INPUT0", [1, 3], "INT32")
    tensor.set_data_from_numpy(data)
    result = grpc.infer("identity_int32", [tensor], request_id="g-42")
    assert result.get_response().id == "g-42"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


@pytest.mark.spec(f"{OIP} §Request Output (a subset of outputs)")
def test_requested_output_subset(url, grpc):
    response = requests.post(f"{url}/v2/models/simple/infer", json=simple_body(outputs=[{"name": "OUTPUT1"}]))
    assert json_outputs(response) == {"OUTPUT1": DIFFERENCE}  # and only it
    result = grpc.infer("simple", simple_tensors(grpcclient), outputs=[grpcclient.InferRequestedOutput("OUTPUT0")])
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT0"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 6, np.int32))


@pytest.mark.spec(f"{BINARY} (binary_data output parameter, JSON inputs)")
def test_binary_data_output_parameter(url):
    body = simple_body(outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}])
    response = requests.post(f"{url}/v2/models/simple/infer", json=body)
    assert response.status_code == 200
    length = int(response.headers["Inference-Header-Content-Length"])
    header = requests.models.complexjson.loads(response.content[:length])
    outputs = {o["name"]: o for o in header["outputs"]}  # OIP leaves the order of outputs open
    assert outputs["OUTPUT0"]["parameters"]["binary_data_size"] == 64 and "data" not in outputs["OUTPUT0"]
    assert outputs["OUTPUT1"]["data"] == DIFFERENCE
    assert np.frombuffer(response.content[length:], np.int32).tolist() == SUM


@pytest.mark.spec(f"{BINARY} (binary_data_output request parameter)")
def test_binary_data_output_request_parameter(url):
    response = requests.post(f"{url}/v2/models/simple/infer", json=simple_body(parameters={"binary_data_output": True}))
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    header = requests.models.complexjson.loads(response.content[:length])
    assert [o["parameters"]["binary_data_size"] for o in header["outputs"]] == [64, 64]
    assert len(response.content) == length + 128
    # The binary outputs follow the header in the order of its outputs (which OIP leaves open).
    blobs = {o["name"]: response.content[length + 64 * i : length + 64 * (i + 1)] for i, o in enumerate(header["outputs"])}
    assert {name: np.frombuffer(blob, np.int32).tolist() for name, blob in blobs.items()} == {"OUTPUT0": SUM, "OUTPUT1": DIFFERENCE}


@pytest.mark.spec("curl usage: a JSON body without a JSON Content-Type (curl -d)")
def test_json_body_without_content_type(url):
    body = requests.models.complexjson.dumps(simple_body()).encode()
    response = requests.post(f"{url}/v2/models/simple/infer", data=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert json_outputs(response) == {"OUTPUT0": SUM, "OUTPUT1": DIFFERENCE}


@pytest.mark.spec(f"{OIP} §GRPC ModelStreamInfer")
def test_grpc_stream_infer(target):
    import queue

    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(target.grpc) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for index in range(3):
            tensor = grpcclient.InferInput("INPUT0", [1, 3], "INT32")
            tensor.set_data_from_numpy(np.full((1, 3), index, np.int32))
            client.async_stream_infer("identity_int32", [tensor], request_id=str(index))
        answers = [results.get(timeout=10) for _ in range(3)]
        client.stop_stream()
    for result, error in answers:
        assert error is None, error
        index = int(result.get_response().id)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 3), index, np.int32))


@pytest.mark.spec("curl usage: the README's `curl -d` infer request, exactly as typed")
def test_curl_d_infer_as_a_user_types_it(url):
    import json
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    body = json.dumps(simple_body())
    result = subprocess.run(["curl", "-s", "-d", body, f"{url}/v2/models/simple/infer"], capture_output=True, text=True, timeout=30)
    outputs = {o["name"]: o["data"] for o in json.loads(result.stdout)["outputs"]}
    assert outputs == {"OUTPUT0": SUM, "OUTPUT1": DIFFERENCE}


RAW = f"{BINARY} (a raw binary request: Inference-Header-Content-Length 0; Triton's qa/L0_http/http_test.py)"


def raw_infer(url: str, model: str, body: bytes) -> requests.Response:
    return requests.post(f"{url}/v2/models/{model}/infer", data=body, headers={"Inference-Header-Content-Length": "0"})


@pytest.mark.spec(RAW)
@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "BYTES"])
def test_raw_binary_request_is_the_models_one_input(url, datatype):
    """The body is the input's bytes; its shape is deduced (a batch of 1, the variable dimension from the
    byte count) and every output is answered as binary data."""
    array = SAMPLES[datatype]
    response = raw_infer(url, identity(datatype), array.tobytes())
    assert response.status_code == 200, response.text
    header_length = int(response.headers["Inference-Header-Content-Length"])
    result = httpclient.InferenceServerClient.parse_response_body(response.content, header_length=header_length)
    assert result.get_output("OUTPUT0")["shape"] == [1, len(array)]
    assert result.as_numpy("OUTPUT0").tolist() == [array.tolist()]


#: What Triton cannot deduce, and its words for each (it prefixes them with "[request id: <id_unknown>] ").
RAW_REFUSALS = {
    "two_inputs": ("simple", bytes(128),
                   "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'simple' model configuration"),
    "bytes_of_variable_shape": ("identity_bytes", b"kserve",
                                "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
    "not_whole_elements": ("identity_fp32", bytes(6),
                           "input byte size mismatch for input 'raw_input' for model 'identity_fp32'. Expected 4, got 6"),
}  # fmt: skip


@pytest.mark.spec(RAW)
@pytest.mark.parametrize("case", list(RAW_REFUSALS))
def test_raw_binary_request_that_cannot_be_deduced_is_400(url, case):
    model, body, message = RAW_REFUSALS[case]
    response = raw_infer(url, model, body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]

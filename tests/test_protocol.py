"""OIP v2 over the wire against the KServe server on model_repository/: tritonclient HTTP, gRPC, plain HTTP.

Expected outputs come from ONNX Runtime run directly on the same model files.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import REPOSITORY, infer, tensors


def direct(model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(REPOSITORY / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs)))


def simple_inputs(rows: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "INPUT0": rng.integers(-1000, 1000, (rows, 16), dtype=np.int32),
        "INPUT1": rng.integers(-1000, 1000, (rows, 16), dtype=np.int32),
    }


@pytest.fixture(scope="module")
def http(server):
    with httpclient.InferenceServerClient(server.http) as client:
        yield client


@pytest.fixture(scope="module")
def grpc(server):
    with grpcclient.InferenceServerClient(server.grpc) as client:
        yield client


def test_health_and_server_metadata(server, http, grpc):
    assert http.is_server_live() and http.is_server_ready()
    assert grpc.is_server_live() and grpc.is_server_ready()
    metadata = http.get_server_metadata()
    assert metadata["name"] == "kserve-ascend"
    assert "binary_tensor_data" in metadata["extensions"]
    assert grpc.get_server_metadata().extensions == metadata["extensions"]
    for model in ("simple", "yolov8n", "sim"):
        assert http.is_model_ready(model) and http.is_model_ready(model, "1")
        assert grpc.is_model_ready(model) and grpc.is_model_ready(model, "1")


def test_model_metadata_over_http_and_grpc(http, grpc):
    metadata = http.get_model_metadata("yolov8n")
    assert metadata["name"] == "yolov8n"
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "images", "datatype": "FP32", "shape": [-1, 3, 640, 640]}]
    assert metadata["outputs"] == [{"name": "output0", "datatype": "FP32", "shape": [-1, 84, 8400]}]
    assert metadata["parameters"]["execution_provider"] == "CPUExecutionProvider"
    assert http.get_model_metadata("yolov8n", "1") == metadata
    grpc_metadata = grpc.get_model_metadata("simple", as_json=True)
    assert grpc_metadata["versions"] == ["1"]
    assert [t["name"] for t in grpc_metadata["inputs"]] == ["INPUT0", "INPUT1"]
    assert grpc_metadata["inputs"][0]["shape"] == ["-1", "16"]  # int64 in JSON form, as protobuf writes it


def test_model_config_endpoint(http, grpc):
    config = http.get_model_config("simple")
    assert config["max_batch_size"] == 8 and config["backend"] == "ascend"
    assert grpc.get_model_config("simple").config.max_batch_size == 8


@pytest.mark.parametrize("binary", [True, False])
def test_simple_http_equals_onnxruntime(http, binary):
    inputs = simple_inputs(3)
    expected = direct("simple", inputs)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("OUTPUT0", "OUTPUT1")]
    result = http.infer("simple", tensors(httpclient, inputs, binary), outputs=outputs, request_id="req-7")
    for name, array in expected.items():
        np.testing.assert_array_equal(result.as_numpy(name), array)
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_version"] == "1"


def test_simple_grpc_equals_onnxruntime(grpc):
    inputs = simple_inputs(2, seed=1)
    expected = direct("simple", inputs)
    result = grpc.infer("simple", tensors(grpcclient, inputs), request_id="g-1", model_version="1")
    for name, array in expected.items():
        np.testing.assert_array_equal(result.as_numpy(name), array)
    assert result.get_response().id == "g-1"


def test_requested_output_subset(server):
    inputs = simple_inputs()
    answer = infer(server, "simple", inputs, outputs=["OUTPUT1"])
    assert answer.keys() == {"OUTPUT1"}
    np.testing.assert_array_equal(answer["OUTPUT1"], inputs["INPUT0"] - inputs["INPUT1"])
    answer = infer(server, "simple", inputs, "grpc", outputs=["OUTPUT0"])
    assert answer.keys() == {"OUTPUT0"}
    np.testing.assert_array_equal(answer["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])


def test_yolov8n_http_and_grpc_equal_onnxruntime(server):
    images = np.random.default_rng(3).random((2, 3, 640, 640), dtype=np.float32)
    expected = direct("yolov8n", {"images": images})["output0"]
    for protocol in ("http", "grpc"):
        output = infer(server, "yolov8n", {"images": images}, protocol)["output0"]
        assert output.shape == (2, 84, 8400)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)


def test_curl_style_json_without_content_type(server):
    """`curl -d` sends no JSON Content-Type: the body is JSON all the same (README example)."""
    body = (
        '{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32","data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]},'
        '{"name":"INPUT1","shape":[1,16],"datatype":"INT32","data":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}]}'
    )
    response = requests.post(
        f"{server.url}/v2/models/simple/infer", data=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert outputs["OUTPUT0"]["data"] == list(range(2, 18))
    assert outputs["OUTPUT1"]["data"] == list(range(0, 16))
    assert outputs["OUTPUT0"]["shape"] == [1, 16] and outputs["OUTPUT0"]["datatype"] == "INT32"
    assert "id" not in response.json()


def test_versioned_routes_over_plain_http(server):
    base = f"{server.url}/v2/models/simple/versions/1"
    assert requests.get(f"{base}/ready").status_code == 200
    assert requests.get(base).json()["name"] == "simple"
    body = {
        "id": "v1",
        "inputs": [
            {"name": "INPUT0", "shape": [16], "datatype": "INT32", "data": [[3] * 16]},
            {"name": "INPUT1", "shape": [16], "datatype": "INT32", "data": [1] * 16},
        ],
    }
    body["inputs"][0]["shape"] = body["inputs"][1]["shape"] = [1, 16]
    response = requests.post(f"{base}/infer", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "v1"
    assert response.json()["outputs"][0]["data"] == [4] * 16


def test_binary_outputs_on_request_from_plain_http(server):
    """The binary tensor data extension: JSON inputs, one output asked for as binary."""
    body = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [2] * 16},
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}],
    }
    response = requests.post(f"{server.url}/v2/models/simple/infer", json=body)
    assert response.status_code == 200
    header_length = int(response.headers["Inference-Header-Content-Length"])
    header = requests.models.complexjson.loads(response.content[:header_length])
    out0, out1 = header["outputs"]
    assert out0["parameters"]["binary_data_size"] == 64 and "data" not in out0
    assert out1["data"] == [i - 2 for i in range(16)]
    np.testing.assert_array_equal(np.frombuffer(response.content[header_length:], np.int32), np.arange(16) + 2)


def test_grpc_stream_requests_run_concurrently_and_batch_together(server):
    """As in Triton, a stream's requests do not wait for each other: eight requests written at once
    to `sim` batch together (one at a time they would take eight executions), and each response
    carries its request's id and rows."""
    import queue

    answers: queue.Queue = queue.Queue()
    sent = {f"r{i}": np.full((1, 4), i, np.float32) for i in range(8)}
    with grpcclient.InferenceServerClient(server.grpc) as client:
        before = client.get_inference_statistics("sim").model_stats[0].execution_count
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for request_id, data in sent.items():
            tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(data)
            client.async_stream_infer("sim", [tensor], request_id=request_id)
        received = [answers.get(timeout=30) for _ in sent]
        client.stop_stream()
        executions = client.get_inference_statistics("sim").model_stats[0].execution_count - before
    assert [error for _, error in received if error] == []
    by_id = {result.get_response().id: result.as_numpy("OUTPUT0") for result, _ in received}
    assert by_id.keys() == sent.keys()
    for request_id, data in sent.items():
        np.testing.assert_array_equal(by_id[request_id], data)
    assert executions < len(sent), f"{executions} executions for {len(sent)} requests: the stream ran them one by one"

"""One inference path: every edge (REST JSON and binary, gRPC, KServe's V1 route, KServe's `predict`) goes through
the same data plane, in one process and with `--workers 2`: the same answers, the same checks, and each request
counted once, with its answer's making, in the statistics.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import copy_model, start_server, stop_server

INPUT0 = np.arange(16, dtype=np.int32).reshape(1, 16)
INPUT1 = np.full((1, 16), 3, dtype=np.int32)
SUM, DIFFERENCE = INPUT0 + INPUT1, INPUT0 - INPUT1
COMPUTE = ("compute_input", "compute_infer", "compute_output")


@pytest.fixture(scope="module", params=[1, 2], ids=["one process", "--workers 2"])
def server(request, tmp_path_factory):
    repository = tmp_path_factory.mktemp("routes")
    copy_model("simple", repository)
    server = start_server(repository, tmp_path_factory.mktemp("log") / "server.log", workers=request.param)
    yield server
    stop_server(server)


def statistics(server) -> dict:
    return requests.get(f"{server.url}/v2/models/simple/stats", timeout=10).json()["model_stats"][0]


def oip(client_module, url: str, outputs) -> dict[str, np.ndarray]:
    """The same request through tritonclient (HTTP binary or gRPC): OUTPUT0 as its top 3 classes, OUTPUT1 as it is."""
    inputs = []
    for name, array in (("INPUT0", INPUT0), ("INPUT1", INPUT1)):
        tensor = client_module.InferInput(name, list(array.shape), "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with client_module.InferenceServerClient(url) as client:
        result = client.infer("simple", inputs, outputs=outputs, priority=1)
    return {name: result.as_numpy(name) for name in ("OUTPUT0", "OUTPUT1")}


def test_every_route_answers_alike_and_counts_each_request_once(server):
    before = statistics(server)
    # The top 3 classes of OUTPUT0, as Triton's classification extension writes them ("value:index").
    top3 = np.array([[f"{v}:{i}".encode() for i, v in sorted(enumerate(SUM[0]), key=lambda p: -p[1])[:3]]], dtype=object)

    rest_json = requests.post(f"{server.url}/v2/models/simple/infer", timeout=10, json={
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": INPUT0.ravel().tolist()},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": INPUT1.ravel().tolist()},
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 3}}, {"name": "OUTPUT1"}],
        "parameters": {"priority": 1},
    }).json()
    answers = {"REST JSON": {o["name"]: np.array(o["data"], dtype=object if o["name"] == "OUTPUT0" else np.int32).reshape(o["shape"])
                             for o in rest_json["outputs"]}}
    answers["REST JSON"]["OUTPUT0"] = answers["REST JSON"]["OUTPUT0"].astype(str).astype(bytes).astype(object)
    answers["REST binary"] = oip(httpclient, server.http, [
        httpclient.InferRequestedOutput("OUTPUT0", binary_data=True, class_count=3), httpclient.InferRequestedOutput("OUTPUT1"),
    ])
    answers["gRPC"] = oip(grpcclient, server.grpc, [
        grpcclient.InferRequestedOutput("OUTPUT0", class_count=3), grpcclient.InferRequestedOutput("OUTPUT1"),
    ])
    for route, outputs in answers.items():
        assert outputs["OUTPUT0"].tolist() == top3.tolist(), route
        np.testing.assert_array_equal(outputs["OUTPUT1"], DIFFERENCE, err_msg=route)

    # KServe's V1 route has no way to ask for classes or some outputs: it answers every output, as they are.
    v1 = requests.post(f"{server.url}/v1/models/simple:predict", timeout=10, json={
        "instances": [{"INPUT0": INPUT0[0].tolist(), "INPUT1": INPUT1[0].tolist()}], "parameters": {"priority": 1},
    }).json()
    assert v1 == {"predictions": [{"OUTPUT0": SUM[0].tolist(), "OUTPUT1": DIFFERENCE[0].tolist()}]}

    after = statistics(server)
    count = lambda stats, field: stats["inference_stats"][field]["count"]  # noqa: E731
    for field in ("success", *COMPUTE):
        assert count(after, field) - count(before, field) == 4, field
    assert after["inference_count"] - before["inference_count"] == 4


def test_every_route_refuses_a_malformed_request_with_the_same_words(server):
    wrong = np.zeros((1, 15), np.int32)
    words = "input 'INPUT0' has shape [1, 15], the model expects [-1, 16]"
    before = statistics(server)
    rest = requests.post(f"{server.url}/v2/models/simple/infer", timeout=10, json={"inputs": [
        {"name": "INPUT0", "shape": [1, 15], "datatype": "INT32", "data": wrong.ravel().tolist()},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": INPUT1.ravel().tolist()},
    ]})
    assert rest.status_code == 400 and rest.json() == {"error": words}
    tensors = [grpcclient.InferInput("INPUT0", [1, 15], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    tensors[0].set_data_from_numpy(wrong)
    tensors[1].set_data_from_numpy(INPUT1)
    with grpcclient.InferenceServerClient(server.grpc) as client, pytest.raises(Exception) as refused:
        client.infer("simple", tensors)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and refused.value.message() == words
    v1 = requests.post(f"{server.url}/v1/models/simple:predict", timeout=10, json={
        "instances": [{"INPUT0": wrong[0].tolist(), "INPUT1": INPUT1[0].tolist()}],
    })
    assert v1.status_code == 400 and v1.json() == {"error": words}
    # A malformed request never reaches the model: as in Triton, no statistic counts it.
    assert statistics(server)["inference_stats"] == before["inference_stats"]

"""The `ascend` backend inside real Triton 2.51, on the same model_repository/ as the KServe server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import copy_model, infer, scrape, start_triton, statistics, stop_server, tensors

MODELS = (
    "sim", "simple", "yolov8n", "yolov8n_detect", "yolov8_preprocess", "yolov8_postprocess",
    "simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence", "sequence_accumulator",
)


def test_every_model_is_ready_in_triton(triton):
    index = requests.post(f"{triton.url}/v2/repository/index").json()
    assert {(m["name"], m["state"]) for m in index} == {(name, "READY") for name in MODELS}
    with grpcclient.InferenceServerClient(triton.grpc) as client:
        assert client.is_server_ready()
        assert all(client.is_model_ready(name) for name in MODELS)


def test_model_metadata_agrees_between_triton_and_kserve(triton, server):
    for name in MODELS:
        ours = requests.get(f"{server.url}/v2/models/{name}").json()
        theirs = requests.get(f"{triton.url}/v2/models/{name}").json()
        ours.pop("parameters")  # runtime choices: a kserve-ascend addition
        assert ours == theirs


CASES = {
    "simple": lambda rng: {
        "INPUT0": rng.integers(-100, 100, (3, 16), dtype=np.int32),
        "INPUT1": rng.integers(-100, 100, (3, 16), dtype=np.int32),
    },
    "yolov8n": lambda rng: {"images": rng.random((2, 3, 640, 640), dtype=np.float32)},
    "sim": lambda rng: {"INPUT0": rng.random((4, 4), dtype=np.float32)},
}


@pytest.mark.parametrize("model", list(CASES))
def test_triton_and_kserve_give_the_same_outputs_over_http_and_grpc(triton, server, model):
    """One differential test driving both servers with the same inputs, over both protocols."""
    inputs = CASES[model](np.random.default_rng(11))
    reference, *answers = [infer(target, model, inputs, protocol) for target in (triton, server) for protocol in ("http", "grpc")]
    for answer in answers:
        assert answer.keys() == reference.keys()
        for name in reference:
            np.testing.assert_allclose(answer[name], reference[name], rtol=1e-5, atol=1e-6)
    if model == "simple":
        np.testing.assert_array_equal(reference["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])


def test_triton_dynamic_batcher_forms_batches_for_the_backend(triton):
    def call(index):
        data = np.full((1, 4), index, np.float32)
        np.testing.assert_array_equal(infer(triton, "sim", {"INPUT0": data}, "grpc")["OUTPUT0"], data)

    before = statistics(triton, "sim")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(call, range(32)))
    after = statistics(triton, "sim")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 32
    assert executions < inferences  # Triton handed model.py batches larger than one request
    assert max(b["batch_size"] for b in after["batch_stats"]) > 1


def test_a_bad_request_in_triton_fails_alone(triton):
    with httpclient.InferenceServerClient(triton.http) as client:
        with pytest.raises(Exception, match="unexpected shape|expected|shape"):
            bad = httpclient.InferInput("INPUT0", [1, 5], "FP32")
            bad.set_data_from_numpy(np.ones((1, 5), np.float32))
            client.infer("sim", [bad])
        good = client.infer("sim", tensors(httpclient, {"INPUT0": np.ones((1, 4), np.float32)}))
        assert good.as_numpy("OUTPUT0").sum() == 4


def test_triton_metrics_list_the_models(triton):
    models = set(scrape(triton).by("model", "nv_inference_request_success"))
    assert set(MODELS) <= models


def test_broken_model_unavailable_and_bare_config_auto_completed_in_triton(tmp_path):
    repository = tmp_path / "repo"
    repository.mkdir()
    copy_model("simple", repository)
    broken = copy_model("simple", repository, "corrupt")
    (broken / "1" / "model.onnx").write_bytes(b"not an onnx graph")
    # A file whose digest is not the one its config expects is refused as in the KServe server.
    tampered = copy_model("simple", repository, "tampered")
    (tampered / "config.pbtxt").write_text(
        (tampered / "config.pbtxt").read_text() + 'parameters { key: "sha256" value: { string_value: "' + "0" * 64 + '" } }\n'
    )
    # A config that names only the backend: inputs, outputs and batching come from the file.
    bare = copy_model("simple", repository, "bare")
    (bare / "config.pbtxt").write_text('backend: "ascend"\n')
    # Four instances over NPUs 2 and 3, placed as the KServe server places them.
    placed = copy_model("sim", repository, "placed")
    (placed / "config.pbtxt").write_text(
        (placed / "config.pbtxt").read_text().replace("count: 1", "count: 4")
        + 'parameters { key: "device_ids" value: { string_value: "2,3" } }\n'
    )
    triton = start_triton(repository, tmp_path, "--exit-on-error=false", wait_ready=False)
    try:
        log = triton.output()
        for instance, device in {"placed_0_0": 2, "placed_0_1": 3, "placed_0_2": 2, "placed_0_3": 3}.items():
            assert f"{instance}: model.sim with runtime sim on device {device}" in log
        metadata = requests.get(f"{triton.url}/v2/models/bare").json()
        assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
            ("INPUT0", "INT32", [-1, 16]),
            ("INPUT1", "INT32", [-1, 16]),
        ]
        assert requests.get(f"{triton.url}/v2/models/bare/config").json()["max_batch_size"] == 4
        index = {m["name"]: m for m in requests.post(f"{triton.url}/v2/repository/index").json()}
        assert index["simple"]["state"] == "READY"
        assert index["corrupt"]["state"] == "UNAVAILABLE"
        assert "onnxruntime cannot load model.onnx" in index["corrupt"]["reason"]
        assert index["tampered"]["state"] == "UNAVAILABLE"
        assert "but the config expects " + "0" * 64 in index["tampered"]["reason"]
        with httpclient.InferenceServerClient(triton.http) as client:
            inputs = {"INPUT0": np.ones((1, 16), np.int32), "INPUT1": np.ones((1, 16), np.int32)}
            assert client.infer("simple", tensors(httpclient, inputs)).as_numpy("OUTPUT0").sum() == 32
    finally:
        stop_server(triton)

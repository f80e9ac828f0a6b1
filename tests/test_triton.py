"""The `ascend` backend inside real Triton 2.51, on the same model_repository/ as the KServe server."""

from __future__ import annotations

import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import ROOT, copy_model, executions_by_batch_size, infer, scrape, start_triton, statistics, stop_server, tensors, wait_for

MODELS = (
    "sim", "simple", "yolov8n", "yolov8n_detect", "yolov8_preprocess", "yolov8_postprocess",
    "simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence", "sequence_accumulator", "repeat_int32",
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


def counted(triton, model: str, before: dict, key: str, more: int) -> dict:
    """The model's statistics once `key` counts `more` than `before`: Triton records an execution once its
    responses are out, so the last one answered may be counted a moment later."""
    def grown() -> dict | None:
        now = statistics(triton, model)
        return now if now[key] - before[key] >= more else None

    return wait_for(grown, f"{more} more {key} of {model}", timeout=10)


def test_triton_dynamic_batcher_forms_batches_for_the_backend(triton):
    def call(index):
        data = np.full((1, 4), index, np.float32)
        np.testing.assert_array_equal(infer(triton, "sim", {"INPUT0": data}, "grpc")["OUTPUT0"], data)

    before = statistics(triton, "sim")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(call, range(32)))
    after = counted(triton, "sim", before, "inference_count", 32)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 32
    assert executions < inferences  # Triton handed model.py batches larger than one request
    assert max(b["batch_size"] for b in after["batch_stats"]) > 1


#: One batch of this many requests: Triton's dynamic batcher sends it as soon as they have all come
#: (preferred_batch_size), and waits up to 10 s for them.
BATCH = 4


@pytest.fixture(scope="module")
def batching_triton(tmp_path_factory):
    """Real Triton serving conformance/models/simple_string (integers written as text, added by an
    ONNX graph) through the `ascend` backend, with dynamic batching."""
    repository = tmp_path_factory.mktemp("strings_repo")
    model = repository / "simple_string"
    shutil.copytree(ROOT / "conformance" / "models" / "simple_string", model)
    with open(model / "config.pbtxt", "a") as config:
        config.write(f"dynamic_batching {{ preferred_batch_size: [ {BATCH} ] max_queue_delay_microseconds: 10000000 }}\n")
    server = start_triton(repository, tmp_path_factory.mktemp("strings_triton"))
    yield server
    stop_server(server)


def test_a_bad_request_in_a_triton_batch_fails_alone_in_the_backend(batching_triton):
    """Bytes that are not UTF-8 pass Triton's own checks (any bytes make a BYTES element) and reach the
    `ascend` backend in a batch Triton formed with good requests: the backend refuses that request
    alone (INVALID_ARGUMENT, its reason), and answers the others in the same execution."""
    triton = batching_triton
    numbers = [np.arange(16, dtype=np.int32).reshape(1, 16) * (index + 1) for index in range(BATCH)]
    good = {"INPUT1": np.array([[b"1"] * 16], dtype=object)}

    def send(index: int):
        text = np.array([[str(n).encode() for n in numbers[index].ravel()]], dtype=object)
        if index == 1:
            text[0, 5] = b"\xff\xfe"  # not UTF-8
        try:
            return infer(triton, "simple_string", {"INPUT0": text, **good}, "grpc" if index % 2 else "http")
        except InferenceServerException as error:
            return error

    before = statistics(triton, "simple_string")
    with ThreadPoolExecutor(BATCH) as pool:
        answers = list(pool.map(send, range(BATCH)))
    after = counted(triton, "simple_string", before, "execution_count", 1)

    refused = answers.pop(1)
    assert isinstance(refused, InferenceServerException), refused
    assert refused.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'INPUT0' element 5 is not UTF-8 text" in refused.message()
    for index, answer in zip((0, 2, 3), answers):
        assert not isinstance(answer, Exception), answer
        np.testing.assert_array_equal(answer["OUTPUT0"].astype(np.int64), numbers[index] + 1)
        np.testing.assert_array_equal(answer["OUTPUT1"].astype(np.int64), numbers[index] - 1)
    # Triton formed one batch of all four: one execution of batch size 4 ran.
    assert after["execution_count"] - before["execution_count"] == 1
    executed = Counter(executions_by_batch_size(after))
    executed.subtract(executions_by_batch_size(before))
    assert +executed == {BATCH: 1}


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

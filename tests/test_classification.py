"""Triton's classification extension on the KServe server, held to real Triton 2.51 on the same repository.

Triton runs the `ascend` backend and classifies itself; the KServe server classifies in its
data plane. The same requests must give the same strings, over REST (JSON and binary) and gRPC.
"""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
from google.protobuf import json_format
from onnx import TensorProto, helper
from PIL import Image
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from conftest import ROOT, both_servers, infer
from kserve_ascend.core.models import classification
from kserve_ascend.core.errors import InvalidInput, ModelLoadError

CONFORMANCE = ROOT / "conformance" / "models"

SIM = 'backend: "ascend"\nparameters { key: "runtime" value: { string_value: "sim" } }\n'
MODELS = {
    # Labels with a carriage return, an empty line and fewer lines than classes, kept as Triton keeps them.
    "scores": (
        'name: "scores"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 6 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 6 ] label_filename: "labels.txt" } ]\n' + SIM,
        b"cat\r\n\nbird\nfish",
    ),
    # A model that does not batch: every element of the output is a class.
    "grid": (
        'name: "grid"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP64 dims: [ 2, 3 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP64 dims: [ 2, 3 ] } ]\n' + SIM,
        None,
    ),
    "integers": (
        'name: "integers"\nmax_batch_size: 4\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT8 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_UINT64 dims: [ 4 ] },'
        ' { name: "INPUT2" data_type: TYPE_BOOL dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT8 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_UINT64 dims: [ 4 ] },'
        ' { name: "OUTPUT2" data_type: TYPE_BOOL dims: [ 4 ] } ]\n' + SIM,
        None,
    ),
}
IMAGE_LABELS = b"red\ngreen\nblue\n"


def image_classifier() -> onnx.ModelProto:
    """An "image classifier" of an NCHW image: the score of each class is the mean of one colour channel."""
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["IMAGE"], ["SCORES"], axes=[2, 3], keepdims=0)],
        "image",
        [helper.make_tensor_value_info("IMAGE", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("SCORES", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    repository = tmp_path_factory.mktemp("classification_models")
    for name, (config, labels) in MODELS.items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "1" / "model.sim").write_bytes(b"")
        (repository / name / "config.pbtxt").write_text(config)
        if labels is not None:
            (repository / name / "labels.txt").write_bytes(labels)
    image = repository / "image"
    (image / "1").mkdir(parents=True)
    onnx.save(image_classifier(), image / "1" / "model.onnx")
    (image / "labels.txt").write_bytes(IMAGE_LABELS)
    (image / "config.pbtxt").write_text(
        'name: "image"\nbackend: "ascend"\nmax_batch_size: 2\n'
        'input [ { name: "IMAGE" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 8, 8 ] } ]\n'
        'output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "labels.txt" } ]\n'
    )
    shutil.copytree(CONFORMANCE / "identity_bytes", repository / "identity_bytes")
    # Its label file is missing: neither server may serve it.
    unlabelled = shutil.copytree(repository / "scores", repository / "unlabelled")
    (unlabelled / "labels.txt").unlink()
    (unlabelled / "config.pbtxt").write_text((unlabelled / "config.pbtxt").read_text().replace('"scores"', '"unlabelled"'))
    return repository


@pytest.fixture(scope="module")
def servers(repository, tmp_path_factory):
    """{"kserve-ascend": ..., "triton": ...}, both on the repository, the broken model left out of readiness."""
    yield from both_servers(repository, tmp_path_factory, "--exit-on-error=false", wait_ready=False)


def ready(target, model: str) -> bool:
    return requests.get(f"{target.url}/v2/models/{model}/ready", timeout=5).status_code == 200


# ---------------------------------------------------------------- the strings, without a server


def test_values_print_as_cpp_std_to_string_does():
    """std::to_string(float/double) is specified as sprintf("%f"): held to the C library's own."""
    libc = ctypes.CDLL(None)
    buffer = ctypes.create_string_buffer(512)
    rng = np.random.default_rng(3)
    values = [*rng.normal(0, 1e6, 200), *rng.uniform(-1, 1, 200), 0.5, 2.5e-7, 1e20, -0.0, 123456.7890625, float("inf")]
    for value in values:
        for dtype in (np.float32, np.float64):
            typed = dtype(value)
            libc.snprintf(buffer, len(buffer), b"%f", ctypes.c_double(float(typed)))
            assert classification._float_text(typed) == buffer.value.decode()


def test_top_classes_rank_by_value_with_ties_in_index_order():
    scores = np.array([[1, 3, 3, 0, 3], [9, 8, 7, 6, 5]], np.int32)
    top = classification.classify({"out": scores}, {"out": 3}, {"out": (b"a", b"b")}, batching=True)["out"]
    assert top.tolist() == [[b"3:1:b", b"3:2", b"3:4"], [b"9:0:a", b"8:1:b", b"7:2"]]
    # Not batching: the whole output is one set of classes; k beyond them returns them all.
    whole = classification.classify({"out": np.array([[0.5, 2.0], [1.0, -1.0]])}, {"out": 9}, {}, batching=False)["out"]
    assert whole.tolist() == [b"2.000000:1", b"1.000000:2", b"0.500000:0", b"-1.000000:3"]
    untouched = np.arange(3)
    assert classification.classify({"other": untouched}, {}, {}, batching=False)["other"] is untouched


@pytest.mark.parametrize("datatype", ["BOOL", "BYTES"])
def test_outputs_without_an_order_are_refused(datatype):
    array = np.array([[True, False]]) if datatype == "BOOL" else np.array([[b"a", b"b"]], dtype=object)
    with pytest.raises(InvalidInput, match=f"unsupported type '{datatype}'"):
        classification.classify({"out": array}, {"out": 1}, {}, batching=True)


@pytest.mark.parametrize("count", [0, -2, 1.5, "3", True, None])
def test_a_count_is_a_whole_number_of_at_least_one(count):
    with pytest.raises(InvalidInput, match="'classification' of output 'out'"):
        classification.classification_count(count, "out")


def test_labels_are_lines_kept_byte_for_byte(tmp_path):
    config = mc.ModelConfig()
    config.output.add(name="a", label_filename="a.txt")
    config.output.add(name="b", label_filename="b.txt")
    config.output.add(name="c")
    (tmp_path / "a.txt").write_bytes(b"x \r\n\n\xffy\nlast")
    (tmp_path / "b.txt").write_bytes(b"")
    assert classification.read_labels(config, tmp_path) == {"a": (b"x \r", b"", b"\xffy", b"last"), "b": ()}
    (tmp_path / "b.txt").unlink()
    with pytest.raises(ModelLoadError, match="label_filename of output 'b': cannot read .*b.txt"):
        classification.read_labels(config, tmp_path)


# ---------------------------------------------------------------- side by side with real Triton

CASES = {
    "labels": ("scores", {"INPUT0": np.array([[0.5, 4.0, 0.25, 1.0, 3.0, 2.0], [9.5, 1, 2, 3, 4, 5]], np.float32)}, {"OUTPUT0": 4}),
    "more_than_the_classes": ("scores", {"INPUT0": np.array([[1e-7, -3, 7e5, 0.1, 2, 2]], np.float32)}, {"OUTPUT0": 10}),
    "not_batching": ("grid", {"INPUT0": np.array([[1.5, -2, 3.25], [1e20, 0, 1e-9]])}, {"OUTPUT0": 4}),
    "integers": (
        "integers",
        {
            "INPUT0": np.array([[-5, 7, 3, 127], [0, -128, 1, 2]], np.int8),
            "INPUT1": np.array([[1, 2**64 - 1, 5, 0], [3, 2, 1, 0]], np.uint64),
            "INPUT2": np.zeros((2, 4), bool),
        },
        {"OUTPUT0": 3, "OUTPUT1": 2},
    ),
}


def classified(target, protocol: str, model: str, inputs: dict, counts: dict, binary: bool = True) -> dict:
    """(datatype, shape, list of bytes) of each classified output, over one protocol."""
    outputs = infer(target, model, inputs, protocol, outputs={name: {"class_count": k} for name, k in counts.items()}, binary_data=binary)
    return {
        name: (np_to_triton_dtype(values.dtype), list(values.shape), [v if isinstance(v, bytes) else v.encode() for v in values.ravel()])
        for name, values in outputs.items()
    }


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_strings_as_triton_over_rest_and_grpc(servers, case):
    model, inputs, counts = CASES[case]
    answers = {}
    for target_name, target in servers.items():
        for protocol, binary in (("http", False), ("http", True), ("grpc", True)):
            answers[(target_name, protocol, binary)] = classified(target, protocol, model, inputs, counts, binary)
    reference = answers.pop(("triton", "grpc", True))
    for key, answer in answers.items():
        assert answer == reference, key
    if case == "labels":  # what Triton answers, spelled out
        assert reference["OUTPUT0"] == (
            "BYTES", [2, 4],
            [b"4.000000:1", b"3.000000:4", b"2.000000:5", b"1.000000:3:fish",
             b"9.500000:0:cat\r", b"5.000000:5", b"4.000000:4", b"3.000000:3:fish"],
        )


def test_a_boolean_output_is_refused_as_triton_refuses_it(servers):
    _, inputs, _ = CASES["integers"]
    for target in servers.values():
        with pytest.raises(InferenceServerException, match="class result not available for output due to unsupported type 'BOOL'") as error:
            classified(target, "http", "integers", inputs, {"OUTPUT2": 1})
        assert error.value.status() == "400"


def test_a_label_file_that_cannot_be_read_fails_the_load_as_in_triton(servers):
    for target in servers.values():
        assert ready(target, "scores") and not ready(target, "unlabelled")
        entry = next(e for e in requests.post(f"{target.url}/v2/repository/index").json() if e["name"] == "unlabelled")
        assert entry["state"] == "UNAVAILABLE" and "labels.txt" in entry["reason"], entry


def test_kserve_refuses_what_triton_cannot_classify(servers):
    """Where Triton 2.51 errs (a BYTES output kills the server over REST; `classification: -1` is a 500
    and 0 means no classification over REST, while gRPC refuses counts below 1), the KServe server says 400."""
    url = servers["kserve-ascend"].url
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "b"]}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 1}}]}
    response = requests.post(f"{url}/v2/models/identity_bytes/infer", json=body)
    assert response.status_code == 400 and "unsupported type 'BYTES'" in response.json()["error"]
    for count in (0, -1, 2.5, "2", True):
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 6], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}],
                "outputs": [{"name": "OUTPUT0", "parameters": {"classification": count}}]}
        response = requests.post(f"{url}/v2/models/scores/infer", json=body)
        assert response.status_code == 400 and "'classification' of output 'OUTPUT0'" in response.json()["error"], count
    assert requests.post(f"{url}/v2/models/scores/infer", json={**body, "outputs": []}).status_code == 200


def test_the_server_declares_the_extension(servers):
    for target in servers.values():
        assert "classification" in requests.get(f"{target.url}/v2").json()["extensions"]


# ---------------------------------------------------------------- image_client.py -c 3, as a user runs it


def classify_image(target, protocol: str, model: str, image: Image.Image, classes: int) -> list[tuple[float, int, str]]:
    """What Triton's image_client.py does with `-c`: read the model's metadata and config, check it is an
    image classifier, shape the image as its input wants, ask for the top classes, split each answer."""
    module = httpclient if protocol == "http" else grpcclient
    with module.InferenceServerClient(target.http if protocol == "http" else target.grpc) as client:
        metadata = client.get_model_metadata(model)
        config = client.get_model_config(model)
        if protocol == "http":
            config = json_format.ParseDict(config, mc.ModelConfig(), ignore_unknown_fields=True)
            inputs, outputs = metadata["inputs"], metadata["outputs"]
            input_name, input_shape, input_type = inputs[0]["name"], inputs[0]["shape"], inputs[0]["datatype"]
            output_name, output_type = outputs[0]["name"], outputs[0]["datatype"]
        else:
            config = config.config
            inputs, outputs = metadata.inputs, metadata.outputs
            input_name, input_shape, input_type = inputs[0].name, list(inputs[0].shape), inputs[0].datatype
            output_name, output_type = outputs[0].name, outputs[0].datatype
        assert len(inputs) == 1 and len(outputs) == 1 and output_type == "FP32"
        batching = config.max_batch_size > 0
        assert len(input_shape) == 3 + batching and config.input[0].format == mc.ModelInput.FORMAT_NCHW
        channels, height, width = input_shape[-3:]
        pixels = np.asarray(image.convert("RGB").resize((width, height), Image.BILINEAR), np.float32)
        chw = np.transpose(pixels, (2, 0, 1))[: channels]
        batch = chw[np.newaxis] if batching else chw
        tensor = module.InferInput(input_name, list(batch.shape), input_type)
        tensor.set_data_from_numpy(batch)
        result = client.infer(model, [tensor], outputs=[module.InferRequestedOutput(output_name, class_count=classes)])
    found = []
    for row in result.as_numpy(output_name):
        for answer in row if batching else [row]:
            score, index, label = (answer.decode() if isinstance(answer, bytes) else answer).split(":")
            found.append((float(score), int(index), label))
    return found


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_image_client_reports_the_top_three_classes(servers, protocol):
    image = Image.new("RGB", (20, 12), (40, 200, 90))  # mostly green, then blue, then red
    for target in servers.values():
        assert classify_image(target, protocol, "image", image, 3) == [(200.0, 1, "green"), (90.0, 2, "blue"), (40.0, 0, "red")]

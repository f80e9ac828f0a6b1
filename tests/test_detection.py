"""YOLOv8 detection end to end on both servers: an image in, detections out (issue 9), through the
yolov8n_detect ensemble (pre-processing, the batched detector, post-processing; issue 19).

The shipped weights are random (seeded), so the detections of a real image mean nothing:
these tests check their structure, the two ways in (image bytes, letterboxed tensor),
that the KServe server and Triton (its own ensemble scheduler running each step on the
`ascend` backend) agree, that request parameters reach the post-processing step on both,
the V1 protocol and the client errors. The decoding itself is checked on known answers in
test_processing.py, and on a real trained detector in test_detection_reference.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import re

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image, ImageDraw
from tritonclient.utils import InferenceServerException

from conftest import copy_model
from kserve_ascend.core.errors import ModelLoadError
from kserve_ascend.core.models.model import Model
from kserve_ascend.core.execution.processing import image

MODEL = "yolov8n_detect"
OUTPUTS = ("detection_boxes", "detection_scores", "detection_classes", "num_detections")
# Random weights score every class near 1e-4: a threshold below that makes the output non-empty.
FEW = {"score_threshold": 0.0001, "max_detections": 7}


def street(fmt: str, size=(960, 540)) -> bytes:
    """A made-up scene: sky, road, a car-like box, a sun; encoded as `fmt`."""
    picture = Image.new("RGB", size, (110, 160, 220))
    draw = ImageDraw.Draw(picture)
    draw.rectangle((0, size[1] * 2 // 3, size[0], size[1]), fill=(60, 60, 60))
    draw.rectangle((200, 250, 520, 420), fill=(200, 30, 30))
    draw.ellipse((700, 40, 820, 160), fill=(250, 220, 0))
    buffer = io.BytesIO()
    picture.save(buffer, fmt)
    return buffer.getvalue()


JPEG, PNG = street("JPEG"), street("PNG", (480, 720))


def image_input(client, data: bytes):
    tensor = client.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([data], dtype=object))
    return tensor


def images_input(client, array: np.ndarray):
    tensor = client.InferInput("images", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def detect(client, url: str, inputs: list, parameters=None) -> dict[str, np.ndarray]:
    with client.InferenceServerClient(url) as connection:
        result = connection.infer(MODEL, inputs, parameters=parameters)
    return {name: result.as_numpy(name) for name in OUTPUTS}


def check_structure(found: dict[str, np.ndarray], width: int, height: int, limit: int) -> None:
    count = int(found["num_detections"][0])
    assert 0 < count <= limit
    assert found["detection_boxes"].shape == (count, 4) and found["detection_boxes"].dtype == np.float32
    assert found["detection_scores"].shape == (count,) and found["detection_scores"].dtype == np.float32
    assert found["detection_classes"].shape == (count,) and found["detection_classes"].dtype == np.int32
    boxes = found["detection_boxes"]
    assert (boxes[:, :2] <= boxes[:, 2:]).all() and (boxes >= 0).all()
    assert (boxes[:, 0::2] <= width).all() and (boxes[:, 1::2] <= height).all()
    assert (np.diff(found["detection_scores"]) <= 0).all()  # best first
    assert ((0 <= found["detection_classes"]) & (found["detection_classes"] < 80)).all()


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for name in OUTPUTS:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-3, err_msg=name)


@pytest.fixture(scope="module")
def targets(server, triton):
    return {"kserve": server, "triton": triton}


@pytest.mark.parametrize("data, width, height", [(JPEG, 960, 540), (PNG, 480, 720)], ids=["jpeg", "png"])
def test_an_image_gives_the_same_detections_on_both_servers_over_http_and_grpc(targets, data, width, height):
    answers = []
    for target in targets.values():
        answers.append(detect(httpclient, target.http, [image_input(httpclient, data)], FEW))
        answers.append(detect(grpcclient, target.grpc, [image_input(grpcclient, data)], FEW))
    check_structure(answers[0], width, height, FEW["max_detections"])
    for answer in answers[1:]:
        assert_same(answer, answers[0])


def detector_batches(target) -> dict[int, int]:
    """The detector's executions by batch size, from the statistics extension."""
    answer = requests.get(f"{target.url}/v2/models/yolov8n/stats").json()
    return {b["batch_size"]: b["compute_infer"]["count"] for b in answer["model_stats"][0]["batch_stats"]}


def test_concurrent_images_batch_at_the_detector_on_both_servers(targets):
    """The ensemble's point: pre-processing runs on its own instances while the detector's dynamic
    batcher gathers the images of concurrent requests into one execution (yolov8n: up to 8)."""
    images = 16
    for name, target in targets.items():
        before = detector_batches(target)
        with concurrent.futures.ThreadPoolExecutor(images) as pool:
            answers = list(pool.map(lambda _: detect(grpcclient, target.grpc, [image_input(grpcclient, JPEG)], FEW), range(images)))
        for answer in answers[1:]:
            assert_same(answer, answers[0])
        after = detector_batches(target)
        grown = {size: count - before.get(size, 0) for size, count in after.items() if count > before.get(size, 0)}
        assert sum(size * count for size, count in grown.items()) == images, (name, grown)
        assert max(grown) > 1, f"{name}: the detector ran only batches of {sorted(grown)}"


def test_the_letterboxed_tensor_gives_the_image_s_detections_in_tensor_pixels(targets):
    tensor, frame = image.letterbox(JPEG, (640, 640))
    from_bytes = detect(grpcclient, targets["kserve"].grpc, [image_input(grpcclient, JPEG)], FEW)
    for target in targets.values():
        found = detect(grpcclient, target.grpc, [images_input(grpcclient, tensor)], FEW)
        check_structure(found, 640, 640, FEW["max_detections"])
        np.testing.assert_array_equal(found["detection_scores"], from_bytes["detection_scores"])
        np.testing.assert_allclose(frame.to_image(found["detection_boxes"].copy()), from_bytes["detection_boxes"], atol=1e-3)


def test_defaults_find_nothing_in_random_weights_and_say_so(server):
    found = detect(httpclient, server.http, [image_input(httpclient, JPEG)])
    assert found["num_detections"].tolist() == [0]
    assert found["detection_boxes"].shape == (0, 4) and found["detection_scores"].shape == (0,)


def test_the_cann_design_client_request_over_v1(server):
    """The source design's client, unchanged: a nested-list tensor in, `outputs.detection_*` out."""
    tensor, _ = image.letterbox(JPEG, (640, 640))
    input_data = tensor.tolist()
    response = requests.post(
        f"{server.url}/v1/models/{MODEL}:predict", json={"inputs": {"images": input_data}, "parameters": FEW}
    )
    assert response.status_code == 200, response.text
    outputs = response.json()["outputs"]
    reference = detect(grpcclient, server.grpc, [images_input(grpcclient, tensor)], FEW)
    assert_same({name: np.array(outputs[name]) for name in OUTPUTS}, reference)
    # The same tensor without its leading 1, as [3, 640, 640]: the same answer.
    response = requests.post(f"{server.url}/v1/models/{MODEL}:predict", json={"inputs": {"images": input_data[0]}, "parameters": FEW})
    assert response.json()["outputs"] == outputs


def test_v1_rows_are_one_image_each(server):
    rows = [{"image": {"b64": base64.b64encode(data).decode()}} for data in (JPEG, PNG)]
    response = requests.post(f"{server.url}/v1/models/{MODEL}:predict", json={"instances": rows, "parameters": FEW})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert len(predictions) == 2
    for prediction, data in zip(predictions, (JPEG, PNG)):
        reference = detect(httpclient, server.http, [image_input(httpclient, data)], FEW)
        assert_same({name: np.array(prediction[name]) for name in OUTPUTS}, reference)


def test_v1_serves_plain_models_by_input_and_output_name(server):
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    url = f"{server.url}/v1/models/simple:predict"
    columns = requests.post(url, json={"inputs": {"INPUT0": a.tolist(), "INPUT1": a.tolist()}}).json()
    assert columns == {"outputs": {"OUTPUT0": (2 * a).tolist(), "OUTPUT1": np.zeros_like(a).tolist()}}
    rows = requests.post(url, json={"instances": [{"INPUT0": r.tolist(), "INPUT1": r.tolist()} for r in a]}).json()
    assert rows == {"predictions": [{"OUTPUT0": (2 * r).tolist(), "OUTPUT1": [0] * 16} for r in a]}
    # A one-input model takes bare rows.
    images = np.random.default_rng(3).random((1, 3, 640, 640), dtype=np.float32)
    bare = requests.post(f"{server.url}/v1/models/yolov8n:predict", json={"instances": images.tolist()})
    assert np.array(bare.json()["predictions"][0]["output0"]).shape == (84, 8400)


def test_v1_bare_values_go_to_the_one_input_of_their_kind(server):
    """The ensemble's inputs are both optional (one per request): a bare `{"b64": ...}` is the encoded
    image, a bare nested list of numbers the letterboxed tensor. A model with two required inputs
    takes no bare value: the 400 names its inputs."""
    tensor, _ = image.letterbox(JPEG, (640, 640))
    encoded = {"b64": base64.b64encode(JPEG).decode()}
    response = requests.post(
        f"{server.url}/v1/models/{MODEL}:predict", json={"instances": [encoded, tensor.tolist()], "parameters": FEW}
    )
    assert response.status_code == 200, response.text
    by_image, by_tensor = response.json()["predictions"]
    for prediction, request in ((by_image, image_input(httpclient, JPEG)), (by_tensor, images_input(httpclient, tensor))):
        assert_same({name: np.array(prediction[name]) for name in OUTPUTS}, detect(httpclient, server.http, [request], FEW))
    response = requests.post(f"{server.url}/v1/models/simple:predict", json={"instances": [list(range(16))]})
    assert response.status_code == 400
    assert response.json()["error"] == """instance 0 must name its inputs, as {"name": value}: the model has ['INPUT0', 'INPUT1']"""


def test_v1_takes_json_sent_as_curl_d_sends_it(server):
    """`curl -d` labels a body application/x-www-form-urlencoded, which KServe's V1 route leaves undecoded."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    body = b'{"instances": [{"INPUT0": [%s], "INPUT1": [%s]}]}' % ((b"1," * 16)[:-1], (b"2," * 16)[:-1])
    response = requests.post(f"{server.url}/v1/models/simple:predict", data=body, headers=form)
    assert response.json() == {"predictions": [{"OUTPUT0": [3] * 16, "OUTPUT1": [-1] * 16}]}
    response = requests.post(f"{server.url}/v1/models/simple:predict", data=b"instances=1", headers=form)
    assert response.status_code == 400
    assert response.json()["error"].startswith("a V1 request body must be JSON")


def test_v1_readiness(server):
    assert requests.get(f"{server.url}/v1/models/{MODEL}").json() == {"name": MODEL, "ready": True}


@pytest.mark.parametrize(
    "body, message",
    [
        ([1, 2], "JSON object"),
        ({"instances": [], "inputs": {}}, "exactly one of"),
        ({"instances": []}, "non-empty list"),
        ({"inputs": {"nope": [1]}}, "unexpected input 'nope'"),
        ({"inputs": [[]]}, "must name its inputs"),
        ({"inputs": {"image": [{"b64": "%%%"}]}}, "not base64"),
        ({"inputs": {"image": [7]}}, "BYTES"),
        ({"inputs": {"images": [[1, 2], [3]]}}, "regular"),
        ({"inputs": {"images": "text"}}, "not FP32"),
        ({"inputs": {"images": [1.0]}}, "shape"),
        ({"inputs": {"image": ["x"]}, "parameters": []}, "parameters"),
        ({"instances": [{"image": {"b64": ""}}, None]}, "must name its inputs"),
    ],
)
def test_v1_bad_bodies_are_400(server, body, message):
    response = requests.post(f"{server.url}/v1/models/{MODEL}:predict", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_v1_unknown_model_is_404(server):
    assert requests.post(f"{server.url}/v1/models/nope:predict", json={"inputs": {}}).status_code == 404


BAD_REQUESTS = {
    "both inputs": (lambda c: [image_input(c, JPEG), images_input(c, np.zeros((1, 3, 640, 640), np.float32))], None, "exactly one"),
    "no input": (lambda c: [], None, "exactly one"),
    "undecodable": (lambda c: [image_input(c, b"GIF89a but not really")], None, "input 'image'"),
    "truncated": (lambda c: [image_input(c, JPEG[:1000])], None, "input 'image'"),
    "score": (lambda c: [image_input(c, JPEG)], {"score_threshold": 1.5}, "score_threshold"),
    "iou": (lambda c: [image_input(c, JPEG)], {"iou_threshold": -1}, "iou_threshold"),
    "max": (lambda c: [image_input(c, JPEG)], {"max_detections": 0}, "max_detections"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_are_client_errors_on_both_servers(targets, case):
    make, parameters, message = BAD_REQUESTS[case]
    for target in targets.values():
        with httpclient.InferenceServerClient(target.http) as client:
            with pytest.raises(InferenceServerException, match=message) as raised:
                client.infer(MODEL, make(httpclient), parameters=parameters)
            assert raised.value.status() == "400"
        with grpcclient.InferenceServerClient(target.grpc) as client:
            with pytest.raises(InferenceServerException, match=message) as raised:
                client.infer(MODEL, make(grpcclient), parameters=parameters)
            assert raised.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        # ... and the server goes on serving.
        check_structure(detect(grpcclient, target.grpc, [image_input(grpcclient, PNG)], FEW), 480, 720, 7)


@pytest.mark.parametrize(
    "model, old, new, reason",
    [
        ("yolov8_preprocess", "max_batch_size: 0", "max_batch_size: 4", "has max_batch_size 0 and declares the output 'letterboxed'"),
        ("yolov8_preprocess", "dims: [ 1, 3, 640, 640 ] },\n  # width", "dims: [ 3, 640, 640 ] },\n  # width", "FP32 [1, 3, height, width]"),
        ("yolov8_postprocess", "max_batch_size: 0", "max_batch_size: 8", "max_batch_size must be 0"),
    ],
)
def test_a_processing_model_that_cannot_apply_fails_to_load_with_the_reason(tmp_path, model, old, new, reason):
    model_dir = copy_model(model, tmp_path)
    config = model_dir / "config.pbtxt"
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new))
    loaded = Model(model, model_dir)
    with pytest.raises(ModelLoadError, match=re.escape(reason)):
        loaded.load()
    assert loaded.state == "UNAVAILABLE" and reason in loaded.reason

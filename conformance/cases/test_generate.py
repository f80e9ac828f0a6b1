"""Triton's generate extension: `POST /v2/models/{model}[/versions/{v}]/generate` and `/generate_stream`, for an
ordinary model (`simple`, the identities) and a decoupled one (`repeat_int32`).

As Triton 2.51 answers (seen on the wire 2026-12-05, its `ascend` backend serving these models; server
src/http_server.cc, `HandleGenerate` and `GenerateRequestClass`). Triton does not declare `generate` in its
server metadata, and neither does kserve-ascend.
"""

import json

import pytest
import requests

GENERATE = "Triton extension_generate.md"
SIXTEEN = list(range(1, 17))
SIMPLE = {"INPUT0": SIXTEEN, "INPUT1": [1] * 16}
NOT_ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that generates various number of responses"
)


def generate(url: str, model: str, body, stream: bool = False, version: str = "") -> requests.Response:
    path = f"{url}/v2/models/{model}" + (f"/versions/{version}" if version else "") + ("/generate_stream" if stream else "/generate")
    payload = {"json": body} if isinstance(body, dict) else {"data": body, "headers": {"Content-Type": "application/json"}}
    return requests.post(path, timeout=30, **payload)


def events(response: requests.Response) -> list[dict]:
    """The Server-Sent Events of a /generate_stream answer: each `data: {...}` and a blank line."""
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8", response.headers
    chunks = response.text.split("\n\n")
    assert chunks[-1] == "" and all(chunk.startswith("data: ") for chunk in chunks[:-1]), response.text
    return [json.loads(chunk[len("data: "):]) for chunk in chunks[:-1]]


def repeat(values, delays=None, **more) -> dict:
    return {"IN": values, "DELAY": [0] * len(values) if delays is None else delays, "WAIT": 0, **more}


@pytest.mark.spec(f"{GENERATE} §Generate (JSON keys to inputs, outputs to keys)")
def test_generate_maps_keys_to_inputs_and_outputs_to_keys(url):
    response = generate(url, "simple", {**SIMPLE, "id": "g1"})
    assert (response.status_code, response.headers["content-type"]) == (200, "application/json"), response.text
    assert response.json() == {
        "OUTPUT0": [i + 1 for i in SIXTEEN], "OUTPUT1": [i - 1 for i in SIXTEEN],
        "id": "g1", "model_name": "simple", "model_version": "1",
    }
    # Keys in byte order, as Triton writes them.
    assert list(json.loads(response.content)) == ["OUTPUT0", "OUTPUT1", "id", "model_name", "model_version"]
    assert generate(url, "simple", SIMPLE, version="1").json()["model_version"] == "1"


@pytest.mark.spec(f"{GENERATE} §Generate (a lone element is a scalar; datatypes from the model)")
@pytest.mark.parametrize("model, value, answer", [
    ("identity_fp32", [1.5, 2, 3], [1.5, 2.0, 3.0]),
    ("identity_fp32", 2.5, 2.5),
    ("identity_bytes", ["kserve", "ascend"], ["kserve", "ascend"]),
    ("identity_bool", [True, False], [True, False]),
    ("identity_int64", [-5], -5),
])
def test_generate_takes_scalars_and_lists_of_the_inputs_datatype(url, model, value, answer):
    response = generate(url, model, {"INPUT0": value})
    assert response.status_code == 200, response.text
    assert response.json() == {"OUTPUT0": answer, "model_name": model, "model_version": "1"}


@pytest.mark.spec(f"{GENERATE} §Generate (shapes from the model's metadata)")
@pytest.mark.parametrize("body", [
    {"INPUT0": [SIXTEEN], "INPUT1": [[1] * 16]},  # nested: one element where 16 are needed
    {"INPUT0": 1, "INPUT1": 2},
    {"INPUT0": [1, 2], "INPUT1": [1, 2]},
])
def test_generate_refuses_values_that_do_not_fill_the_input(url, body):
    response = generate(url, "simple", body)
    assert (response.status_code, response.json()) == (400, {"error": "The schema can not convert input 'INPUT0' to tensor with proper shape"})


@pytest.mark.spec(f"{GENERATE} §Generate (other keys are parameters, also under 'parameters')")
def test_generate_takes_other_keys_as_parameters(url):
    for body in ({**SIMPLE, "p": 1.5, "q": "text", "r": True}, {**SIMPLE, "parameters": {"a": 1}}, {"parameters": SIMPLE}):
        response = generate(url, "simple", body)
        assert response.status_code == 200 and response.json()["OUTPUT0"] == [i + 1 for i in SIXTEEN], (body, response.text)
    for value in ([1], {"a": 1}, None):
        response = generate(url, "simple", {**SIMPLE, "p": value})
        assert (response.status_code, response.json()) == (
            400, {"error": "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'."},
        )


@pytest.mark.spec(f"{GENERATE} §Generate Stream (one event per response)")
def test_generate_stream_sends_an_event_per_response(url):
    response = generate(url, "repeat_int32", repeat([4, 5, 6], id="s"), stream=True)
    assert response.status_code == 200
    assert events(response) == [
        {"IDX": index, "OUT": value, "id": "s", "model_name": "repeat_int32", "model_version": "1"}
        for index, value in enumerate([4, 5, 6])
    ]
    assert events(generate(url, "repeat_int32", repeat([]), stream=True)) == []  # no response, no event
    ordinary = generate(url, "simple", SIMPLE, stream=True)
    assert ordinary.status_code == 200
    assert [e["OUTPUT1"] for e in events(ordinary)] == [[i - 1 for i in SIXTEEN]]


@pytest.mark.spec(f"{GENERATE} §Generate (a decoupled model must send exactly one response)")
def test_generate_answers_a_decoupled_models_one_response_or_refuses(url):
    one = generate(url, "repeat_int32", repeat([7]))
    assert (one.status_code, one.json()) == (200, {"IDX": 0, "OUT": 7, "model_name": "repeat_int32", "model_version": "1"})
    for values in ([1, 2, 3], []):  # Triton has answered 200 before it knows: the error comes in the body
        response = generate(url, "repeat_int32", repeat(values))
        assert (response.status_code, response.json()) == (200, {"error": NOT_ONE_RESPONSE})


@pytest.mark.spec(f"{GENERATE} §Generate Stream (errors in the stream)")
def test_an_error_of_the_model_is_an_error_event(url):
    mismatch = repeat([1, 2], delays=[0, 0, 0])
    streamed = generate(url, "repeat_int32", mismatch, stream=True)
    (error,) = events(streamed)
    assert streamed.status_code == 400 and error["error"].startswith("expected IN and DELAY shape to match")
    answered = generate(url, "repeat_int32", mismatch)
    assert answered.status_code == 400 and answered.json()["error"].startswith("expected IN and DELAY shape to match")


@pytest.mark.spec(f"{GENERATE}; Triton server src/http_server.cc (a request refused before the model: a JSON error)")
@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
def test_a_request_refused_before_the_model_is_a_json_error(url, stream):
    for model, body, version, status in [
        ("no_such_model", {}, "", 404), ("simple", {}, "7", 404), ("simple", {"INPUT0": SIXTEEN}, "", 400),
    ]:
        response = generate(url, model, body, stream=stream, version=version)
        assert response.status_code == status and response.headers["content-type"] == "application/json", response.text
        assert set(response.json()) == {"error"}


@pytest.mark.spec(f"{GENERATE}; OIP v2 required_api.md (a client error is 4xx with an error object)")
@pytest.mark.parametrize("body", [
    pytest.param('{"INPUT0": [1, 2', id="malformed_json"),
    pytest.param("[1, 2]", id="not_an_object"),
    pytest.param({**SIMPLE, "id": 5}, id="id_not_a_string"),
    pytest.param({**SIMPLE, "parameters": 5}, id="parameters_not_an_object"),
    pytest.param({"INPUT0": [*SIXTEEN[:-1], "x"], "INPUT1": [1] * 16}, id="json_values_of_wrong_type"),
])
def test_a_malformed_generate_body_is_4xx_with_error_body(url, body):
    response = generate(url, "simple", body)
    assert 400 <= response.status_code < 500 and set(response.json()) == {"error"}, (response.status_code, response.text)


@pytest.mark.spec(f"{GENERATE}; Triton 2.51 server metadata")
def test_generate_is_not_declared_in_server_metadata(extensions):
    assert "generate" not in extensions

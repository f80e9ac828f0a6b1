"""HTTP compression as Triton implements it, held to real Triton on model_repository/: gzip and deflate
request bodies inflated before parsing, inference responses compressed as Accept-Encoding asks."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient

OUTPUT0 = [i + 1 for i in range(16)]
BODY = json.dumps(
    {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16)) if n == "INPUT0" else [1] * 16} for n in ("INPUT0", "INPUT1")]}
).encode()


@pytest.fixture(params=["kserve", "triton"])
def target(request, server, triton):
    return {"kserve": server, "triton": triton}[request.param]


def post(target, path: str, body: bytes, headers: dict) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and the body as sent: http.client inflates nothing."""
    connection = http.client.HTTPConnection(target.http.split(":")[0], target.http_port, timeout=30)
    try:
        connection.request("POST" if body is not None else "GET", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def inflate(body: bytes, coding: str | None) -> bytes:
    return {"gzip": gzip.decompress, "deflate": zlib.decompress}.get(coding, lambda b: b)(body)


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("request_coding", ["gzip", "deflate", None])
@pytest.mark.parametrize("response_coding", ["gzip", "deflate", None])
def test_tritonclient_compression_options(target, binary, request_coding, response_coding):
    inputs = []
    for name, data in (("INPUT0", np.arange(16, dtype=np.int32)), ("INPUT1", np.ones(16, np.int32))):
        tensor = httpclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(data[None], binary_data=binary)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    with httpclient.InferenceServerClient(target.http) as client:
        result = client.infer(
            "simple", inputs, outputs=outputs,
            request_compression_algorithm=request_coding, response_compression_algorithm=response_coding,
        )
    assert result.as_numpy("OUTPUT0").tolist() == [OUTPUT0]


#: Accept-Encoding -> the coding Triton answers with (CompressionTypeUsed: highest q among identity, gzip, deflate).
ACCEPT = {
    "gzip": "gzip",
    "deflate": "deflate",
    "gzip;q=0.5, deflate": "deflate",
    "deflate;q=0.2, gzip;q=0.9": "gzip",
    "gzip;q=0": None,
    "identity, gzip;q=0.5": None,
    "br": None,
    "*": None,
}


@pytest.mark.parametrize("accept", list(ACCEPT))
def test_inference_responses_compressed_as_accept_encoding_asks(target, accept):
    status, headers, body = post(target, "/v2/models/simple/versions/1/infer", BODY, {"Accept-Encoding": accept})
    assert status == 200
    assert headers.get("content-encoding") == ACCEPT[accept]
    assert int(headers["content-length"]) == len(body)
    assert json.loads(inflate(body, ACCEPT[accept]))["outputs"][0]["data"] == OUTPUT0


def test_only_successful_inference_responses_are_compressed(target):
    # Errors stay plain (tritonclient reads them so), and so do the other routes, as in Triton.
    status, headers, body = post(target, "/v2/models/no_such_model/infer", BODY, {"Accept-Encoding": "gzip"})
    assert status == 404 and "content-encoding" not in headers and json.loads(body)["error"]
    status, headers, body = post(target, "/v2/models/simple", None, {"Accept-Encoding": "gzip"})
    assert status == 200 and "content-encoding" not in headers and json.loads(body)["name"] == "simple"


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_binary_header_length_counts_the_inflated_body(target, coding):
    header = json.dumps(
        {
            "inputs": [
                {"name": n, "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}} for n in ("INPUT0", "INPUT1")
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}],
        }
    ).encode()
    body = header + np.arange(16, dtype=np.int32).tobytes() + np.ones(16, np.int32).tobytes()
    compressed = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
    status, _, answer = post(
        target, "/v2/models/simple/infer", compressed,
        {"Content-Encoding": coding, "Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"] == OUTPUT0


@pytest.mark.parametrize(
    ("body", "coding", "status", "words"),
    [
        (b"not compressed at all", "gzip", 400, "is not valid gzip data"),
        (gzip.compress(BODY, mtime=0)[:40], "gzip", 400, "ends before the end of its gzip data"),  # one id in every xdist worker
        (b"", "deflate", 400, "ends before the end of its deflate data"),
        (zlib.compress(BODY) + b"more", "deflate", 400, "goes on after the end of its deflate data"),
        # Triton answers 501 "Unsupported compression type" (its FIXME: UNSUPPORTED is mapped to 501).
        (BODY, "br", 415, "unsupported Content-Encoding 'br'"),
    ],
)
def test_unreadable_compressed_bodies_are_client_errors(server, body, coding, status, words):
    answer_status, headers, answer = post(server, "/v2/models/simple/infer", body, {"Content-Encoding": coding})
    assert answer_status == status
    assert words in json.loads(answer)["error"]
    if status == 415:
        assert headers["accept-encoding"] == "gzip, deflate"  # RFC 9110 §15.5.16, as Triton names them
    assert post(server, "/v2/models/simple/infer", gzip.compress(BODY), {"Content-Encoding": "gzip"})[0] == 200


def test_a_zip_bomb_answers_413_within_the_input_size_limit(server):
    # 256 MiB of zeros in 256 KiB: past the default --http_max_input_size of 64 MiB once inflated.
    deflater = zlib.compressobj(6, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    bomb = b"".join(deflater.compress(zeros) for _ in range(256)) + deflater.flush()
    assert len(bomb) < 2**20
    status, headers, answer = post(server, "/v2/models/simple/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 413
    assert json.loads(answer)["error"] == "the request body inflates to more than 67108864 bytes (--http_max_input_size)"
    assert post(server, "/v2/models/simple/infer", gzip.compress(BODY), {"Content-Encoding": "gzip"})[0] == 200


def test_large_tensors_both_ways(target):
    # A 4.9 MB input inflated from a few KB in many chunks; a 2.8 MB output compressed off the event loop.
    header = json.dumps(
        {"inputs": [{"name": "images", "shape": [1, 3, 640, 640], "datatype": "FP32", "parameters": {"binary_data_size": 4915200}}],
         "outputs": [{"name": "output0", "parameters": {"binary_data": True}}]}
    ).encode()
    body = header + np.full((1, 3, 640, 640), 0.5, np.float32).tobytes()
    length = {"Inference-Header-Content-Length": str(len(header))}
    status, headers, plain = post(target, "/v2/models/yolov8n/infer", body, length)
    assert status == 200 and len(plain) > 84 * 8400 * 4
    status, headers, compressed = post(
        target, "/v2/models/yolov8n/infer", gzip.compress(body), {**length, "Content-Encoding": "gzip", "Accept-Encoding": "deflate"}
    )
    assert status == 200 and headers["content-encoding"] == "deflate" and len(compressed) < len(plain)
    assert zlib.decompress(compressed) == plain

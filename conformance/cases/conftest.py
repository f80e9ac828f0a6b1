"""Shared fixtures of the cases: clients for the target, its declared extensions, request helpers."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

#: OIP datatype -> numpy dtype and a few values that exercise its range.
SAMPLES = {
    "BOOL": np.array([True, False, True]),
    "UINT8": np.array([0, 7, 255], np.uint8),
    "UINT16": np.array([0, 7, 65535], np.uint16),
    "UINT32": np.array([0, 7, 2**32 - 1], np.uint32),
    "UINT64": np.array([0, 7, 2**64 - 1], np.uint64),
    "INT8": np.array([-128, 0, 127], np.int8),
    "INT16": np.array([-32768, 0, 32767], np.int16),
    "INT32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
    "INT64": np.array([-(2**63), 0, 2**63 - 1], np.int64),
    "FP16": np.array([-1.5, 0.0, 65504.0], np.float16),
    "FP32": np.array([-1.25, 0.0, 3.4e38], np.float32),
    "FP64": np.array([-1.25, 0.0, 1.7e308], np.float64),
    "BYTES": np.array([b"kserve", b"", "ascend \u00e9".encode()], dtype=object),
}
DATATYPES = list(SAMPLES)


def identity(datatype: str) -> str:
    return f"identity_{datatype.lower()}"


@pytest.fixture(scope="session")
def url(target) -> str:
    return target.url


@pytest.fixture(scope="session")
def http(target):
    with httpclient.InferenceServerClient(target.http) as client:
        yield client


@pytest.fixture(scope="session")
def grpc(target):
    with grpcclient.InferenceServerClient(target.grpc) as client:
        yield client


@pytest.fixture(scope="session")
def extensions(url) -> set[str]:
    return set(requests.get(f"{url}/v2").json().get("extensions", []))


@pytest.fixture
def requires(extensions):
    """`requires("statistics")` skips the case when the server does not declare the extension."""

    def check(name: str) -> None:
        if name not in extensions:
            pytest.skip(f"the server does not declare the '{name}' extension")

    return check


def simple_body(**changes) -> dict:
    body = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
        ]
    }
    body.update(changes)
    return body


def assert_serves(url: str) -> None:
    """The server still answers a good request correctly."""
    response = requests.post(f"{url}/v2/models/simple/infer", json=simple_body())
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
    assert outputs["OUTPUT0"] == [i + 1 for i in range(16)]

"""String (BYTES) tensors on the KServe server and in real Triton 2.51 through the `ascend` backend.

The conformance suite (conformance/cases/test_strings.py) checks each server on its own; here
both answer the same requests side by side, and text that an ONNX string tensor cannot hold
is refused, on both, as the client's mistake.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc as grpclib
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor

from conftest import ROOT, both_servers, infer

CONFORMANCE = ROOT / "conformance" / "models"
#: Queued long enough that requests sent together run as one batch.
BATCHED = "dynamic_batching { max_queue_delay_microseconds: 300000 }\n"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repository = tmp_path_factory.mktemp("string_models")
    for name in ("simple_string", "identity_bytes"):
        shutil.copytree(CONFORMANCE / name, repository / name)
    batched = shutil.copytree(CONFORMANCE / "simple_string", repository / "simple_string_batched")
    config = (batched / "config.pbtxt").read_text().replace('"simple_string"', '"simple_string_batched"')
    (batched / "config.pbtxt").write_text(config + BATCHED)
    yield from both_servers(repository, tmp_path_factory)


def text(array: np.ndarray) -> np.ndarray:
    return np.array([str(x).encode() for x in array.ravel()], dtype=object).reshape(array.shape)


RNG = np.random.default_rng(5)
A = RNG.integers(-(10**6), 10**6, (8, 16), dtype=np.int32)  # a full batch (max_batch_size 8)
B = RNG.integers(-(10**6), 10**6, (8, 16), dtype=np.int32)
NOT_UTF8 = b"\xc3\x28"  # a truncated two-byte sequence


def answers(target, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict:
    """Each output's shape and elements (bytes) over REST JSON, REST binary, gRPC raw and gRPC typed contents."""
    found = {}
    for binary in (False, True):
        for name, values in infer(target, model, inputs, outputs=outputs, binary_data=binary).items():
            found[("rest", binary, name)] = (list(values.shape), [v if isinstance(v, bytes) else v.encode() for v in values.ravel()])
    with grpclib.insecure_channel(target.grpc) as channel:
        request = pb.ModelInferRequest(model_name=model)
        for name, array in inputs.items():
            request.inputs.add(name=name, datatype="BYTES", shape=list(array.shape)).contents.bytes_contents.extend(array.ravel())
        typed = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
        for index, output in enumerate(typed.outputs):
            found[("grpc-typed", output.name)] = (list(output.shape), list(deserialize_bytes_tensor(typed.raw_output_contents[index])))
    for name, values in infer(target, model, inputs, "grpc").items():
        found[("grpc-raw", name)] = (list(values.shape), list(values.ravel()))
    return found


def test_simple_string_answers_as_triton_does(servers):
    inputs = {"INPUT0": text(A), "INPUT1": text(B)}
    ours, theirs = (answers(servers[name], "simple_string", inputs, ("OUTPUT0", "OUTPUT1")) for name in ("kserve-ascend", "triton"))
    assert ours == theirs and len(ours) == 8
    assert theirs[("grpc-raw", "OUTPUT0")] == ([8, 16], list(text(A + B).ravel()))
    assert theirs[("rest", False, "OUTPUT1")] == ([8, 16], list(text(A - B).ravel()))


def test_any_bytes_round_trip_as_in_triton(servers):
    data = np.array([[bytes(range(256)), b"he\x00llo", b"", NOT_UTF8, "\u6607\u817e".encode()]], dtype=object)
    for target in servers.values():
        with grpcclient.InferenceServerClient(target.grpc) as client:
            tensor = grpcclient.InferInput("INPUT0", list(data.shape), "BYTES")
            tensor.set_data_from_numpy(data)
            assert client.infer("identity_bytes", [tensor]).as_numpy("OUTPUT0").tolist() == data.tolist()
        blob = serialize_byte_tensor(data).item()
        header = (
            b'{"inputs":[{"name":"INPUT0","shape":[1,5],"datatype":"BYTES","parameters":{"binary_data_size":%d}}],'
            b'"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}' % len(blob)
        )
        response = requests.post(
            f"{target.url}/v2/models/identity_bytes/infer", data=header + blob,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        assert response.status_code == 200, response.text
        assert response.content.endswith(blob)  # byte for byte what the client sent


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_that_are_not_utf8_are_a_client_error_for_an_onnx_string_input(servers, protocol):
    """ONNX Runtime holds a tensor(string) as UTF-8 text: other bytes are refused, naming the input, not altered."""
    bad = text(A[:1])
    bad[0, 3] = NOT_UTF8
    module = httpclient if protocol == "http" else grpcclient
    for target in servers.values():
        with module.InferenceServerClient(target.http if protocol == "http" else target.grpc) as client:
            tensors = [module.InferInput(name, [1, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
            tensors[0].set_data_from_numpy(text(B[:1]))
            tensors[1].set_data_from_numpy(bad)
            with pytest.raises(InferenceServerException, match="input 'INPUT1' element 3 is not UTF-8") as error:
                client.infer("simple_string", tensors)
            assert error.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
            tensors[1].set_data_from_numpy(text(A[:1]))
            assert client.infer("simple_string", tensors).as_numpy("OUTPUT1").tolist() == text(B[:1] - A[:1]).tolist()


def test_a_bad_request_batched_with_good_ones_fails_alone(servers):
    """The text is checked per request before batching, so a batch never fails for one client's bytes."""
    bad = text(A[:1])
    bad[0, 0] = NOT_UTF8

    def send(target, index):
        with httpclient.InferenceServerClient(target.http) as client:
            tensors = [httpclient.InferInput(name, [1, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
            tensors[0].set_data_from_numpy(bad if index == 0 else text(A[index : index + 1]))
            tensors[1].set_data_from_numpy(text(B[index : index + 1]))
            try:
                return client.infer("simple_string_batched", tensors).as_numpy("OUTPUT0").tolist()
            except InferenceServerException as error:
                return error.status()

    for target in servers.values():
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda index: send(target, index), range(4)))
        assert results[0] == "400"
        assert results[1:] == [text(A[i : i + 1] + B[i : i + 1]).tolist() for i in range(1, 4)]


def test_json_cannot_carry_bytes_that_are_not_utf8(servers):
    """Triton writes such bytes into its JSON as they are, which no JSON parser reads; the KServe server
    answers 400 and says how to get them (as binary data)."""
    data = np.array([[b"ok", NOT_UTF8]], dtype=object)
    blob = serialize_byte_tensor(data).item()
    header = b'{"inputs":[{"name":"INPUT0","shape":[1,2],"datatype":"BYTES","parameters":{"binary_data_size":%d}}]}' % len(blob)
    response = requests.post(
        f"{servers['kserve-ascend'].url}/v2/models/identity_bytes/infer", data=header + blob,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 400
    assert response.json()["error"] == (
        "output 'OUTPUT0' element 1 is not UTF-8 text, which JSON cannot carry: request the output as binary data"
        " (parameters binary_data: true)"
    )

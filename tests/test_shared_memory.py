"""Triton's system shared memory extension on the KServe server, driven by tritonclient as Triton's examples do.

The flows follow Triton's simple_http_shm_client.py and simple_grpc_shm_client.py; the
error cases answer 400 / INVALID_ARGUMENT with a message naming the region or tensor, and
the server goes on serving.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time

import grpc as grpclib
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, triton_to_np_dtype

from conftest import ROOT, copy_model, start_server, stop_server, wait_for

CONFORMANCE = ROOT / "conformance" / "models"
#: Keys unique to this test process, so parallel runs never share a shared memory object.
PREFIX = f"kserve_ascend_test_{os.getpid()}"
SLOW_MS = 600

INPUT0 = np.arange(16, dtype=np.int32).reshape(1, 16)
INPUT1 = np.ones((1, 16), dtype=np.int32)
TENSOR = INPUT0.nbytes  # 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server on `simple`, a BYTES identity and a slow INT32 identity (to unregister during inference)."""
    repository = tmp_path_factory.mktemp("shm_models")
    copy_model("simple", repository)
    shutil.copytree(CONFORMANCE / "identity_bytes", repository / "identity_bytes")
    slow = repository / "slow"
    shutil.copytree(CONFORMANCE / "identity_int32", slow)
    config = (slow / "config.pbtxt").read_text().replace('name: "identity_int32"', 'name: "slow"')
    config += f'parameters {{ key: "sim_fixed_ms" value: {{ string_value: "{SLOW_MS}" }} }}\n'
    (slow / "config.pbtxt").write_text(config)
    srv = start_server(repository, tmp_path_factory.mktemp("shm_logs") / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture
def http(server):
    with httpclient.InferenceServerClient(server.http) as client:
        yield client
        client.unregister_system_shared_memory()  # each case starts with no region registered


@pytest.fixture
def grpc(server):
    with grpcclient.InferenceServerClient(server.grpc) as client:
        yield client
        client.unregister_system_shared_memory()


@contextlib.contextmanager
def region(name: str, byte_size: int):
    """A fresh POSIX shared memory object, made and destroyed by tritonclient; yields (handle, key)."""
    key = f"/{PREFIX}_{name}"
    handle = shm.create_shared_memory_region(name, key, byte_size, create_only=True)
    try:
        yield handle, key
    finally:
        shm.destroy_shared_memory_region(handle)


def mapped(server, key: str) -> bool:
    """Whether the server process has the shared memory object mapped."""
    with open(f"/proc/{server.process.pid}/maps") as maps:
        return f"/dev/shm{key}" in maps.read()


def assert_released(server, key: str, model: str = "simple") -> None:
    """The server unmaps an unregistered region once nothing holds tensors over it.

    The core's scheduler keeps the last batch a model ran until its next one, so one more
    request to that model comes first.
    """
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}]}
    if model == "simple":
        assert_serves(server)
    else:
        assert requests.post(f"{server.url}/v2/models/{model}/infer", json=body).status_code == 200
    wait_for(lambda: not mapped(server, key), f"the server to unmap {key}", timeout=5, server=server)


def assert_serves(server):
    body = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": INPUT0.ravel().tolist()},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": INPUT1.ravel().tolist()},
        ]
    }
    response = requests.post(f"{server.url}/v2/models/simple/infer", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == (INPUT0 + INPUT1).ravel().tolist()


def test_extension_is_declared_and_cuda_is_not(http, grpc):
    extensions = http.get_server_metadata()["extensions"]
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions
    assert list(grpc.get_server_metadata().extensions) == extensions


@pytest.mark.parametrize("client_kind", ["http", "grpc"])
def test_triton_simple_shm_client_flow(server, client_kind, request):
    """simple_{http,grpc}_shm_client.py: inputs and outputs in shared memory, then status and unregister."""
    client = request.getfixturevalue(client_kind)
    module = httpclient if client_kind == "http" else grpcclient
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()  # the examples clear CUDA regions too: none can exist here
    with region("output_data", 2 * TENSOR) as (out_handle, out_key), region("input_data", 2 * TENSOR) as (in_handle, in_key):
        client.register_system_shared_memory("output_data", out_key, 2 * TENSOR)
        shm.set_shared_memory_region(in_handle, [INPUT0])
        shm.set_shared_memory_region(in_handle, [INPUT1], offset=TENSOR)
        client.register_system_shared_memory("input_data", in_key, 2 * TENSOR)

        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("input_data", TENSOR)
        inputs[1].set_shared_memory("input_data", TENSOR, offset=TENSOR)
        extra = {"binary_data": True} if client_kind == "http" else {}
        outputs = [module.InferRequestedOutput("OUTPUT0", **extra), module.InferRequestedOutput("OUTPUT1", **extra)]
        outputs[0].set_shared_memory("output_data", TENSOR)
        outputs[1].set_shared_memory("output_data", TENSOR, offset=TENSOR)
        result = client.infer("simple", inputs, outputs=outputs)

        read = {}
        for index, name in enumerate(("OUTPUT0", "OUTPUT1")):
            output = result.get_output(name)
            # As Triton answers (test_perf_analyzer.py compares): the output's name, datatype and shape only.
            if client_kind == "http":
                assert set(output) == {"name", "datatype", "shape"}
                datatype, shape = output["datatype"], output["shape"]
            else:
                assert not output.parameters and result.get_response().raw_output_contents[index] == b""
                datatype, shape = output.datatype, list(output.shape)
            read[name] = shm.get_contents_as_numpy(out_handle, triton_to_np_dtype(datatype), shape, offset=index * TENSOR)
        np.testing.assert_array_equal(read["OUTPUT0"], INPUT0 + INPUT1)
        np.testing.assert_array_equal(read["OUTPUT1"], INPUT0 - INPUT1)

        status = client.get_system_shared_memory_status()
        if client_kind == "grpc":
            status = [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in status.regions.values()]
        assert sorted(status, key=lambda r: r["name"]) == [
            {"name": "input_data", "key": in_key, "offset": 0, "byte_size": 2 * TENSOR},
            {"name": "output_data", "key": out_key, "offset": 0, "byte_size": 2 * TENSOR},
        ]
        assert mapped(server, in_key) and mapped(server, out_key)
        client.unregister_system_shared_memory()
        assert not mapped(server, out_key)  # unmapped at once: no request holds the outputs' memory
        assert_released(server, in_key)
        empty = client.get_system_shared_memory_status()
        assert (empty if client_kind == "http" else list(empty.regions)) == []


def test_shm_tensors_mix_with_in_band_tensors(http, grpc):
    """Some tensors in shared memory, others in the body: gRPC raw contents pair with the in-band inputs in order."""
    with region("mixed", 2 * TENSOR) as (handle, key):
        shm.set_shared_memory_region(handle, [INPUT1])
        http.register_system_shared_memory("mixed", key, 2 * TENSOR)

        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(INPUT0, binary_data=False)
        inputs[1].set_shared_memory("mixed", TENSOR)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
        outputs[0].set_shared_memory("mixed", TENSOR, offset=TENSOR)
        result = http.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=TENSOR), INPUT0 + INPUT1)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), INPUT0 - INPUT1)

        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("mixed", TENSOR)  # INPUT0 is now the one in shared memory
        inputs[1].set_data_from_numpy(INPUT0)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[1].set_shared_memory("mixed", TENSOR, offset=TENSOR)
        result = grpc.infer("simple", inputs, outputs=outputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), INPUT1 + INPUT0)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=TENSOR), INPUT1 - INPUT0)


def test_bytes_tensors_through_shared_memory(http, grpc):
    strings = np.array([[b"kserve", b"", "ascend \u00e9".encode()]], dtype=object)
    blob = serialize_byte_tensor(strings)  # length-prefixed, as tritonclient puts BYTES in shared memory
    size = len(blob.item())
    with region("bytes", 2 * size) as (handle, key):
        shm.set_shared_memory_region(handle, [blob])
        grpc.register_system_shared_memory("bytes", key, 2 * size)
        for module, client in ((httpclient, http), (grpcclient, grpc)):
            tensor = module.InferInput("INPUT0", [1, 3], "BYTES")
            tensor.set_shared_memory("bytes", size)
            output = module.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory("bytes", size, offset=size)
            client.infer("identity_bytes", [tensor], outputs=[output])
            np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.object_, [1, 3], offset=size), strings)


def test_region_at_an_unaligned_offset_of_its_object(http):
    """A region may start anywhere in its object (mmap itself needs page-aligned offsets)."""
    offset = 4096 + 100
    with region("unaligned", offset + 3 * TENSOR) as (handle, key):
        shm.set_shared_memory_region(handle, [INPUT0, INPUT1], offset=offset)
        http.register_system_shared_memory("unaligned", key, 3 * TENSOR, offset=offset)
        assert http.get_system_shared_memory_status("unaligned") == [
            {"name": "unaligned", "key": key, "offset": offset, "byte_size": 3 * TENSOR}
        ]
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("unaligned", TENSOR)
        inputs[1].set_shared_memory("unaligned", TENSOR, offset=TENSOR)
        output = httpclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("unaligned", TENSOR, offset=2 * TENSOR)
        http.infer("simple", inputs, outputs=[output])
        result = shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=offset + 2 * TENSOR)
        np.testing.assert_array_equal(result, INPUT0 + INPUT1)


REGISTER_CASES = {
    "nonexistent key": (lambda key: {"key": f"{key}_missing", "offset": 0, "byte_size": 64}, "No such file or directory"),
    "byte size beyond the object": (lambda key: {"key": key, "offset": 0, "byte_size": 4 * TENSOR}, "is beyond the 128 bytes"),
    "offset past the end": (lambda key: {"key": key, "offset": 2 * TENSOR, "byte_size": 1}, "is beyond the 128 bytes"),
    "zero byte size": (lambda key: {"key": key, "offset": 0, "byte_size": 0}, "'byte_size' of shared memory region 'r' must be a positive integer"),
    "negative offset": (lambda key: {"key": key, "offset": -1, "byte_size": 8}, "'offset' of shared memory region 'r' must be a non-negative"),
    "no byte size": (lambda key: {"key": key}, "must be a positive integer, got None"),
    "key outside /dev/shm": (lambda key: {"key": "/../etc/passwd", "offset": 0, "byte_size": 8}, "must name a POSIX shared memory object"),
    "key not a string": (lambda key: {"key": 7, "offset": 0, "byte_size": 8}, "must name a POSIX shared memory object"),
}


@pytest.mark.parametrize("case", REGISTER_CASES)
def test_bad_register_is_400(server, http, case):
    body, message = REGISTER_CASES[case]
    with region("register", 2 * TENSOR) as (_, key):
        response = requests.post(f"{server.url}/v2/systemsharedmemory/region/r/register", json=body(key))
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]
        assert http.get_system_shared_memory_status() == []
    assert_serves(server)


def test_bad_register_over_grpc_and_duplicates(server, http, grpc):
    with region("dup", 2 * TENSOR) as (_, key):
        grpc.register_system_shared_memory("dup", key, TENSOR)
        for client in (http, grpc):
            with pytest.raises(InferenceServerException, match="shared memory region 'dup' already in manager") as error:
                client.register_system_shared_memory("dup", key, TENSOR)
            assert error.value.status() in ("400", str(grpclib.StatusCode.INVALID_ARGUMENT))
        for key_, size, message in ((f"{key}_missing", 8, "cannot open shared memory object"), (key, 4 * TENSOR, "is beyond")):
            with pytest.raises(InferenceServerException, match=message) as error:
                grpc.register_system_shared_memory("other", key_, size)
            assert error.value.status() == str(grpclib.StatusCode.INVALID_ARGUMENT)
        assert [r["name"] for r in http.get_system_shared_memory_status()] == ["dup"]
    assert_serves(server)


def shm_input(name: str, region_name: str, byte_size: int, offset: int = 0) -> dict:
    parameters = {"shared_memory_region": region_name, "shared_memory_byte_size": byte_size}
    if offset:
        parameters["shared_memory_offset"] = offset
    return {"name": name, "shape": [1, 16], "datatype": "INT32", "parameters": parameters}


GOOD_INPUT1 = {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": INPUT1.ravel().tolist()}
INFER_CASES = {
    "unknown region": ([shm_input("INPUT0", "nope", TENSOR), GOOD_INPUT1], [],
                       "input 'INPUT0' names shared memory region 'nope', which is not registered"),
    "offset past the end": ([shm_input("INPUT0", "infer", TENSOR, offset=2 * TENSOR), GOOD_INPUT1], [],
                            "input 'INPUT0' spans bytes 128..192 of shared memory region 'infer', which has 128"),
    "byte size mismatch": ([shm_input("INPUT0", "infer", TENSOR // 2), GOOD_INPUT1], [],
                           "input 'INPUT0' has 32 bytes of shared memory but shape [1, 16] of INT32 needs 64"),
    "region without byte size": ([dict(shm_input("INPUT0", "infer", 0), parameters={"shared_memory_region": "infer"}), GOOD_INPUT1], [],
                                 "has no 'shared_memory_byte_size'"),
    "data besides shared memory": ([dict(shm_input("INPUT0", "infer", TENSOR), data=[0] * 16), GOOD_INPUT1], [],
                                   "is in shared memory and must not also have 'data'"),
    "output too small": ([shm_input("INPUT0", "infer", TENSOR), GOOD_INPUT1],
                         [{"name": "OUTPUT0", "parameters": {"shared_memory_region": "infer", "shared_memory_byte_size": 8}}],
                         "output 'OUTPUT0' needs 64 bytes but its 'shared_memory_byte_size' in region 'infer' is 8"),
    "output past the end": ([shm_input("INPUT0", "infer", TENSOR), GOOD_INPUT1],
                            [{"name": "OUTPUT0", "parameters": {"shared_memory_region": "infer", "shared_memory_byte_size": 64,
                                                                "shared_memory_offset": 100}}],
                            "output 'OUTPUT0' spans bytes 100..164"),
}


@pytest.mark.parametrize("case", INFER_CASES)
def test_bad_shared_memory_tensor_is_400(server, http, case):
    inputs, outputs, message = INFER_CASES[case]
    with region("infer", 2 * TENSOR) as (handle, key):
        shm.set_shared_memory_region(handle, [INPUT0])
        http.register_system_shared_memory("infer", key, 2 * TENSOR)
        response = requests.post(f"{server.url}/v2/models/simple/infer", json={"inputs": inputs, "outputs": outputs})
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]
    assert_serves(server)


def test_bad_shared_memory_tensor_over_grpc(server, grpc):
    with region("ginfer", 2 * TENSOR) as (_, key):
        grpc.register_system_shared_memory("ginfer", key, 2 * TENSOR)
        for region_name, size, offset, message in (
            ("nope", TENSOR, 0, "names shared memory region 'nope', which is not registered"),
            ("ginfer", TENSOR, 2 * TENSOR, "spans bytes 128..192"),
            ("ginfer", TENSOR - 4, 0, "has 60 bytes of shared memory but shape [1, 16] of INT32 needs 64"),
        ):
            inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_shared_memory(region_name, size, offset=offset)
            inputs[1].set_data_from_numpy(INPUT1)
            with pytest.raises(InferenceServerException) as error:
                grpc.infer("simple", inputs)
            assert error.value.status() == str(grpclib.StatusCode.INVALID_ARGUMENT)
            assert message in error.value.message()
    assert_serves(server)


def test_status_and_unregister_of_one_region(server, http, grpc):
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'nope'") as error:
        http.get_system_shared_memory_status("nope")
    assert error.value.status() == "400"
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'nope'"):
        grpc.get_system_shared_memory_status("nope")
    http.unregister_system_shared_memory("nope")  # as in Triton, unregistering an unknown region is no error
    grpc.unregister_system_shared_memory("nope")
    with region("a", TENSOR) as (_, key_a), region("b", TENSOR) as (_, key_b):
        http.register_system_shared_memory("a", key_a, TENSOR)
        http.register_system_shared_memory("b", key_b, TENSOR)
        grpc.unregister_system_shared_memory("a")
        assert [r["name"] for r in http.get_system_shared_memory_status()] == ["b"]
        assert not mapped(server, key_a) and mapped(server, key_b)  # no request used them: unmapped at once
        tensor = httpclient.InferInput("INPUT0", [1, 16], "INT32").set_shared_memory("a", TENSOR)
        other = httpclient.InferInput("INPUT1", [1, 16], "INT32")
        other.set_data_from_numpy(INPUT1)
        with pytest.raises(InferenceServerException, match="region 'a', which is not registered"):
            http.infer("simple", [tensor, other])
        http.register_system_shared_memory("a", key_a, TENSOR)  # the name is free again
        assert sorted(r["name"] for r in http.get_system_shared_memory_status()) == ["a", "b"]


@pytest.mark.serial  # the inference is to be running 200 ms after it was sent, and unregistering to answer within 600 ms
def test_unregister_during_inference_waits_for_it(server, http):
    """Unregistering a region an inference is using answers at once; the mapping goes when the inference ends."""
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    with region("busy", 2 * TENSOR) as (handle, key):
        shm.set_shared_memory_region(handle, [data])
        http.register_system_shared_memory("busy", key, 2 * TENSOR)
        body = {
            "inputs": [shm_input("INPUT0", "busy", TENSOR)],
            "outputs": [{"name": "OUTPUT0", "parameters": shm_input("OUTPUT0", "busy", TENSOR, offset=TENSOR)["parameters"]}],
        }
        responses = []
        started = time.monotonic()
        # requests, not tritonclient's gevent-based HTTP client, which is bound to its thread.
        worker = threading.Thread(target=lambda: responses.append(requests.post(f"{server.url}/v2/models/slow/infer", json=body)))
        worker.start()
        time.sleep(SLOW_MS / 3000)  # the request is decoded and running
        http.unregister_system_shared_memory("busy")
        assert http.get_system_shared_memory_status() == []
        assert time.monotonic() - started < SLOW_MS / 1000, "unregister waited for the inference"
        assert mapped(server, key)  # still in use
        worker.join()
        assert responses[0].status_code == 200, responses[0].text
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=TENSOR), data)
        assert_released(server, key, "slow")
    assert "Traceback" not in server.output()

"""Device faults under load, through the FAKE pyACL module (tests/fake_acl/acl.py) in real server processes.

- an execution error (ACL_ERROR_RT_MODEL_EXECUTE 507011, reported by the stream's synchronize) -> 500
  `{"error"}` naming the call and code for the requests of that batch only; both instances stay in rotation
- a fatal device error on one of two instances (an AI Core exception, 507015) -> 500 for that batch; the
  instance leaves rotation and the other serves every later request; the model stays ready
- an execution error in a sequence's request -> that request fails (500); the sequence goes on, in its slot

Faults are armed by writing the fake's control file (FAKE_ACL_FAULTS) while the server runs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from conftest import (
    json_body,
    load_fake_acl,
    post_infer,
    scrape,
    start_on_fake_acl,
    stop_server,
    write_faults,
)

fake_acl = load_fake_acl()  # only to write .om descriptors; the servers import their own as `acl`
MODEL_EXECUTE = 507011  # ACL_ERROR_RT_MODEL_EXECUTE, rt_error_codes.h: a failed execution, the context usable
AI_CORE_EXCEPTION = 507015  # ACL_ERROR_RT_AICORE_EXCEPTION: fatal, the instance leaves rotation
CLIENTS, REQUESTS_EACH = 8, 12

PAIR = """name: "pair"
backend: "ascend"
max_batch_size: 4
input [ { name: "images" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "images_out" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 2 } ]
parameters { key: "device_ids" value: { string_value: "0,1" } }
"""
SEQUENCE = """name: "seq"
backend: "ascend"
max_batch_size: 1
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "device_ids" value: { string_value: "2" } }
"""


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_device_repo")
    (root / "pair" / "1").mkdir(parents=True)
    fake_acl.fake_write_om(root / "pair" / "1" / "model.om", [("images", fake_acl.ACL_FLOAT, [-1, 4])], dynamic_batch=[1, 2, 4])
    (root / "pair" / "config.pbtxt").write_text(PAIR)
    (root / "seq" / "1").mkdir(parents=True)
    int32 = fake_acl.ACL_INT32
    fake_acl.fake_write_om(  # output i copies input i: OUTPUT = INPUT
        root / "seq" / "1" / "model.om",
        [("INPUT", int32, [1, 1]), ("START", int32, [1, 1]), ("READY", int32, [1, 1])],
        [("OUTPUT", int32, [1, 1]), ("START_out", int32, [1, 1]), ("READY_out", int32, [1, 1])],
    )
    (root / "seq" / "config.pbtxt").write_text(SEQUENCE)
    server = start_on_fake_acl(
        root, f"faults_device_{request.param}", "--model_control_mode", "explicit",
        "--load_model", "pair", "--load_model", "seq", workers=request.param,
    )
    yield server
    stop_server(server)


def under_load(server) -> list[tuple[float, requests.Response]]:
    """CLIENTS clients, each sending REQUESTS_EACH requests one after another, each request its own value."""
    def client(index):
        values = [index * 100.0 + i for i in range(REQUESTS_EACH)]
        return [(v, post_infer(server, "pair", json_body({"images": np.full((1, 4), v, np.float32)}))) for v in values]

    with ThreadPoolExecutor(CLIENTS) as pool:
        return [answer for answers in pool.map(client, range(CLIENTS)) for answer in answers]


def failed_with(answers, code: int) -> int:
    """How many requests failed; each failure a 500 naming the code, each success its own rows."""
    failed = 0
    for value, answer in answers:
        if answer.status_code == 200:
            assert answer.json()["outputs"][0]["data"] == [value] * 4
        else:
            assert answer.status_code == 500 and f"failed with return code {code}" in answer.json()["error"], answer.text
            failed += 1
    return failed


def healthy(server) -> dict[str, float]:
    return scrape(server).by("device", "ascend_instance_healthy", model="pair")


def test_an_execution_error_fails_only_its_batch_and_both_instances_serve_on(server):
    write_faults(server.faults, [{"call": "acl.mdl.execute_async", "ret": MODEL_EXECUTE, "times": 1, "after": 5}])
    failed = failed_with(under_load(server), MODEL_EXECUTE)
    assert 1 <= failed <= 4  # the requests of one batch (max_batch_size 4)
    assert healthy(server) == {"0": 1, "1": 1}
    assert failed_with(under_load(server), MODEL_EXECUTE) == 0


def test_a_fatal_error_on_one_instance_leaves_the_other_serving(server):
    write_faults(server.faults, [{"call": "acl.mdl.execute_async", "ret": AI_CORE_EXCEPTION, "times": 1, "device": 1}])
    failed = failed_with(under_load(server), AI_CORE_EXCEPTION)
    assert 1 <= failed <= 4
    assert healthy(server) == {"0": 1, "1": 0}
    assert requests.get(f"{server.url}/v2/models/pair/ready", timeout=10).status_code == 200
    assert failed_with(under_load(server), AI_CORE_EXCEPTION) == 0  # instance 0 serves them all
    assert requests.post(f"{server.url}/v2/repository/models/pair/load", timeout=60).status_code == 200  # fresh instances
    assert healthy(server) == {"0": 1, "1": 1}


def sequence_request(server, value: int, **flags) -> requests.Response:
    body = {
        "parameters": {"sequence_id": 42, **flags},
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}],
    }
    return post_infer(server, "seq", body)


def test_an_execution_error_in_a_sequence_fails_that_request_and_the_sequence_goes_on(server):
    assert sequence_request(server, 11, sequence_start=True).json()["outputs"][0]["data"] == [11]
    write_faults(server.faults, [{"call": "acl.mdl.execute_async", "ret": MODEL_EXECUTE, "times": 1, "device": 2}])
    failed = sequence_request(server, 13)
    assert failed.status_code == 500 and f"failed with return code {MODEL_EXECUTE}" in failed.json()["error"]
    assert sequence_request(server, 17).json()["outputs"][0]["data"] == [17]
    assert sequence_request(server, 19, sequence_end=True).json()["outputs"][0]["data"] == [19]

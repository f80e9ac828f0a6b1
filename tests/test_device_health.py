"""Device health in the KServe server: a device fault or a hung execution takes its instance out of
rotation, the model's other instances serve on, a model with none left is not ready and says why,
and a reload brings fresh instances. Neither unloading nor stopping waits for a hung thread.

Faults come from the FAKE pyACL module's control file (FAKE_ACL_FAULTS), written while the
real server runs: an AI Core exception (507015), an execution that never finishes.
"""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import pytest
import requests
from conftest import (
    copy_model,
    json_body,
    load_fake_acl,
    post_infer,
    scrape,
    start_on_fake_acl,
    stop_server,
    write_faults,
)

ACL_FLOAT = 0
AI_CORE_EXCEPTION = 507015  # ACL_ERROR_RT_AICORE_EXCEPTION, rt_error_codes.h

MODELS = {
    # Two instances, one on each of NPUs 0 and 1.
    "pair": 'instance_group [ { count: 2 } ]\nparameters { key: "device_ids" value: { string_value: "0,1" } }\n',
    # One instance on NPU 2 / 3, with a small execution timeout.
    "hung_call": 'parameters { key: "device_ids" value: { string_value: "2" } }\n'
    'parameters { key: "execution_timeout_ms" value: { string_value: "300" } }\n',
    "hung_execute": 'parameters { key: "device_ids" value: { string_value: "3" } }\n'
    'parameters { key: "execution_timeout_ms" value: { string_value: "300" } }\n',
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    fake_acl = load_fake_acl()
    root = tmp_path_factory.mktemp("health_repo")
    for name, extra in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        fake_acl.fake_write_om(root / name / "1" / "model.om", [("images", ACL_FLOAT, [1, 4])])
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: 1\n{extra}')
    copy_model("simple", root)
    startup = [arg for name in (*MODELS, "simple") for arg in ("--load_model", name)]
    server = start_on_fake_acl(root, "health", "--model_control_mode", "explicit", *startup)
    yield server
    stop_server(server)


#: The input of every model here.
IMAGES = json_body({"images": np.array([[1, 2, 3, 4]], np.float32)})


def healthy(server, model: str) -> dict[str, float]:
    return scrape(server).by("device", "ascend_instance_healthy", model=model)


def reason_in_index(server, model: str) -> str:
    (entry,) = [e for e in requests.post(f"{server.url}/v2/repository/index", timeout=10).json() if e["name"] == model]
    assert entry["state"] == "UNAVAILABLE"
    return entry["reason"]


def test_an_ai_core_error_takes_one_instance_out_the_other_serves_then_none_left_is_not_ready(server):
    assert healthy(server, "pair") == {"0": 1, "1": 1}
    write_faults(server.faults, [{"call": "acl.mdl.execute_async", "ret": AI_CORE_EXCEPTION, "times": 1, "device": 1}])
    answers = [post_infer(server, "pair", IMAGES) for _ in range(4)]  # in turn on each instance
    failed = [a for a in answers if a.status_code != 200]
    assert len(failed) == 1 and failed[0].status_code == 500 and str(AI_CORE_EXCEPTION) in failed[0].json()["error"]
    assert healthy(server, "pair") == {"0": 1, "1": 0}
    assert all(post_infer(server, "pair", IMAGES).status_code == 200 for _ in range(4))  # the other instance serves every request
    assert requests.get(f"{server.url}/v2/models/pair/ready", timeout=10).status_code == 200

    write_faults(server.faults, [{"call": "acl.mdl.execute_async", "ret": AI_CORE_EXCEPTION, "times": 1, "device": 0}])
    assert post_infer(server, "pair", IMAGES).status_code == 500
    assert healthy(server, "pair") == {"0": 0, "1": 0}
    ready = requests.get(f"{server.url}/v2/models/pair/ready", timeout=10)
    assert ready.status_code == 400 and "version 1: no instance is healthy: instance 0:" in ready.json()["error"]
    assert "instance 1:" in reason_in_index(server, "pair") and str(AI_CORE_EXCEPTION) in reason_in_index(server, "pair")
    assert requests.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 400
    answer = post_infer(server, "pair", IMAGES)
    assert answer.status_code == 400 and "no instance is healthy" in answer.json()["error"]

    assert requests.post(f"{server.url}/v2/repository/models/pair/load", timeout=60).status_code == 200  # fresh instances
    assert healthy(server, "pair") == {"0": 1, "1": 1}
    assert all(post_infer(server, "pair", IMAGES).status_code == 200 for _ in range(4))


def test_an_execution_that_never_finishes_fails_at_the_runtime_timeout_and_reload_restores(server):
    # The task never finishes: the runtime's own wait for its stream times out (507046), a fatal device error.
    write_faults(server.faults, [{"call": "acl.mdl.execute_async", "hang": True, "device": 3}])
    answer = post_infer(server, "hung_execute", IMAGES)
    assert answer.status_code == 500 and "execution_timeout_ms" in answer.json()["error"]
    assert "no instance is healthy" in reason_in_index(server, "hung_execute")
    assert requests.post(f"{server.url}/v2/repository/models/hung_execute/load", timeout=60).status_code == 200
    assert post_infer(server, "hung_execute", IMAGES).status_code == 200


def test_a_call_that_never_returns_fails_at_the_schedulers_timeout_and_blocks_neither_unload_nor_reload(server):
    # A blocking call hangs the instance's thread itself: only the scheduler's timeout can answer.
    write_faults(server.faults, [{"call": "acl.rt.set_context", "hang": True, "device": 2}])
    answer = post_infer(server, "hung_call", IMAGES)
    assert answer.status_code == 500
    assert answer.json()["error"] == (
        "the execution did not finish within execution_timeout_ms 300: instance 0 is out of rotation until the model is reloaded"
    )
    assert healthy(server, "hung_call") == {"2": 0}
    assert "no instance is healthy" in requests.get(f"{server.url}/v2/models/hung_call/ready", timeout=10).json()["error"]
    assert requests.post(f"{server.url}/v2/repository/models/hung_call/unload", timeout=30).status_code == 200
    assert requests.post(f"{server.url}/v2/repository/models/hung_call/load", timeout=60).status_code == 200
    assert post_infer(server, "hung_call", IMAGES).status_code == 200
    # Hang the new instance too, and leave it hung for the shutdown below.
    write_faults(server.faults, [{"call": "acl.rt.set_context", "hang": True, "device": 2}])
    assert post_infer(server, "hung_call", IMAGES).status_code == 500


def test_a_degraded_runtime_shows_in_its_gauge(server):
    # With `execution_provider: auto` ONNX Runtime serves on the CPU where the CANN provider cannot
    # run (this host): degraded, as the metadata says. An .om on the acl runtime never is.
    degraded = requests.get(f"{server.url}/v2/models/simple", timeout=10).json()["parameters"].get("degraded") == "true"
    metrics = scrape(server)
    assert metrics.by("device", "ascend_runtime_degraded", model="simple") == {"0": 1 if degraded else 0}
    assert metrics.by("device", "ascend_runtime_degraded", model="pair") == {"0": 0, "1": 0}


def test_the_server_stops_on_sigterm_with_instance_threads_hung(server):
    server.process.send_signal(signal.SIGTERM)
    try:
        assert server.process.wait(timeout=20) == 0
    except subprocess.TimeoutExpired:
        stop_server(server)
        pytest.fail("a hung instance thread held the server after SIGTERM")
    assert "Traceback" not in server.output()

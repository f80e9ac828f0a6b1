"""NPU temperature, power and health on /metrics, read through the driver's DCMI library at scrape.

Real servers (one process, and --workers 2) load the FAKE libdcmi.so (tests/fake_dcmi/dcmi.c,
compiled here with gcc and found on LD_LIBRARY_PATH as the driver's would be) through ctypes, as
they load the real one; the fake reads its machine from a file at every call, so a test changes
the readings, or makes one call fail with a DCMI code, by rewriting it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import requests

from conftest import (build_fake_dcmi, copy_model, fake_dcmi_env, json_body, post_infer, scrape, start_server, stop_server, wait_for,
                      write_dcmi_state)

TEMPERATURE, POWER, HEALTH = "ascend_npu_temperature_celsius", "ascend_npu_power_watts", "ascend_npu_health"
# Two cards, the second's chip with logic ID 1: the `device` label is the logic ID, not the card.
NPUS = [(0, 0, 0, 45, 823, 0), (3, 0, 1, 61, 1057, 2)]
NOT_SUPPORT = -8255  # DCMI_ERR_CODE_NOT_SUPPORT (DCMI API reference, api_177)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return build_fake_dcmi(tmp_path_factory.mktemp("fake_dcmi"))


def repository(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models")
    copy_model("sim", directory)
    return directory


@pytest.fixture(scope="module", params=[1, 2], ids=["one process", "--workers 2"])
def npu_server(request, library, tmp_path_factory):
    """A server on a machine of two NPUs (the FAKE DCMI's); `server.state` is its machine's file."""
    models = repository(tmp_path_factory)
    state = models.parent / "dcmi_state"
    write_dcmi_state(state, NPUS)
    server = start_server(models, models.parent / "server.log", env=fake_dcmi_env(library, state), workers=request.param)
    server.state = state
    yield server
    stop_server(server)


def readings(server, port=None) -> dict[str, dict[str, float]]:
    metrics = scrape(server, port)
    return {name: metrics.by("device", name) for name in (TEMPERATURE, POWER, HEALTH)}


def test_each_npu_shows_its_temperature_power_and_health_on_both_ports(npu_server):
    write_dcmi_state(npu_server.state, NPUS)
    expected = {TEMPERATURE: {"0": 45, "1": 61}, POWER: {"0": 82.3, "1": 105.7}, HEALTH: {"0": 0, "1": 2}}
    assert readings(npu_server) == expected  # --metrics_port
    assert readings(npu_server, npu_server.http_port) == expected
    assert "NPU telemetry: 2 NPU(s) through DCMI" in npu_server.output()


def test_the_readings_follow_the_device(npu_server):
    write_dcmi_state(npu_server.state, [(0, 0, 0, 88, 0, 3), NPUS[1]])
    assert readings(npu_server) == {TEMPERATURE: {"0": 88, "1": 61}, POWER: {"0": 0, "1": 105.7}, HEALTH: {"0": 3, "1": 2}}


def test_a_failing_call_leaves_its_sample_out_logged_once_and_the_scrape_answers(npu_server):
    write_dcmi_state(npu_server.state, [NPUS[0], (3, 0, 1, 61, 1057, 0xFFFFFFFF)],
                     errors=[("dcmi_get_device_power_info", 0, 0, NOT_SUPPORT)])
    for _ in range(3):
        assert readings(npu_server) == {TEMPERATURE: {"0": 45, "1": 61}, POWER: {"1": 105.7}, HEALTH: {"0": 0}}
        assert "nv_inference_request_success" in scrape(npu_server).families  # the rest of the scrape
    log = npu_server.output()
    assert log.count("dcmi_get_device_power_info returned -8255 (DCMI_ERR_CODE_NOT_SUPPORT)") == 1, log
    assert log.count("dcmi_get_device_health answered 0xffffffff") == 1, log
    write_dcmi_state(npu_server.state, NPUS)
    assert readings(npu_server)[POWER] == {"0": 82.3, "1": 105.7}  # back once the call answers


def test_a_scrape_waiting_on_the_driver_holds_no_request_up(npu_server):
    """The fake's temperature call waits until released: meanwhile the server (its event loop, the
    engine's with --workers) answers an inference; then the scrape ends with every reading."""
    held = npu_server.state.with_name(npu_server.state.name + ".held")
    held.unlink(missing_ok=True)
    write_dcmi_state(npu_server.state, NPUS, holds=["dcmi_get_device_temperature"])
    scraped = {}
    scraping = threading.Thread(target=lambda: scraped.update(readings(npu_server, npu_server.http_port)))
    scraping.start()
    try:
        wait_for(held.exists, "the scrape to wait in dcmi_get_device_temperature")
        answer = post_infer(npu_server, "sim", json_body({"INPUT0": np.ones((1, 4), np.float32)}), timeout=10)
        assert answer.status_code == 200, answer.text
    finally:
        write_dcmi_state(npu_server.state, NPUS)
        scraping.join(timeout=30)
    assert scraped[TEMPERATURE] == {"0": 45, "1": 61}


@pytest.mark.parametrize("workers", [1, 2], ids=["one process", "--workers 2"])
def test_without_the_library_there_are_no_npu_metrics_and_the_log_says_why(tmp_path_factory, workers):
    models = repository(tmp_path_factory)
    server = start_server(models, models.parent / "server.log", workers=workers)
    try:
        for port in (server.metrics_port, server.http_port):
            metrics = scrape(server, port)
            assert "nv_inference_request_success" in metrics.families
            assert not {TEMPERATURE, POWER, HEALTH} & set(metrics.families)
    finally:
        stop_server(server)
    log = server.output()
    assert log.count("NPU telemetry off: the Ascend driver's libdcmi.so is neither on the loader path nor in"
                     " /usr/local/Ascend/driver/lib64/driver") == 1, log


def test_a_failing_dcmi_init_turns_the_telemetry_off_saying_so(library, tmp_path_factory):
    models = repository(tmp_path_factory)
    state = models.parent / "dcmi_state"
    write_dcmi_state(state, NPUS, errors=[("dcmi_init", -1, -1, -8005)])
    server = start_server(models, models.parent / "server.log", env=fake_dcmi_env(library, state))
    try:
        assert not {TEMPERATURE, POWER, HEALTH} & set(scrape(server).families)
        assert requests.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200
    finally:
        stop_server(server)
    assert "NPU telemetry off: dcmi_init returned -8005 (DCMI_ERR_CODE_INNER_ERR)" in server.output()


def test_a_library_that_does_not_load_is_named_with_the_loaders_reason(tmp_path):
    """A libdcmi.so on the loader path that needs a library the process cannot find (the driver's
    other libraries off LD_LIBRARY_PATH, say): the reason names both, not "no libdcmi.so"."""
    (tmp_path / "needed.c").write_text("int needed(void) { return 0; }\n")
    (tmp_path / "dcmi.c").write_text("int needed(void);\nint dcmi_init(void) { return needed(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libneeded.so"), str(tmp_path / "needed.c")], check=True, timeout=60)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libdcmi.so"), str(tmp_path / "dcmi.c"),
                    f"-L{tmp_path}", "-lneeded"], check=True, timeout=60)
    (tmp_path / "libneeded.so").unlink()
    code = "from kserve_ascend.server.observability import npu_telemetry; print(npu_telemetry.load_library())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path)})
    assert done.stdout.strip() == "libdcmi.so does not load: libneeded.so: cannot open shared object file: No such file or directory"


def test_the_fake_answers_with_the_references_codes(library, tmp_path, monkeypatch):
    """The fake's own conventions (DCMI API reference, api_177): DCMI_OK, -8001 for a null pointer or a
    list too short, -8007 for a chip the machine lacks, -8005 before dcmi_init, and the health code as written."""
    state = tmp_path / "dcmi_state"
    write_dcmi_state(state, [*NPUS, (3, 1, 2, 40, 700, 0xFFFFFFFF)])
    monkeypatch.setenv("FAKE_DCMI_STATE", str(state))
    shutil.copy(library, tmp_path / "libdcmi.so")  # a copy of its own: loaded afresh, not yet initialized
    dcmi = ctypes.CDLL(str(tmp_path / "libdcmi.so"))
    value, health = ctypes.c_int(), ctypes.c_uint()
    assert dcmi.dcmi_get_device_temperature(3, 0, ctypes.byref(value)) == -8005
    assert dcmi.dcmi_init() == 0
    assert dcmi.dcmi_get_device_temperature(3, 0, ctypes.byref(value)) == 0 and value.value == 61
    assert dcmi.dcmi_get_device_power_info(0, 0, ctypes.byref(value)) == 0 and value.value == 823
    assert dcmi.dcmi_get_device_health(3, 1, ctypes.byref(health)) == 0 and health.value == 0xFFFFFFFF
    assert dcmi.dcmi_get_device_num_in_card(3, ctypes.byref(value)) == 0 and value.value == 2
    assert dcmi.dcmi_get_device_logic_id(ctypes.byref(value), 3, 1) == 0 and value.value == 2
    assert dcmi.dcmi_get_device_temperature(0, 0, None) == -8001
    assert dcmi.dcmi_get_device_temperature(1, 0, ctypes.byref(value)) == -8007
    count, cards = ctypes.c_int(), (ctypes.c_int * 2)()
    assert dcmi.dcmi_get_card_list(ctypes.byref(count), cards, 1) == -8001  # two cards, room for one
    assert dcmi.dcmi_get_card_list(ctypes.byref(count), cards, 2) == 0 and list(cards[:count.value]) == [0, 3]

"""The conformance suite proven against real Triton, held against kserve-ascend, and shown to catch faults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests
import yaml

from conftest import ROOT, Server, free_port, start_server, start_triton, stop_server, wait_until

MODELS = ROOT / "conformance" / "models"


def run_suite(target, name: str, report, *pytest_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance", "--http", target.http, "--grpc", target.grpc,
         "--target", name, "--report", str(report), *pytest_args],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )


def outcomes(report, name: str) -> dict[str, str]:
    return json.loads(report.with_suffix(".md.json").read_text())["targets"][name]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return tmp_path_factory.mktemp("conformance") / "report.md"


def run_on(server, name: str, report) -> subprocess.CompletedProcess:
    """Runs the whole suite against a started server, then stops it; the run must pass."""
    try:
        result = run_suite(server, name, report)
    finally:
        stop_server(server)
    assert result.returncode == 0, result.stdout[-5000:]
    return result


def test_suite_passes_on_real_triton_with_only_known_deviations(tmp_path, report):
    # Explicit model control, so the model repository extension (load/unload) is exercised too.
    run_on(start_triton(MODELS, tmp_path, "--model-control-mode=explicit", "--load-model=*"), "triton", report)
    results = outcomes(report, "triton")
    assert "fail" not in results.values()
    # Exactly the deviations listed for Triton are known deviations: each ran and still fails (strict xfail).
    listed = yaml.safe_load((ROOT / "conformance" / "deviations.yaml").read_text())["triton"]
    assert {case for case, outcome in results.items() if outcome == "known deviation"} == set(listed)
    assert results["test_system_shared_memory_inference"] == "pass"


@pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
def test_suite_passes_on_kserve_ascend_with_no_deviation(tmp_path, report, workers):
    """One process, and an engine with two frontends (`--workers 2`) that the suite's connections spread over."""
    server = start_server(MODELS, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "*", workers=workers)
    name = "kserve-ascend" if workers == 1 else f"kserve-ascend --workers {workers}"
    run_on(server, name, report)
    results = outcomes(report, name)
    assert set(results.values()) <= {"pass", "not declared"}
    assert list(results.values()).count("pass") > 90
    assert results["test_system_shared_memory_inference"] == "pass"
    markdown = report.read_text()
    assert "| case | specification |" in markdown and "kserve-ascend" in markdown


def test_suite_catches_a_deliberately_broken_server(tmp_path):
    server = start_server(MODELS, tmp_path / "server.log")
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "broken_oip_server.py"), "--upstream", server.http, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    broken = Server(proxy, port, server.grpc_port, tmp_path / "server.log")
    report = tmp_path / "broken.md"
    try:
        wait_until(broken, lambda: requests.get(f"{broken.url}/v2/health/live", timeout=1).ok, timeout=30)
        result = run_suite(broken, "broken", report)
    finally:
        stop_server(broken)
        stop_server(server)
    assert result.returncode != 0
    results = outcomes(report, "broken")
    for case in (
        "test_rest_client_mistake_is_4xx_with_error_body[unknown_model]",
        "test_rest_client_mistake_is_4xx_with_error_body[wrong_rank]",
        "test_binary_size_beyond_the_body_is_4xx",
        "test_request_id_is_echoed",
        "test_model_metadata_shape",
        "test_metadata_names_each_datatype[FP32]",
    ):
        assert results[case] == "fail", case
    # Behaviour the proxy leaves alone still passes: the failures above are the faults, not noise.
    assert results["test_grpc_raw_contents_round_trip_each_datatype[INT32]"] == "pass"
    assert results["test_json_infer_round_trips_each_datatype[FP64]"] == "pass"

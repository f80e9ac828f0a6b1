"""The response cache (`--cache_config local,size=N`, `response_cache { enable: true }`) against real Triton 2.51
with its own local cache, request for request; the bound and eviction; `--workers 2`; what is refused.

conformance/cases/test_cache.py holds the cases both servers pass; here what needs servers of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import requests

from conftest import ROOT, both_servers, infer_one, scrape, start_server, statistics_counts, stop_server, wait_for
from conformance.harness import CACHE_SIZE
from kserve_ascend.core.cache import entry_size

CONFORMANCE = ROOT / "conformance" / "models"
CACHE = f"local,size={CACHE_SIZE}"


def repository(root, *names: str):
    for name in names:
        shutil.copytree(CONFORMANCE / name, root / name)
    return root


def recorded(server, model: str, successes: int) -> dict[str, int]:
    """The counts once `successes` requests are recorded (Triton records one a moment after its answer)."""
    return wait_for(
        lambda: (now := statistics_counts(server, model))["success"] == successes and now, f"{successes} successes", timeout=10
    )


def hits_and_misses(server, model: str) -> tuple[int, int]:
    now = statistics_counts(server, model)
    return now["cache_hit"], now["cache_miss"]


def fp32(*values: float) -> np.ndarray:
    return np.array([values], np.float32)


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """kserve-ascend and real Triton (its local cache from the nvidia-pytriton wheel) on one repository,
    each with a cache of 1 MiB."""
    models = repository(tmp_path_factory.mktemp("repo"), "cache_identity_fp32", "identity_fp32", "cache_ensemble")
    yield from both_servers(models, tmp_path_factory, f"--cache-config={CACHE}", ours_args=("--cache_config", CACHE))


#: (model, input name, the requests in order): misses, hits over both protocols, a model without the cache.
LOAD = (
    ("cache_identity_fp32", "INPUT0", [(fp32(1, 2), "http"), (fp32(1, 2), "http"), (fp32(1, 2), "grpc"), (fp32(3), "grpc")]),
    ("identity_fp32", "INPUT0", [(fp32(1, 2), "http"), (fp32(1, 2), "grpc")]),
    ("cache_ensemble", "IN", [(fp32(5, 6), "http"), (fp32(5, 6), "grpc")]),
)

SUCCESSES = {"cache_identity_fp32": 4, "identity_fp32": 3, "cache_ensemble": 2}


def test_statistics_and_metrics_equal_tritons_for_the_same_requests(side_by_side):
    """Under Triton the ascend backend's model and the ensemble Triton serves itself are cached by Triton's own
    cache; kserve-ascend counts every field as Triton does: a hit adds success, queue and cache_hit, nothing else."""
    seen = {}
    for name, server in side_by_side.items():
        for model, input_name, calls in LOAD:
            for array, protocol in calls:
                np.testing.assert_array_equal(infer_one(server, model, array, protocol, input_name), array)
        # identity_fp32 also answers the ensemble's step once: its miss
        seen[name] = {model: recorded(server, model, successes) for model, successes in SUCCESSES.items()}
    assert seen["kserve-ascend"] == seen["triton"]
    assert seen["triton"]["cache_identity_fp32"] == {
        "success": 4, "fail": 0, "queue": 4, "compute_input": 2, "compute_infer": 2, "compute_output": 2,
        "cache_hit": 2, "cache_miss": 2, "inference_count": 2, "execution_count": 2,
    }
    # The ensemble, which Triton's core serves itself, counts its hit as Triton counts the ascend backend's.
    assert seen["triton"]["cache_ensemble"] == {
        "success": 2, "fail": 0, "queue": 2, "compute_input": 1, "compute_infer": 1, "compute_output": 1,
        "cache_hit": 1, "cache_miss": 1, "inference_count": 1, "execution_count": 1,
    }
    assert seen["triton"]["identity_fp32"]["execution_count"] == 3  # twice its own, once the ensemble's miss

    def metrics(server) -> dict[str, dict]:
        """Triton's cache metrics by name: each sample's labels and value; durations (microseconds) and the
        utilization by name and labels only. Triton's local cache publishes its gauges at an interval."""
        scraped = wait_for(lambda: (m := scrape(server)).values("nv_cache_num_lookups") == [6.0] and m, "the cache gauges")
        return {
            family.name: {
                tuple(sorted(s.labels.items())): None if "duration" in family.name or "util" in family.name else s.value
                for s in family.samples
            }
            for family in scraped.families.values()
            if family.name.startswith("nv_cache")
        }

    ours, theirs = metrics(side_by_side["kserve-ascend"]), metrics(side_by_side["triton"])
    assert ours == theirs
    assert theirs["nv_cache_num_entries"] == {(): 3.0} and theirs["nv_cache_num_hits"] == {(): 3.0}
    assert set(theirs) == {
        "nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model", "nv_cache_hit_duration_per_model",
        "nv_cache_miss_duration_per_model", "nv_cache_util", "nv_cache_num_entries", "nv_cache_num_lookups",
        "nv_cache_num_hits", "nv_cache_num_misses", "nv_cache_num_evictions", "nv_cache_lookup_duration",
        "nv_cache_insertion_duration",
    }


@pytest.mark.parametrize("workers", [1, 2])
def test_size_bound_evicts_the_least_recently_used(tmp_path, workers):
    """Room for two answers of 100 floats: a third evicts the least recently used; one of 300 is never stored.
    With --workers 2 the engine holds the one cache, whichever frontend a request comes in by."""
    one = entry_size({"OUTPUT0": np.zeros((1, 100), np.float32)})
    server = start_server(
        repository(tmp_path / "repo", "cache_identity_fp32"), tmp_path / "server.log",
        "--cache_config", f"local,size={2 * one + one // 2}", workers=workers,
    )
    try:
        a, b, c = (np.full((1, 100), value, np.float32) for value in (1, 2, 3))
        for array in (a, b, a, c):  # b is the least recently used when c comes
            infer_one(server, "cache_identity_fp32", array, "grpc")
        assert hits_and_misses(server, "cache_identity_fp32") == (1, 3)
        for array in (a, c, b):
            np.testing.assert_array_equal(infer_one(server, "cache_identity_fp32", array), array)
        assert hits_and_misses(server, "cache_identity_fp32") == (3, 4)
        big = np.ones((1, 300), np.float32)
        for _ in range(2):
            infer_one(server, "cache_identity_fp32", big)
        assert hits_and_misses(server, "cache_identity_fp32") == (3, 6)
        metrics = scrape(server)
        assert (metrics("nv_cache_num_entries"), metrics("nv_cache_num_evictions")) == (2, 2)  # c, then b's return
        assert metrics("nv_cache_util") == 2 * one / (2 * one + one // 2)
        assert statistics_counts(server, "cache_identity_fp32")["execution_count"] == 6
    finally:
        stop_server(server)


def test_without_cache_config_a_model_enabling_the_cache_serves_uncached(tmp_path):
    """As Triton 2.51 without --cache-config (measured): the model loads and runs every request, its cache
    counters show zero, and the cache's own gauges are absent."""
    server = start_server(repository(tmp_path / "repo", "cache_identity_fp32"), tmp_path / "server.log")
    try:
        for _ in range(2):
            infer_one(server, "cache_identity_fp32", fp32(1))
        assert statistics_counts(server, "cache_identity_fp32")["execution_count"] == 2
        assert hits_and_misses(server, "cache_identity_fp32") == (0, 0)
        metrics = scrape(server)
        assert metrics("nv_cache_num_hits_per_model", model="cache_identity_fp32") == 0
        assert metrics.values("nv_cache_num_entries") == []
    finally:
        stop_server(server)


def test_sequence_and_decoupled_models_with_the_cache_are_refused_at_load(tmp_path):
    """Triton's words (core model_config_utils.cc ValidateModelConfig), with or without a server cache."""
    root = repository(tmp_path / "repo", "cache_identity_fp32")
    shutil.copytree(ROOT / "model_repository" / "simple_sequence", root / "cached_sequence")
    shutil.copytree(root / "cache_identity_fp32", root / "cached_decoupled")
    for name, extra in (("cached_sequence", 'response_cache { enable: true }\n'),
                        ("cached_decoupled", 'model_transaction_policy { decoupled: true }\n')):
        config = root / name / "config.pbtxt"
        text = config.read_text().replace('name: "simple_sequence"', f'name: "{name}"').replace('name: "cache_identity_fp32"', f'name: "{name}"')
        config.write_text(text + extra)
    server = start_server(root, tmp_path / "server.log", "--cache_config", CACHE, wait="loaded")
    try:
        reasons = {entry["name"]: entry["reason"] for entry in requests.post(f"{server.url}/v2/repository/index", timeout=10).json()}
        assert reasons["cached_sequence"] == (
            "Response Cache does not currently support model cached_sequence with sequence batching scheduler."
            " Please disable the response cache."
        )
        assert reasons["cached_decoupled"] == (
            "Response Cache does not currently support model cached_decoupled with 'decoupled' transaction policy."
            " Please disable the response cache."
        )
        assert reasons["cache_identity_fp32"] == ""
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    "value, error",
    [
        ("redis,host=localhost", "only the 'local' cache is implemented, not redis"),
        ("local", "the local cache needs its size in bytes: local,size=N"),
        ("local,size=0", "size must be a positive number of bytes, got '0'"),
        ("local,size", "'size' is not <key>=<value> (as in local,size=1048576)"),
    ],
)
def test_a_bad_cache_config_is_refused_with_the_reason(value, error):
    result = subprocess.run(
        [sys.executable, "-m", "kserve_ascend", "--model_dir", str(CONFORMANCE), "--cache_config", value],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].endswith(f"error: --cache_config: {error}")


def test_a_reloaded_version_answers_nothing_its_predecessor_computed(tmp_path):
    """The key's version is the loaded version itself: after a reload that changes the model, an earlier request
    runs again. Triton 2.51 keys the version number only: there the same request is a cache hit after such a
    reload (measured with a config override changing sim_fixed_ms, as here)."""
    server = start_server(
        repository(tmp_path / "repo", "cache_identity_fp32"), tmp_path / "server.log",
        "--cache_config", CACHE, "--model_control_mode", "explicit", "--load_model", "cache_identity_fp32",
    )
    try:
        for _ in range(2):
            infer_one(server, "cache_identity_fp32", fp32(7))
        assert hits_and_misses(server, "cache_identity_fp32") == (1, 1)
        config = requests.get(f"{server.url}/v2/models/cache_identity_fp32/config", timeout=10).json()
        config["parameters"]["sim_fixed_ms"] = {"string_value": "1"}  # another model: the version is loaded anew
        load = requests.post(f"{server.url}/v2/repository/models/cache_identity_fp32/load", json={"parameters": {"config": json.dumps(config)}}, timeout=30)
        assert load.status_code == 200, load.text
        infer_one(server, "cache_identity_fp32", fp32(7))
        assert hits_and_misses(server, "cache_identity_fp32") == (0, 1)  # the new version's own statistics
        assert statistics_counts(server, "cache_identity_fp32")["execution_count"] == 1
    finally:
        stop_server(server)

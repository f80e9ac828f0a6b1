"""Triton's response cache (docs/user_guide/response_cache.md): a model whose config says
`response_cache { enable: true }`, on a server started with a cache (`--cache-config local,size=N`), answers a
request equal to one it answered before from the cache, without running the model.

The statistics extension counts it as Triton's core does (tritonserver.cc's ModelStatistics and
infer_stats.cc's UpdateSuccessCacheHit / UpdateSuccessCacheMiss): a hit is a success with its queue
time and a `cache_hit`, and adds no compute, inference or execution; a miss runs the model and adds a
`cache_miss`. The suite's servers run with a cache of harness.CACHE_SIZE bytes (conformance/serve.py);
a server without one skips these cases. Answers are random, so every case makes entries of its own.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conformance.harness import CACHE_SIZE, infer, infer_one, statistics_counts, wait_for

CACHED = "cache_identity_fp32"
#: The fields a cache hit leaves alone, and those it moves.
COMPUTE = ("compute_input", "compute_infer", "compute_output")


def fresh(elements: int = 8) -> np.ndarray:
    """An FP32 [1, elements] no other request has sent."""
    return np.random.default_rng().random((1, elements), dtype=np.float32)


def after(target, model: str, before: dict[str, int], requests_made: int) -> dict[str, int]:
    """The counts once the last request is recorded (Triton records it a moment after its answer)."""
    return wait_for(
        lambda: (now := statistics_counts(target, model))["success"] == before["success"] + requests_made and now,
        f"{requests_made} more successes of {model}", timeout=10,
    )


def changes(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: now[key] - before[key] for key in now if now[key] != before[key]}


@pytest.fixture
def cache(target, requires):
    """Skips unless the server has a response cache: a first request must count a miss."""
    requires("statistics")
    before = statistics_counts(target, CACHED)
    infer_one(target, CACHED, fresh())
    if after(target, CACHED, before, 1)["cache_miss"] == before["cache_miss"]:
        pytest.skip(f"the server runs without a response cache (Triton: --cache-config local,size={CACHE_SIZE})")


@pytest.mark.spec("Triton response_cache.md §Overview; tritonserver.cc ModelStatistics")
def test_cache_hit_answers_without_running_the_model(target, cache):
    x = fresh()
    before = statistics_counts(target, CACHED)
    np.testing.assert_array_equal(infer_one(target, CACHED, x), x)
    missed = after(target, CACHED, before, 1)
    assert changes(missed, before) == {
        "success": 1, "queue": 1, **dict.fromkeys(COMPUTE, 1), "cache_miss": 1, "inference_count": 1, "execution_count": 1,
    }
    np.testing.assert_array_equal(infer_one(target, CACHED, x), x)
    hit = after(target, CACHED, missed, 1)
    assert changes(hit, missed) == {"success": 1, "queue": 1, "cache_hit": 1}


@pytest.mark.spec("Triton response_cache.md §Overview: the key is the model, its version and the inputs")
def test_cache_key_is_the_request_not_its_protocol(target, cache):
    x = fresh()
    before = statistics_counts(target, CACHED)
    infer_one(target, CACHED, x, "http")
    np.testing.assert_array_equal(infer_one(target, CACHED, x, "grpc"), x)
    np.testing.assert_array_equal(infer_one(target, CACHED, x + 1, "grpc"), x + 1)
    now = after(target, CACHED, before, 3)
    assert (now["cache_hit"] - before["cache_hit"], now["cache_miss"] - before["cache_miss"]) == (1, 2)


@pytest.mark.spec("Triton response_cache.md §Overview: an inference request is the inputs' name, shape, datatype and data")
def test_cache_key_holds_the_shape(target, cache):
    """The same bytes in another shape are another request, answered in its own shape."""
    x = fresh(4)
    before = statistics_counts(target, CACHED)
    infer_one(target, CACHED, x)
    assert infer_one(target, CACHED, x.reshape(2, 2)).shape == (2, 2)
    now = after(target, CACHED, before, 2)
    assert (now["cache_hit"] - before["cache_hit"], now["cache_miss"] - before["cache_miss"]) == (0, 2)


@pytest.mark.spec("Triton response_cache.md §Overview: an inference result is the output tensors")
def test_cache_hit_answers_the_outputs_asked_for(target, cache):
    """A request that asks for OUTPUT1 of inputs an earlier request asked OUTPUT0 of is answered OUTPUT1."""
    inputs = {"INPUT0": np.random.default_rng().integers(0, 100, (1, 16), dtype=np.int32), "INPUT1": np.ones((1, 16), np.int32)}
    sums = infer(target, "cache_simple", inputs, outputs=["OUTPUT0"])
    differences = infer(target, "cache_simple", inputs, outputs=["OUTPUT1"])
    assert list(sums) == ["OUTPUT0"] and list(differences) == ["OUTPUT1"]
    np.testing.assert_array_equal(differences["OUTPUT1"], inputs["INPUT0"] - 1)


@pytest.mark.spec("Triton response_cache.md: by default no model uses response caching")
def test_model_without_response_cache_runs_every_request(target, cache):
    x = fresh()
    before = statistics_counts(target, "identity_fp32")
    for _ in range(2):
        np.testing.assert_array_equal(infer_one(target, "identity_fp32", x), x)
    now = after(target, "identity_fp32", before, 2)
    assert (now["execution_count"] - before["execution_count"], now["cache_hit"], now["cache_miss"]) == (2, 0, 0)


@pytest.mark.spec("Triton response_cache.md §Ensemble Model Caching: a hit skips the composing models")
def test_ensemble_hit_runs_no_step(target, cache):
    x = fresh()
    before, step = statistics_counts(target, "cache_ensemble"), statistics_counts(target, "identity_fp32")
    np.testing.assert_array_equal(infer_one(target, "cache_ensemble", x, name="IN"), x)
    np.testing.assert_array_equal(infer_one(target, "cache_ensemble", x, name="IN"), x)
    now = after(target, "cache_ensemble", before, 2)
    assert (now["cache_hit"] - before["cache_hit"], now["cache_miss"] - before["cache_miss"]) == (1, 1)
    # Recorded before the ensemble's own request: the step ran for the miss only.
    assert statistics_counts(target, "identity_fp32")["execution_count"] - step["execution_count"] == 1


@pytest.mark.spec("Triton response_cache.md §Known Limitations: only outputs in CPU memory (system shared memory is)")
def test_cache_hit_written_to_shared_memory(target, cache, requires):
    """A request whose output goes to a system shared memory region is cached like any other (Triton 2.51
    caches it: its limitation is outputs outside CPU memory, i.e. CUDA), and its hit is written there."""
    requires("system_shared_memory")
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    x = fresh()
    name = f"cache_{target.name}_{os.getpid()}".replace(" ", "_")
    handle = shm.create_shared_memory_region(name, f"/{name}", x.nbytes)
    before = statistics_counts(target, CACHED)
    try:
        with httpclient.InferenceServerClient(target.http) as client:
            client.register_system_shared_memory(name, f"/{name}", x.nbytes)
            try:
                for _ in range(2):
                    shm.set_shared_memory_region(handle, [np.zeros_like(x)])
                    tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
                    tensor.set_data_from_numpy(x)
                    output = httpclient.InferRequestedOutput("OUTPUT0")
                    output.set_shared_memory(name, x.nbytes)
                    client.infer(CACHED, [tensor], outputs=[output])
                    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, list(x.shape)), x)
            finally:
                client.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)
    now = after(target, CACHED, before, 2)
    assert (now["cache_hit"] - before["cache_hit"], now["cache_miss"] - before["cache_miss"]) == (1, 1)


#: FP32 answers of about 400 KB: two fit in the suite's cache of 1 MiB, three do not.
LARGE = 100_000


@pytest.mark.spec("Triton local_cache: a byte-bounded cache that evicts the least recently used entry")
def test_cache_evicts_the_least_recently_used(target, cache):
    a, b, c = (fresh(LARGE) for _ in range(3))
    for x in (a, b, a, c):  # b is then the least recently used: c's entry takes its place
        infer_one(target, CACHED, x)
    before = statistics_counts(target, CACHED)
    infer_one(target, CACHED, a)
    np.testing.assert_array_equal(infer_one(target, CACHED, b), b)
    now = after(target, CACHED, before, 2)
    assert (now["cache_hit"] - before["cache_hit"], now["cache_miss"] - before["cache_miss"]) == (1, 1)


@pytest.mark.spec("Triton local_cache: an entry larger than the cache is not stored")
def test_answer_larger_than_the_cache_is_not_stored(target, cache):
    x = fresh(CACHE_SIZE // 4 + 1)
    before = statistics_counts(target, CACHED)
    for _ in range(2):
        np.testing.assert_array_equal(infer_one(target, CACHED, x), x)
    now = after(target, CACHED, before, 2)
    assert changes(now, before) == {
        "success": 2, "queue": 2, **dict.fromkeys(COMPUTE, 2), "cache_miss": 2, "inference_count": 2, "execution_count": 2,
    }

"""Issue 30: every loaded version knows its memory, a budget per device, and loading on demand.

In one process over the core (`Repository` and the data plane every edge uses) where the order of
events matters, and over real servers for the flags and the control modes. The fleet under load is
tests/test_fleet.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import requests
from prometheus_client import CollectorRegistry

from conftest import copy_model, scrape, sim_model, start_server, stop_server, wait_for
from kserve_ascend.core.errors import ModelNotReady, Unavailable
from kserve_ascend.core.execution import loading
from kserve_ascend.core.models import memory, repository as repository_module
from kserve_ascend.core.models.memory import MB, Ledger, OutOfBudget
from kserve_ascend.core.models.model import Model
from kserve_ascend.core.models.repository import Repository
from kserve_ascend.server.dataplane import InferRequest
from kserve_ascend.server.dataplane.local import LocalDataPlane


def sims(root: Path, names, memory_mb: float = 100, fixed_ms: float = 0, **parameters: str) -> Path:
    root.mkdir(exist_ok=True)
    for name in names:
        sim_model(root, name, 8, 0, fixed_ms, parameters={"sim_memory_mb": str(memory_mb), **parameters})
    return root


def on_demand(root: Path, budget_mb: float, pinned=()) -> tuple[Repository, LocalDataPlane]:
    repository = Repository(root, ledger=Ledger(budget_mb), load_on_demand=True, pinned=pinned)
    return repository, LocalDataPlane(repository, False, CollectorRegistry())


def request(name: str, value: float = 1.0, **parameters) -> InferRequest:
    return InferRequest(name, {"INPUT0": np.full((1, 4), value, np.float32)}, parameters=parameters)


async def answer(dataplane: LocalDataPlane, name: str, value: float = 1.0, **parameters) -> np.ndarray:
    result = await dataplane.infer(request(name, value, **parameters))
    with result.answering():
        return result.outputs["OUTPUT0"]


def run(main, timeout_s: float = 30):
    """Runs a test's coroutine, failing it (not hanging) if it has not ended within `timeout_s`."""
    return asyncio.run(asyncio.wait_for(main, timeout_s))


def loaded(repository: Repository) -> set[str]:
    return {name for name, model in repository.models.items() if model.ready}


# ---------------------------------------------------------------- the ledger


def test_the_least_recently_used_that_cover_the_shortfall_are_chosen():
    ledger = Ledger(1000)

    class Version:
        def __init__(self, number, device_bytes):
            self.version, self.memory = number, device_bytes

    for name, size in (("a", 300), ("b", 100), ("c", 300)):
        ledger.hold(name, Version(1, {0: size * MB}), {})
    for name in ("c", "a", "b"):
        ledger.touch(name)
    assert ledger.shortfall({0: 200 * MB}) == {}
    assert ledger.shortfall({0: 400 * MB}) == {0: 100 * MB}
    assert ledger.victims({0: 100 * MB}, ["a", "b", "c"]) == ["c"]  # c is the least recently used
    assert ledger.victims({0: 350 * MB}, ["a", "b"]) == ["a", "b"]  # c is in use: a and b cover it
    assert ledger.victims({0: 500 * MB}, ["a", "b"]) is None
    assert ledger.victims({1: 1}, ["a", "b", "c"]) is None  # nothing held on device 1
    assert ledger.refusal("d", {0: 400 * MB}) == (
        "model 'd' does not fit in the memory budget: it needs 400 MB on device 0, where 700 MB of the budget of"
        " 1000 MB are taken (300 MB free)"
    )


def test_a_model_in_steady_use_outlasts_one_asked_for_once_since(tmp_path):
    """LRU-2: ranked by their second-to-last use, a cold model's one use does not outrank a hot model's many."""

    class Version:
        version, memory = 1, {0: 100 * MB}

    ledger = Ledger(1000)
    for name in ("hot", "cold"):
        ledger.hold(name, Version(), {})
    ledger.touch("hot")
    ledger.touch("hot")
    ledger.touch("cold")  # after hot's last use
    assert ledger.victims({0: 1}, ["hot", "cold"]) == ["cold"]


def test_a_version_holds_the_larger_of_its_estimate_and_its_measurement():
    class Version:
        version, memory = 1, {0: 90 * MB}

    ledger = Ledger(1000)
    ledger.hold("a", Version(), {0: 100 * MB})
    assert ledger.used(0) == 100 * MB


def test_the_default_budget_is_the_device_free_memory_at_first_use_less_the_reserve():
    readings = {0: (8192 * MB, 24576 * MB)}
    ledger = Ledger(None, lambda device: readings.get(device))
    assert ledger.budget(0) == (8192 - memory.RESERVE_MB) * MB
    readings[0] = (1, 24576 * MB)
    assert ledger.budget(0) == (8192 - memory.RESERVE_MB) * MB  # read once, at first use
    assert ledger.budget(1) is None  # no pyACL reading: unlimited


# ---------------------------------------------------------------- every version knows its memory


def test_a_cpu_runtime_measures_resident_memory_sim_its_allocation_and_memory_mb_overrides(tmp_path):
    root = sims(tmp_path / "repo", ["sim", "configured"], memory_mb=64)
    config = root / "configured" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "memory_mb" value: { string_value: "7.5" } }\n')
    copy_model("yolov8n", root)
    repository = Repository(root)

    async def main():
        for name in ("sim", "configured", "yolov8n"):
            await repository.load(name)

    run(main())
    onnx = repository.models["yolov8n"].versions[1]
    weights = (root / "yolov8n" / "1" / "model.onnx").stat().st_size
    assert onnx.memory_source == "process resident memory" and onnx.memory[0] > weights / 2  # its weights, at least
    sim = repository.models["sim"].versions[1]
    assert sim.memory == {0: 64 * MB} and sim.memory_source == "sim_memory_mb"
    configured = repository.models["configured"].versions[1]
    assert configured.memory == {0: round(7.5 * MB)} and configured.memory_source == "memory_mb"
    entries = {e["name"]: e for e in repository.index()}
    assert entries["configured"]["memory_bytes"] == round(7.5 * MB)
    assert sim.runtime_info["memory_bytes"] == str(64 * MB)
    for model in repository.models.values():
        model.close()


# ---------------------------------------------------------------- the budget


def test_a_load_that_does_not_fit_is_refused_before_it_touches_a_device(tmp_path, monkeypatch):
    root = sims(tmp_path / "repo", ["a", "b"])
    repository = Repository(root, ledger=Ledger(150))
    runtimes = []
    real = loading.load_runtime
    monkeypatch.setattr(loading, "load_runtime", lambda *args: runtimes.append(args[1]) or real(*args))

    async def main():
        await repository.load("a")
        with pytest.raises(OutOfBudget) as refused:
            await repository.load("b")
        return str(refused.value)

    refusal = run(main())
    assert refusal == (
        "model 'b' does not fit in the memory budget: it needs 100 MB on device 0, where 100 MB of the budget of"
        " 150 MB are taken (50 MB free)"
    )
    assert [path.parent.parent.name for path in runtimes] == ["a"]  # b's runtime never loaded
    entries = {e["name"]: e for e in repository.index()}
    assert entries["b"]["state"] == "UNAVAILABLE" and entries["b"]["reason"] == refusal
    repository.models["a"].close()


@pytest.mark.parametrize("mode", ["none", "explicit", "poll"])
def test_every_control_mode_refuses_a_load_over_the_budget_with_both_numbers(tmp_path, mode):
    root = sims(tmp_path / "repo", ["a"] if mode == "poll" else ["a", "b"])
    extra = ["--model_control_mode", mode, "--memory_budget_mb", "150"] + (["--load_model", "a"] if mode == "explicit" else [])
    server = start_server(root, tmp_path / "server.log", *extra, wait="loaded" if mode == "none" else "ready")
    try:
        if mode == "explicit":
            refused = requests.post(f"{server.url}/v2/repository/models/b/load", timeout=30)
            assert refused.status_code == 400
            assert "needs 100 MB on device 0, where 100 MB of the budget of 150 MB are taken" in refused.json()["error"]
        if mode == "poll":
            sims(root, ["b"])
        index = {}

        def refused_b() -> bool:
            index.update({e["name"]: e for e in requests.post(f"{server.url}/v2/repository/index", timeout=5).json()})
            return "b" in index and "does not fit" in index["b"].get("reason", "")

        wait_for(refused_b, "b refused", timeout=20, server=server)
        assert index["a"]["state"] == "READY" and index["b"]["state"] == "UNAVAILABLE"
        assert "needs 100 MB on device 0, where 100 MB of the budget of 150 MB are taken (50 MB free)" in index["b"]["reason"]
        metrics = scrape(server)
        assert metrics("ascend_device_memory_budget_bytes", device="0") == 150 * MB
        assert metrics.values("ascend_model_memory_bytes", model="b") == []
        assert metrics("ascend_model_memory_bytes", model="a", version="1") == 100 * MB
    finally:
        stop_server(server)


# ---------------------------------------------------------------- loading on demand


def test_concurrent_requests_for_a_cold_model_start_one_load_and_wait_as_queue_time(tmp_path):
    repository, dataplane = on_demand(sims(tmp_path / "repo", ["cold"]), 1000)

    async def main():
        return await asyncio.gather(*(answer(dataplane, "cold", float(i)) for i in range(8)))

    assert repository.index() == [{"name": "cold", "state": "UNAVAILABLE", "reason": "unloaded"}]  # known, not loaded
    outputs = run(main())
    assert [output[0, 0] for output in outputs] == list(range(8))
    assert repository.memory.loads == {("cold", "on_demand"): 1}
    counts, waited_s = repository.memory.waits["cold"]
    assert sum(counts) == 8
    stats = repository.models["cold"].versions[1].stats
    # The waits are in the queue time (beside the batch queue's), and not in compute_input.
    assert stats.queue.ns >= waited_s * 1e9 > stats.compute.input.ns
    repository.models["cold"].close()


def test_a_decoupled_models_request_waits_for_its_load_as_queue_time_and_is_one_use(tmp_path):
    """As an ordinary model's: the data plane takes a streamed request once (its load wait was once measured, then
    lost when the request was taken again as a stream, and its use counted twice, which ranks it for eviction)."""
    root = tmp_path / "repo"
    root.mkdir()
    copy_model("repeat_int32", root)
    repository, dataplane = on_demand(root, 1000)
    inputs = {"IN": np.array([4, 2], np.int32), "DELAY": np.zeros(2, np.uint32), "WAIT": np.zeros(1, np.uint32)}

    async def main():
        stream = await dataplane.infer(InferRequest("repeat_int32", inputs), streaming=True)
        return [int(outputs["OUT"][0]) async for outputs in stream]

    assert run(main()) == [4, 2]
    assert repository.memory.recent["repeat_int32"][1] == 0  # used once: no use before the last
    counts, waited_s = repository.memory.waits["repeat_int32"]
    stats = repository.models["repeat_int32"].versions[1].stats
    assert sum(counts) == 1 and stats.queue.ns >= waited_s * 1e9 > stats.compute.input.ns
    repository.models["repeat_int32"].close()


def in_flight(repository: Repository, name: str) -> bool:
    versions = repository.models[name].versions
    return 1 in versions and versions[1].scheduler.outstanding > 0


def test_eviction_takes_an_idle_model_before_one_in_use_and_never_a_pinned_one(tmp_path):
    root = sims(tmp_path / "repo", ["idle", "next"])
    sims(root, ["pinned"], pinned="true")
    sims(root, ["slow"], fixed_ms=2000)  # in use while two others load
    repository, dataplane = on_demand(root, 350)

    async def main():
        await answer(dataplane, "pinned")
        slow = asyncio.ensure_future(answer(dataplane, "slow", 2.0))
        while not in_flight(repository, "slow"):
            await asyncio.sleep(0.01)
        await answer(dataplane, "idle")  # used after slow: slow is the least recently used
        assert (await answer(dataplane, "next", 3.0))[0, 0] == 3.0
        assert not slow.done() and repository.memory.evictions == {"idle": 1}  # slow is in use: idle made room
        assert (await slow)[0, 0] == 2.0
        assert loaded(repository) == {"pinned", "slow", "next"}

    run(main())
    assert repository.memory.evictions == {"idle": 1}
    for model in repository.models.values():
        model.close()


def test_load_model_pins_and_nothing_else_fits_is_refused_at_once(tmp_path):
    repository, dataplane = on_demand(sims(tmp_path / "repo", ["pinned", "other"]), 150, pinned=["pinned"])

    async def main():
        await repository.load("pinned", reason="startup")
        with pytest.raises(ModelNotReady, match="does not fit in the memory budget.*pinned or in use"):
            await answer(dataplane, "other")

    run(main())
    assert loaded(repository) == {"pinned"}
    repository.models["pinned"].close()


def test_a_model_that_fails_to_load_answers_its_reason_and_is_retried_only_after_a_back_off(tmp_path, monkeypatch):
    root = sims(tmp_path / "repo", ["broken"])
    config = root / "broken" / "config.pbtxt"
    good = config.read_text()
    config.write_text(good.replace('output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n', ""))
    repository, dataplane = on_demand(root, 1000)
    attempts = []
    real = Model.load
    monkeypatch.setattr(Model, "load", lambda self, *args: attempts.append(self.name) or real(self, *args))
    monkeypatch.setattr(repository_module, "RETRY_S", 0.3)

    async def main():
        for _ in range(2):
            with pytest.raises(ModelNotReady, match="model 'broken' failed to load: "):
                await answer(dataplane, "broken")
        assert attempts == ["broken"]  # the second request did not try again
        assert repository.ready  # a model that failed on demand does not make the server unready
        config.write_text(good)
        await asyncio.sleep(0.4)
        return await answer(dataplane, "broken", 5.0)

    assert run(main())[0, 0] == 5.0
    assert attempts == ["broken", "broken"]
    repository.models["broken"].close()


def test_the_wait_is_bounded_by_the_request_timeout(tmp_path, monkeypatch):
    repository, dataplane = on_demand(sims(tmp_path / "repo", ["slow_to_load"]), 1000)
    real = Model.load

    def slow_load(self, *args):
        import time

        time.sleep(0.5)
        return real(self, *args)

    monkeypatch.setattr(Model, "load", slow_load)

    async def main():
        impatient = asyncio.ensure_future(answer(dataplane, "slow_to_load", timeout=50_000))  # 50 ms
        patient = asyncio.ensure_future(answer(dataplane, "slow_to_load", 7.0))
        with pytest.raises(Unavailable, match="Request timeout expired: it waited for model 'slow_to_load' to load"):
            await impatient
        return await patient

    assert run(main())[0, 0] == 7.0
    assert repository.memory.loads == {("slow_to_load", "on_demand"): 1}
    repository.models["slow_to_load"].close()


ENSEMBLE = """name: "pair"
platform: "ensemble"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "first" model_version: -1 input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "T" } },
  { model_name: "second" model_version: -1 input_map { key: "INPUT0" value: "T" } output_map { key: "OUTPUT0" value: "OUTPUT0" } }
] }
"""


def test_an_ensemble_loads_its_steps_and_protects_them_while_it_runs(tmp_path):
    root = sims(tmp_path / "repo", ["second", "other"])
    sims(root, ["first"], fixed_ms=400)  # while it runs, second waits its turn
    (root / "pair" / "1").mkdir(parents=True)
    (root / "pair" / "config.pbtxt").write_text(ENSEMBLE)
    repository, dataplane = on_demand(root, 250)

    async def main():
        running = asyncio.ensure_future(answer(dataplane, "pair", 4.0))
        while not in_flight(repository, "first"):
            await asyncio.sleep(0.01)
        assert loaded(repository) == {"pair", "first", "second"}
        following = await answer(dataplane, "other", 6.0)  # second is idle, but its ensemble runs: this waits
        assert running.done()
        return (await running)[0, 0], following[0, 0]

    assert run(main()) == (4.0, 6.0)
    assert sum(repository.memory.evictions.values()) == 1
    assert repository.memory.loads[("first", "on_demand")] == repository.memory.loads[("second", "on_demand")] == 1
    for model in repository.models.values():
        model.close()


def test_poll_mode_on_demand_knows_new_models_and_loads_them_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(repository_module, "SETTLE_S", 0.05)
    root = sims(tmp_path / "repo", ["a"])
    repository, dataplane = on_demand(root, 1000)

    async def main():
        sims(root, ["new"])
        await repository._apply({"new"})  # what the watch of poll mode does with a new directory
        assert {e["name"]: e["state"] for e in repository.index()} == {"a": "UNAVAILABLE", "new": "UNAVAILABLE"}
        return await answer(dataplane, "new", 8.0)

    assert run(main())[0, 0] == 8.0
    assert repository.memory.loads == {("new", "on_demand"): 1}
    repository.models["new"].close()


def test_an_ensemble_request_whose_step_is_unloaded_under_it_fails_and_the_unload_ends(tmp_path):
    """Found here: the step's version, resolved as the request began, was retired before the request reached it;
    its batcher took the request after closing and never answered, and the unload waited for it for ever."""
    root = sims(tmp_path / "repo", ["second"], memory_mb=1)
    sims(root, ["first"], memory_mb=1, fixed_ms=400)
    (root / "pair" / "1").mkdir(parents=True)
    (root / "pair" / "config.pbtxt").write_text(ENSEMBLE)
    repository = Repository(root)
    dataplane = LocalDataPlane(repository, True, CollectorRegistry())

    async def main():
        await repository.load("pair")
        running = asyncio.ensure_future(answer(dataplane, "pair"))
        while not in_flight(repository, "first"):
            await asyncio.sleep(0.01)
        await repository.unload("second")  # and with it the ensemble, once its request is answered
        with pytest.raises(ModelNotReady, match=r"in ensemble 'pair', step 2 \(model 'second'\): .* was unloaded"):
            await running

    run(main(), timeout_s=10)
    for model in repository.models.values():
        model.close()


def test_a_load_is_admitted_for_the_instances_its_completed_config_places(tmp_path):
    # No config.pbtxt: a model.onnx is completed as onnxruntime, whose CPU group has two instances by default.
    (tmp_path / "repo" / "plain" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "plain" / "1" / "model.onnx").write_bytes(b"\0" * 1000)
    repository = Repository(tmp_path / "repo", ledger=Ledger(150))
    assert repository._estimates(repository.models["plain"], None) == {1: {0: 2000}}

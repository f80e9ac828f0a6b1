"""Priorities, queue policies and adaptive batching: in the core scheduler, then over the wire."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from conftest import copy_model, core_request, start_server, stop_server
from kserve_ascend.core.scheduling.adaptive import AdaptiveBatchLimit
from kserve_ascend.core.scheduling.batcher import DynamicBatcher
from kserve_ascend.core.scheduling.queue import BatchQueue
from kserve_ascend.core.stats import VersionStats
from kserve_ascend.core.errors import InvalidInput, Unavailable


def dynamic(text: str) -> mc.ModelDynamicBatching:
    return text_format.Parse(text, mc.ModelDynamicBatching())


class SleepyRunner:
    """Echoes each request; one batch of b rows takes fixed + per_item·b seconds. Records batch order."""

    def __init__(self, fixed: float, per_item: float = 0.0):
        self.fixed, self.per_item = fixed, per_item
        self.batches: list[list[int]] = []

    def __call__(self, requests, execution=None):
        self.batches.append([int(r["x"][0, 0]) for r in requests])
        time.sleep(self.fixed + self.per_item * sum(len(r["x"]) for r in requests))
        return [{"y": r["x"]} for r in requests]


def submit(scheduler, tag: int, **options):
    return scheduler.submit(core_request({"x": np.full((1, 1), tag)}, **options))


def test_urgent_requests_jump_the_queue():
    """The CANN design's case: a security alarm (priority 1) overtakes ordinary recognition (2)."""
    runner = SleepyRunner(0.05)

    async def main():
        queue = BatchQueue(1, dynamic("priority_levels: 2 default_priority_level: 2"))
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue, VersionStats())
        first = asyncio.ensure_future(submit(scheduler, 0))  # occupies the only instance
        await asyncio.sleep(0.01)
        ordinary = [asyncio.ensure_future(submit(scheduler, tag)) for tag in (1, 2, 3)]
        await asyncio.sleep(0)
        alarm = asyncio.ensure_future(submit(scheduler, 99, priority=1))
        await asyncio.gather(first, alarm, *ordinary)

    asyncio.run(main())
    assert [b[0] for b in runner.batches] == [0, 99, 1, 2, 3]


def test_priority_outside_the_levels_is_a_client_error():
    async def main():
        queue = BatchQueue(4, dynamic("priority_levels: 2"))
        scheduler = DynamicBatcher([SleepyRunner(0)], [ThreadPoolExecutor(1)], queue, VersionStats())
        with pytest.raises(InvalidInput, match="outside the model's priority levels 1..2"):
            await submit(scheduler, 0, priority=3)

    asyncio.run(main())


def test_full_queue_rejects_at_once():
    async def main():
        queue = BatchQueue(1, dynamic("default_queue_policy { max_queue_size: 2 }"))
        scheduler = DynamicBatcher([SleepyRunner(0.1)], [ThreadPoolExecutor(1)], queue, VersionStats())
        running = asyncio.ensure_future(submit(scheduler, 0))
        await asyncio.sleep(0.02)  # the first request left the queue for the instance
        waiting = [asyncio.ensure_future(submit(scheduler, tag)) for tag in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(Unavailable, match="Exceeds maximum queue size: 2"):
            await submit(scheduler, 3)
        await asyncio.gather(running, *waiting)

    asyncio.run(main())


@pytest.mark.parametrize("action", ["REJECT", "DELAY"])
def test_queue_timeout_rejects_or_delays(action):
    runner = SleepyRunner(0.1)

    async def main():
        policy = f"default_queue_policy {{ timeout_action: {action} default_timeout_microseconds: 30000 allow_timeout_override: true }}"
        queue = BatchQueue(1, dynamic(policy))
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue, VersionStats())
        busy = asyncio.ensure_future(submit(scheduler, 0))
        await asyncio.sleep(0.01)
        timing_out = asyncio.ensure_future(submit(scheduler, 1))
        patient = asyncio.ensure_future(submit(scheduler, 2, timeout_us=10_000_000))  # overrides the 30 ms
        return await asyncio.gather(busy, timing_out, patient, return_exceptions=True)

    results = asyncio.run(main())
    if action == "REJECT":
        assert isinstance(results[1], Unavailable) and "Request timeout expired" in str(results[1])
        assert [b[0] for b in runner.batches] == [0, 2]
    else:  # DELAY: served after the request that has not timed out
        assert not isinstance(results[1], Exception)
        assert [b[0] for b in runner.batches] == [0, 2, 1]
    assert not isinstance(results[2], Exception)


def test_adaptive_limit_converges_to_the_largest_batch_within_target_and_stays():
    """Device cost 20 + 5·b ms, delay 5 ms, target 52 ms: the largest batch that fits is 5."""
    limit = AdaptiveBatchLimit(target_s=0.052, delay_s=0.005, max_batch_size=8)
    rng = np.random.default_rng(0)
    history = []
    for step in range(200):
        rows = min(limit.limit, 8)
        limit.observe(rows, 0.020 + 0.005 * rows + rng.normal(0, 0.0005))  # ±0.5 ms noise
        history.append(limit.limit)
    assert history[-150:] == [5] * 150  # settled, and never moved again


def test_adaptive_batching_in_the_scheduler_under_load():
    # b rows cost 2 + 20·b ms; the 77 ms target less the 5 ms delay leaves a 72 ms budget, between
    # b=3 (62 ms) and b=4 (82 ms) with 10 ms either side, so sleeps that overshoot on a busy
    # machine do not move the limit off 3.
    runner = SleepyRunner(0.002, 0.020)

    async def main():
        queue = BatchQueue(8, dynamic("max_queue_delay_microseconds: 5000"), latency_target_ms=77)
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue, VersionStats())

        async def client(tag):
            for _ in range(8):
                await submit(scheduler, tag)

        await asyncio.gather(*(client(tag) for tag in range(16)))
        return queue.adaptive.limit

    final = asyncio.run(main())
    sizes = [len(b) for b in runner.batches]
    assert final == 3
    assert max(sizes[-10:]) <= 3 and sizes[0] == 8


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    """`sim` at 200 ms a request: with a queue of 2, with a 50 ms REJECT timeout, and with two priority levels."""
    repository = tmp_path_factory.mktemp("policy_repo")
    for name, batching in {
        "sim_small_queue": "dynamic_batching { default_queue_policy { max_queue_size: 2 } }",
        "sim_timeout": "dynamic_batching { default_queue_policy { default_timeout_microseconds: 50000 } }",
        "sim_priority": "dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
    }.items():
        model = copy_model("sim", repository, name)
        text = (model / "config.pbtxt").read_text().replace("dynamic_batching { max_queue_delay_microseconds: 5000 }", batching)
        text = text.replace('string_value: "20"', 'string_value: "200"').replace("max_batch_size: 8", "max_batch_size: 1")
        (model / "config.pbtxt").write_text(text)
    server = start_server(repository, repository.parent / "policy.log")
    yield server
    stop_server(server)


def sim_request(client_module, address, model, **kwargs):
    with client_module.InferenceServerClient(address) as client:
        tensor = client_module.InferInput("INPUT0", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        return client.infer(model, [tensor], **kwargs)


def test_full_queue_answers_503_and_grpc_unavailable(policy_server):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    url = f"{policy_server.url}/v2/models/sim_small_queue/infer"
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: requests.post(url, json=body), range(6)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 3 and 503 in statuses
    assert all("Exceeds maximum queue size" in r.json()["error"] for r in responses if r.status_code == 503)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(sim_request, grpcclient, policy_server.grpc, "sim_small_queue") for _ in range(6)]
        errors = [f.exception() for f in futures if f.exception() is not None]
    assert errors and all("StatusCode.UNAVAILABLE" in str(e) for e in errors)


def test_queue_timeout_over_the_wire(policy_server):
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(sim_request, httpclient, policy_server.http, "sim_timeout") for _ in range(3)]
        outcomes = [f.exception() for f in futures]
    timed_out = [e for e in outcomes if e is not None]
    assert timed_out and all(isinstance(e, InferenceServerException) and "Request timeout expired" in str(e) for e in timed_out)
    assert any(e is None for e in outcomes)


def test_priority_parameter_over_http_and_grpc(policy_server):
    finished: list[str] = []

    def call(tag, module, address, priority=0):
        sim_request(module, address, "sim_priority", priority=priority)
        finished.append(tag)

    with ThreadPoolExecutor(5) as pool:
        pool.submit(call, "busy", httpclient, policy_server.http)
        time.sleep(0.05)
        ordinary = [pool.submit(call, f"ordinary{i}", httpclient, policy_server.http) for i in range(2)]
        time.sleep(0.05)
        alarms = [pool.submit(call, "alarm-http", httpclient, policy_server.http, 1)]
        alarms.append(pool.submit(call, "alarm-grpc", grpcclient, policy_server.grpc, 1))
        for future in ordinary + alarms:
            future.result()
    assert finished[0] == "busy"
    assert set(finished[1:3]) == {"alarm-http", "alarm-grpc"}, finished
    with pytest.raises(InferenceServerException, match="outside the model's priority levels"):
        sim_request(httpclient, policy_server.http, "sim_priority", priority=7)

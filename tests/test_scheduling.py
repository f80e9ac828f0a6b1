"""Priorities, queue policies and adaptive batching: in the core scheduler, then over the wire."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import (
    core_request,
    executions_by_batch_size,
    hold_executions,
    infer,
    json_body,
    load_fake_acl,
    pending,
    post_infer,
    release_executions,
    start_on_fake_acl,
    statistics,
    stop_server,
    until,
    wait_for,
)
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from kserve_ascend.core.errors import Unavailable
from kserve_ascend.core.scheduling.adaptive import AdaptiveBatchLimit
from kserve_ascend.core.scheduling.batcher import DynamicBatcher
from kserve_ascend.core.scheduling.queue import BatchQueue
from kserve_ascend.core.stats import VersionStats


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


class HeldRunner:
    """Echoes each request and records batch order; its first batch runs only once `release` is set, as
    a device call held: what queues meanwhile is known without timing anything."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.release = threading.Event()

    def __call__(self, requests, execution=None):
        self.batches.append([int(r["x"][0, 0]) for r in requests])
        assert self.release.wait(BOUND_S), "never released"
        return [{"y": r["x"]} for r in requests]


#: Every in-process wait is bounded: a request the scheduler lost fails the test instead of hanging it.
BOUND_S = 10


def submit(scheduler, tag: int, **options):
    return scheduler.submit(core_request({"x": np.full((1, 1), tag)}, **options))


def test_urgent_requests_jump_the_queue():
    """The CANN design's case: a security alarm (priority 1) overtakes ordinary recognition (2)."""
    runner = HeldRunner()

    async def main():
        queue = BatchQueue(1, dynamic("priority_levels: 2 default_priority_level: 2"))
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue, VersionStats())
        first = asyncio.ensure_future(submit(scheduler, 0))
        await until(lambda: scheduler.executing == 1, "request 0 to hold the only instance")
        ordinary = [asyncio.ensure_future(submit(scheduler, tag)) for tag in (1, 2, 3)]
        await until(lambda: scheduler.queued == 3, "the ordinary requests to queue")
        alarm = asyncio.ensure_future(submit(scheduler, 99, priority=1))
        await until(lambda: scheduler.queued == 4, "the alarm to queue")
        runner.release.set()
        await asyncio.gather(first, alarm, *ordinary)

    asyncio.run(main())
    assert [b[0] for b in runner.batches] == [0, 99, 1, 2, 3]


def test_priority_beyond_the_levels_is_the_default_level():
    """As in Triton (core's InferenceRequest::SetPriority): 0, absent or beyond the levels is the default."""
    queue = BatchQueue(4, dynamic("priority_levels: 3 default_priority_level: 2"))
    assert [queue.level_of(p) for p in (None, 0, 1, 2, 3, 4, 2**63)] == [1, 1, 0, 1, 2, 1, 1]
    assert BatchQueue(4, dynamic("")).level_of(5) == 0  # no levels: one queue, any priority


def test_full_queue_rejects_at_once():
    runner = HeldRunner()

    async def main():
        queue = BatchQueue(1, dynamic("default_queue_policy { max_queue_size: 2 }"))
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue, VersionStats())
        running = asyncio.ensure_future(submit(scheduler, 0))
        await until(lambda: scheduler.executing == 1, "the first request to leave the queue for the instance")
        waiting = [asyncio.ensure_future(submit(scheduler, tag)) for tag in (1, 2)]
        await until(lambda: scheduler.queued == 2, "two requests to wait")
        with pytest.raises(Unavailable, match="Exceeds maximum queue size: 2"):
            await submit(scheduler, 3)
        runner.release.set()
        await asyncio.gather(running, *waiting)

    asyncio.run(main())
    assert [b[0] for b in runner.batches] == [0, 1, 2]


@pytest.mark.parametrize("action", ["REJECT", "DELAY"])
def test_queue_timeout_rejects_or_delays(action):
    runner = HeldRunner()

    async def main():
        policy = f"default_queue_policy {{ timeout_action: {action} default_timeout_microseconds: 30000 allow_timeout_override: true }}"
        queue = BatchQueue(1, dynamic(policy))
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue, VersionStats())
        busy = asyncio.ensure_future(submit(scheduler, 0))
        await until(lambda: scheduler.executing == 1, "request 0 to hold the only instance")
        timing_out = asyncio.ensure_future(submit(scheduler, 1))
        patient = asyncio.ensure_future(submit(scheduler, 2, timeout_us=10_000_000))  # overrides the 30 ms
        await until(lambda: scheduler.queued == 2, "both to queue")
        if action == "REJECT":
            await until(timing_out.done, "the 30 ms timeout to reject request 1")
        else:
            await asyncio.sleep(0.1)  # past the 30 ms timeout, which moves request 1 behind request 2
        runner.release.set()
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


@pytest.mark.serial  # the limit follows the measured cost of executions: a busy machine moves it
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


#: .om models on the FAKE pyACL, whose executions can be held while requests queue: one request at a time
#: with a queue of 2, with a 50 ms REJECT timeout, and, up to 6 rows a batch, with two priority levels.
SMALL_QUEUE, TIMEOUT, PRIORITY = "held_small_queue", "held_timeout", "held_priority"


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("policy_repo")
    fake_acl = load_fake_acl()
    for name, max_batch_size, batching in (
        (SMALL_QUEUE, 1, "default_queue_policy { max_queue_size: 2 }"),
        (TIMEOUT, 1, "default_queue_policy { default_timeout_microseconds: 50000 }"),
        (PRIORITY, 6, "priority_levels: 2 default_priority_level: 2"),
    ):
        (repository / name / "1").mkdir(parents=True)
        gears = range(1, max_batch_size + 1)
        fake_acl.fake_write_om(repository / name / "1" / "model.om", [("INPUT0", fake_acl.ACL_FLOAT, [-1, 4])], dynamic_batch=gears)
        (repository / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: {max_batch_size}\ndynamic_batching {{ {batching} }}\n'
        )
    server = start_on_fake_acl(repository, "policy")
    yield server
    stop_server(server)


def request(server, model: str, protocol: str = "http", value: float = 1.0, **options):
    """One row of `value`; the answer's row, or the refusal (InferenceServerException)."""
    try:
        return infer(server, model, {"INPUT0": np.full((1, 4), value, np.float32)}, protocol, **options)["INPUT0_out"]
    except InferenceServerException as error:
        return error


def hold_one_and_queue(server, model: str, pool: ThreadPoolExecutor, count: int) -> list:
    """Two requests, one held in its execution and one queued (whichever came first runs), then the rest
    of `count`, one at a time, each queued before the next is sent."""
    calls = [pool.submit(request, server, model, value=index) for index in (0, 1)]
    wait_for(lambda: pending(server, model) == 1, "one request held in its execution, the other queued")
    for index in range(2, count):
        calls.append(pool.submit(request, server, model, value=index))
        wait_for(lambda: pending(server, model) == index, f"request {index} queued")
    return calls


def test_full_queue_answers_503_and_grpc_unavailable(policy_server):
    """One request executes (held), two wait: the queue is full, and the next is refused at once."""
    server = policy_server
    with ThreadPoolExecutor(3) as pool:
        hold_executions(server)
        try:
            calls = hold_one_and_queue(server, SMALL_QUEUE, pool, 3)
            refused = post_infer(server, SMALL_QUEUE, json_body({"INPUT0": np.ones((1, 4), np.float32)}))
            unavailable = request(server, SMALL_QUEUE, "grpc")
        finally:
            release_executions(server)
        served = [call.result(timeout=30) for call in calls]
    assert refused.status_code == 503 and refused.json() == {"error": "Exceeds maximum queue size: 2 requests wait at priority level 1"}
    assert isinstance(unavailable, InferenceServerException) and unavailable.status() == "StatusCode.UNAVAILABLE"
    assert "Exceeds maximum queue size" in unavailable.message()
    for value, answer in enumerate(served):
        np.testing.assert_array_equal(answer, np.full((1, 4), value, np.float32))


def test_queue_timeout_over_the_wire(policy_server):
    """A request queued behind a held execution past its 50 ms timeout is refused; the held one is served."""
    server = policy_server
    with ThreadPoolExecutor(2) as pool:
        hold_executions(server)
        try:
            # One executes (held); the other waits past its timeout (too briefly queued to poll for).
            calls = [pool.submit(request, server, TIMEOUT, value=index) for index in (0, 1)]
            timed_out = wait_for(lambda: next((c for c in calls if c.done()), None), "the queued request to time out")
        finally:
            release_executions(server)
        outcomes = [call.result(timeout=30) for call in calls]
    refusal = timed_out.result()
    assert isinstance(refusal, InferenceServerException) and refusal.status() == "503"
    assert "Request timeout expired" in refusal.message()
    (index,) = [index for index, outcome in enumerate(outcomes) if outcome is not refusal]
    np.testing.assert_array_equal(outcomes[index], np.full((1, 4), index, np.float32))


def test_priority_parameter_over_http_and_grpc(policy_server):
    """While the only instance is held in a device call, requests queue one after the other: an ordinary
    one of 6 rows, two ordinary ones of 1 row, then two alarms (priority 1) of 3 rows, one over HTTP, one
    over gRPC. Released, the alarms run first, together ([3, 3]), then the ordinary ones in turn ([6],
    [1, 1]); first come, first served would run [6], [1, 1, 3], [3]."""
    server = policy_server
    sends = [(6, "http", 0), (6, "http", 0), (1, "http", 0), (1, "grpc", 0), (3, "http", 1), (3, "grpc", 1)]
    data = [np.full((rows, 4), index, np.float32) for index, (rows, _, _) in enumerate(sends)]

    def send(index: int):
        rows, protocol, priority = sends[index]
        return infer(server, PRIORITY, {"INPUT0": data[index]}, protocol, priority=priority)["INPUT0_out"]

    before = statistics(server, PRIORITY)
    with ThreadPoolExecutor(len(sends)) as pool:
        hold_executions(server)
        try:
            calls = [pool.submit(send, 0), pool.submit(send, 1)]  # 6 rows each: they cannot share a batch
            wait_for(lambda: pending(server, PRIORITY) == 1, "one held in its execution, the other queued")
            for index in range(2, len(sends)):
                calls.append(pool.submit(send, index))
                wait_for(lambda: pending(server, PRIORITY) == index, f"request {index} queued")
        finally:
            release_executions(server)
        for sent, call in zip(data, calls):
            np.testing.assert_array_equal(call.result(timeout=30), sent)
    after = statistics(server, PRIORITY)
    executed = Counter(executions_by_batch_size(after))
    executed.subtract(executions_by_batch_size(before))
    assert +executed == {6: 3, 2: 1}
    assert after["execution_count"] - before["execution_count"] == 4
    beyond = request(server, PRIORITY, priority=7, value=7.0)  # beyond the 2 levels: the default level, as in Triton
    np.testing.assert_array_equal(beyond, np.full((1, 4), 7.0, np.float32))

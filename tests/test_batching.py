"""Dynamic batching: each caller gets exactly its own rows; batches form as dynamic_batching says.

Batch formation is checked on the core's scheduler in-process (deterministic, with a
recording runner); row routing is checked on the real server under concurrent load.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import (
    copy_model,
    core_request,
    executions_by_batch_size,
    hold_executions,
    infer,
    load_fake_acl,
    pending,
    release_executions,
    start_on_fake_acl,
    start_server,
    statistics,
    stop_server,
    wait_for,
)
from tritonclient.grpc import model_config_pb2 as mc

from kserve_ascend.core.scheduling.batcher import DynamicBatcher
from kserve_ascend.core.scheduling.queue import BatchQueue
from kserve_ascend.core.stats import VersionStats


class RecordingRunner:
    """Runs a batch by echoing each request's inputs; records the row count of every batch."""

    def __init__(self, seconds: float = 0.0):
        self.batches: list[list[int]] = []
        self.seconds = seconds
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()

    def __call__(self, requests, execution=None):
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.batches.append([len(r["x"]) for r in requests])
        time.sleep(self.seconds)
        with self._lock:
            self.active -= 1
        return [{"y": r["x"] * 2} for r in requests]


def run_scheduler(rows: list[int], *, max_batch: int = 8, delay_us: int | None = 100_000, preferred=(), instances: int = 1, seconds: float = 0.0, stagger: float = 0.0, arrivals: list[float] | None = None):
    dynamic = None
    if delay_us is not None:
        dynamic = mc.ModelDynamicBatching(max_queue_delay_microseconds=delay_us, preferred_batch_size=list(preferred))
    runner = RecordingRunner(seconds)
    executors = [ThreadPoolExecutor(1) for _ in range(instances)]

    async def main():
        scheduler = DynamicBatcher([runner] * instances, executors, BatchQueue(max_batch, dynamic), VersionStats())

        async def one(index, count):
            await asyncio.sleep(arrivals[index] if arrivals else stagger * index)
            x = np.full((count, 2), index, dtype=np.int64)
            return await scheduler.submit(core_request({"x": x}, count))

        results = await asyncio.gather(*(one(i, n) for i, n in enumerate(rows)))
        scheduler.close(RuntimeError("closed"))
        return results

    results = asyncio.run(main())
    for executor in executors:
        executor.shutdown()
    for index, (count, result) in enumerate(zip(rows, results)):
        np.testing.assert_array_equal(result["y"], np.full((count, 2), 2 * index))
    return runner


def test_concurrent_requests_fill_batches_up_to_max_batch_size():
    runner = run_scheduler([1] * 10)
    assert runner.batches == [[1] * 8, [1, 1]]


def test_mixed_batch_sizes_never_exceed_max_and_keep_fifo_order():
    runner = run_scheduler([3, 3, 3, 1, 4])
    assert runner.batches == [[3, 3], [3, 1, 4]]
    assert all(sum(batch) <= 8 for batch in runner.batches)


def test_preferred_batch_size_is_sent_without_waiting_for_more():
    # Four requests arrive at once, a fifth 50 ms later; delay 1 s: the preferred 4 goes at once.
    runner = run_scheduler([1, 1, 1, 1, 1], delay_us=1_000_000, preferred=(4,), stagger=0.0)
    assert runner.batches[0] == [1, 1, 1, 1]


@pytest.mark.serial  # arrivals 30 ms apart: a stalled event loop would bunch them
def test_queue_delay_bounds_the_wait_for_a_full_batch():
    # Requests 30 ms apart with a 5 ms delay never meet in one batch.
    runner = run_scheduler([1, 1, 1], delay_us=5_000, stagger=0.03)
    assert runner.batches == [[1], [1], [1]]


@pytest.mark.serial  # arrivals and executions timed in tens of milliseconds
def test_requests_left_over_while_busy_gather_the_next_arrivals():
    # Ten at t=0 and six at t=60 ms; executions take 50 ms, delay 20 ms. The two left out
    # of the first batch wait for the instance, then get a window of their own in which
    # the six join them, as a closed loop of clients needs (not a batch of 2, then one of 6).
    runner = run_scheduler([1] * 16, delay_us=20_000, seconds=0.05, arrivals=[0.0] * 10 + [0.06] * 6)
    assert runner.batches == [[1] * 8, [1] * 8]


def test_without_dynamic_batching_each_request_runs_alone():
    runner = run_scheduler([2, 1, 3], delay_us=None)
    assert runner.batches == [[2], [1], [3]]


def test_instances_run_batches_concurrently_from_one_queue():
    runner = run_scheduler([1] * 6, max_batch=1, delay_us=None, instances=3, seconds=0.05)
    assert runner.most_active == 3
    assert sorted(map(sum, runner.batches)) == [1] * 6


def test_a_failed_execution_fails_only_its_own_batch():
    calls = []

    def runner(requests, execution=None):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("device fell over")
        return [{"y": r["x"]} for r in requests]

    async def main():
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], BatchQueue(2, mc.ModelDynamicBatching(max_queue_delay_microseconds=100_000)), VersionStats())
        x = np.zeros((1, 1))
        results = await asyncio.gather(*(scheduler.submit(core_request({"x": x})) for _ in range(4)), return_exceptions=True)
        scheduler.close(RuntimeError("closed"))
        return results

    results = asyncio.run(main())
    assert calls == [2, 2]
    assert [str(r) for r in results[:2]] == ["device fell over"] * 2
    assert all(isinstance(r, dict) for r in results[2:])


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory):
    """`sim` at 30 ms a batch plus `simple` with dynamic batching: concurrency must batch."""
    repository = tmp_path_factory.mktemp("batching_repo")
    sim = copy_model("sim", repository)
    (sim / "config.pbtxt").write_text((sim / "config.pbtxt").read_text().replace('string_value: "20"', 'string_value: "30"'))
    simple = copy_model("simple", repository)
    (simple / "config.pbtxt").write_text(
        (simple / "config.pbtxt").read_text() + "dynamic_batching { max_queue_delay_microseconds: 20000 }\n"
    )
    server = start_server(repository, repository.parent / "batching.log")
    yield server
    stop_server(server)


def test_concurrent_mixed_batches_get_their_own_rows_over_http_and_grpc(batching_server):
    rows_per_request = [1, 2, 3, 1, 4, 2, 1, 3, 2, 1, 1, 4] * 2

    def http_call(index):
        rows = rows_per_request[index]
        data = (np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 1000 * index)
        with httpclient.InferenceServerClient(batching_server.http) as client:
            tensor = httpclient.InferInput("INPUT0", [rows, 4], "FP32")
            tensor.set_data_from_numpy(data)
            return data, client.infer("sim", [tensor]).as_numpy("OUTPUT0")

    def grpc_call(index):
        rows = rows_per_request[index]
        a = np.full((rows, 16), index, np.int32)
        b = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
        with grpcclient.InferenceServerClient(batching_server.grpc) as client:
            inputs = []
            for name, array in (("INPUT0", a), ("INPUT1", b)):
                tensor = grpcclient.InferInput(name, list(array.shape), "INT32")
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            result = client.infer("simple", inputs)
            return (a + b, a - b), (result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1"))

    with ThreadPoolExecutor(len(rows_per_request)) as pool:
        http_results = list(pool.map(http_call, range(len(rows_per_request))))
        grpc_results = list(pool.map(grpc_call, range(len(rows_per_request))))
    for sent, received in http_results:
        np.testing.assert_array_equal(received, sent)
    for expected, received in grpc_results:
        for want, got in zip(expected, received):
            np.testing.assert_array_equal(got, want)


#: The model whose executions the FAKE pyACL holds: one instance, up to 8 rows, every batch size a gear.
HELD = "held"


@pytest.fixture(scope="module")
def held_server(tmp_path_factory):
    """An .om model on the FAKE pyACL with dynamic batching: its executions can be held in a device call
    while requests queue, so which batches form does not depend on timing."""
    fake_acl = load_fake_acl()
    repository = tmp_path_factory.mktemp("held_repo")
    (repository / HELD / "1").mkdir(parents=True)
    fake_acl.fake_write_om(repository / HELD / "1" / "model.om", [("INPUT0", fake_acl.ACL_FLOAT, [-1, 4])], dynamic_batch=range(1, 9))
    (repository / HELD / "config.pbtxt").write_text(
        f'name: "{HELD}"\nbackend: "ascend"\nmax_batch_size: 8\ndynamic_batching {{ max_queue_delay_microseconds: 100000 }}\n'
    )
    server = start_on_fake_acl(repository, "held")
    yield server
    stop_server(server)


def test_requests_queued_behind_a_held_execution_run_as_exactly_the_batches_expected(held_server):
    """Two full requests (8 rows), one executing (held in its device call), the other queued; then, one
    after the other, requests of 3, 3, 3, 1 and 4 rows queue. Released, the queue runs in order as full
    batches: [8], [3, 3] (a third 3 would pass 8), [3, 1, 4]. Exactly three executions follow the held one,
    and each caller gets its own rows."""
    server = held_server
    rows = [8, 8, 3, 3, 3, 1, 4]
    data = [np.arange(count * 4, dtype=np.float32).reshape(count, 4) + 100 * index for index, count in enumerate(rows)]
    before = statistics(server, HELD)
    with ThreadPoolExecutor(len(rows)) as pool:
        hold_executions(server)
        try:
            calls = [pool.submit(infer, server, HELD, {"INPUT0": data[index]}) for index in (0, 1)]
            wait_for(lambda: pending(server, HELD) == 1, "one full request held in its execution, the other queued")
            for index in range(2, len(rows)):
                calls.append(pool.submit(infer, server, HELD, {"INPUT0": data[index]}))
                wait_for(lambda: pending(server, HELD) == index, f"request {index} queued")
        finally:
            release_executions(server)
        answers = [call.result(timeout=30)["INPUT0_out"] for call in calls]
    for sent, answer in zip(data, answers):
        np.testing.assert_array_equal(answer, sent)
    after = statistics(server, HELD)
    assert after["execution_count"] - before["execution_count"] == 4
    assert after["inference_count"] - before["inference_count"] == sum(rows)
    executed = Counter(executions_by_batch_size(after))
    executed.subtract(executions_by_batch_size(before))
    assert +executed == {8: 3, 6: 1}

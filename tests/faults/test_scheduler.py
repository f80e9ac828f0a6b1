"""Faults inside the scheduler (core/batching.py, core/sequencer.py): each fails only the requests it
concerns, and the scheduler goes on serving.

- a model that does not keep its batch dimension (drops rows it was given) -> 500 `{"error"}`
  / INTERNAL naming the output and the rows, for the requests of that batch; the model serves on
- a runner answering another number of results than requests, or no list -> its batch fails (500)
- a runtime raising SystemExit or another BaseException -> its batch fails (500); the event loop is untouched
- an exception while forming a batch -> the request the batch began with fails (500); the others are served
- an exception while queueing a request (an instance's thread refusing work) -> that request fails (500)
- an exception while answering a batch (statistics) -> that batch fails (500); other batches are answered
- an exception in the cost model after a run -> nothing fails: the batch is answered
- a sequence request whose execution fails -> that request fails; the sequence and its state go on
- a caller cancelled while queued -> it leaves the queue at once (no batch runs it), counted CANCELED
- a caller cancelled while its batch runs -> the batch finishes, the answer is dropped, counted CANCELED
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from conftest import copy_model, core_request, infer, json_body, post_infer, scrape, start_server, stop_server, until
from kserve_ascend.core.contracts import Request, RequestOptions
from kserve_ascend.core.errors import InternalError
from kserve_ascend.core.scheduling import sequences as sequence
from kserve_ascend.core.scheduling.batcher import DynamicBatcher
from kserve_ascend.core.scheduling.queue import BatchQueue
from kserve_ascend.core.scheduling.sequencer import SequenceScheduler
from kserve_ascend.core.stats import RequestTiming, VersionStats

#: Every in-process wait is bounded: a request the scheduler lost would hang the test instead of failing it.
BOUND_S = 10


def echo(requests_, execution=None):
    return [{"y": r["x"]} for r in requests_]


def queue(max_batch: int = 1, delay_us: int = 0) -> BatchQueue:
    return BatchQueue(max_batch, mc.ModelDynamicBatching(max_queue_delay_microseconds=delay_us))


async def submit(scheduler: DynamicBatcher, tag: int):
    """A request tagged `tag`, answered (and so recorded in the statistics) as an edge answers it."""
    request = core_request({"x": np.full((1, 1), tag)})
    outputs = await scheduler.submit(request)
    request.timing.answering()
    request.timing.answered()
    return outputs


def serve(scheduler: DynamicBatcher, tags) -> list:
    """Submits one request per tag at once; each one's output, or its exception."""
    async def all_of():
        return await asyncio.gather(*(submit(scheduler, tag) for tag in tags), return_exceptions=True)

    return asyncio.wait_for(all_of(), BOUND_S)


def tags_of(results) -> list:
    return [int(r["y"][0, 0]) if isinstance(r, dict) else type(r).__name__ for r in results]


# -- in the core


@pytest.mark.parametrize("answer", [lambda rs: echo(rs)[:-1], lambda rs: None], ids=["one short", "no list"])
def test_a_runner_answering_other_than_one_result_per_request_fails_its_batch_only(answer):
    calls = []

    def runner(requests_, execution=None):
        calls.append(len(requests_))
        return answer(requests_) if len(calls) == 1 else echo(requests_)

    async def main():
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue(max_batch=2, delay_us=100_000), VersionStats())
        first = await serve(scheduler, [1, 2])
        return first, await serve(scheduler, [3, 4])

    first, then = asyncio.run(main())
    assert all(isinstance(r, InternalError) and "for a batch of 2 requests" in str(r) for r in first)
    assert tags_of(then) == [3, 4]


def test_a_runtime_raising_a_base_exception_fails_its_batch_and_not_the_event_loop():
    def runner(requests_, execution=None):
        if int(requests_[0]["x"][0, 0]) == 1:
            raise SystemExit(3)  # raised on the event loop, it would stop the server
        return echo(requests_)

    async def main():
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue(), VersionStats())
        return await serve(scheduler, [1, 2])

    results = asyncio.run(main())
    assert isinstance(results[0], InternalError) and str(results[0]) == "the execution raised SystemExit: 3"
    assert tags_of(results[1:]) == [2]


class FormingFails(BatchQueue):
    """A queue whose forming of a batch raises once."""

    failed = False

    def poll(self, idle_since, now):
        if not self.failed:
            self.failed = True
            raise KeyError("a fault of the queue")
        return super().poll(idle_since, now)


def test_a_fault_forming_a_batch_fails_the_request_it_began_with_and_the_instance_serves_on():
    async def main():
        scheduler = DynamicBatcher([echo], [ThreadPoolExecutor(1)], FormingFails(1, mc.ModelDynamicBatching()), VersionStats())
        first = await serve(scheduler, [1, 2, 3])
        then = await serve(scheduler, [4])
        # The instance's thread goes idle just after it has handed its answers over.
        await until(lambda: scheduler._idle, "the instance to go idle")
        return scheduler, first, then

    scheduler, first, then = asyncio.run(main())
    assert isinstance(first[0], InternalError) and "forming a batch failed: KeyError" in str(first[0])
    assert tags_of(first[1:]) == [2, 3] and tags_of(then) == [4]
    assert list(scheduler._idle) == [0] and not scheduler._forming  # idle, and nothing left forming


class RefusesOnce(ThreadPoolExecutor):
    """An instance's thread that refuses its first piece of work."""

    refused = False

    def submit(self, fn, /, *args, **kwargs):
        if not self.refused:
            self.refused = True
            raise RuntimeError("cannot schedule new futures after shutdown")
        return super().submit(fn, *args, **kwargs)


def test_a_fault_queueing_a_request_fails_that_request_only():
    async def main():
        scheduler = DynamicBatcher([echo], [RefusesOnce(1)], queue(), VersionStats())
        with pytest.raises(InternalError, match="queueing the request failed: RuntimeError"):
            await asyncio.wait_for(submit(scheduler, 1), BOUND_S)
        return await serve(scheduler, [2, 3])

    assert tags_of(asyncio.run(main())) == [2, 3]


class AnsweringFailsOnce(VersionStats):
    """Statistics that fail when the first execution is recorded (on the event loop, while answering it)."""

    def record_execution(self, rows, execution):
        if not self.execution_count:
            self.execution_count = 1
            raise ZeroDivisionError("a fault while answering")
        super().record_execution(rows, execution)


def test_a_fault_answering_a_batch_fails_that_batch_and_the_others_are_answered():
    barrier = threading.Barrier(2)

    def runner(requests_, execution=None):
        barrier.wait(BOUND_S)  # both instances finish together: their batches are answered in one go, or two
        return echo(requests_)

    async def main():
        scheduler = DynamicBatcher([runner] * 2, [ThreadPoolExecutor(1) for _ in range(2)], queue(), AnsweringFailsOnce())
        first = await serve(scheduler, [1, 2])
        barrier.reset()
        return first, await serve(scheduler, [3, 4])

    first, then = asyncio.run(main())
    failed = [r for r in first if isinstance(r, Exception)]
    assert len(failed) == 1 and "answering the batch failed: ZeroDivisionError" in str(failed[0])
    assert len(tags_of(r for r in first if not isinstance(r, Exception))) == 1
    assert tags_of(then) == [3, 4]


class ObserveFails(BatchQueue):
    def observe(self, rows, seconds):
        raise ValueError("a fault of the cost model")


def test_a_fault_in_the_cost_model_after_a_run_fails_nothing():
    async def main():
        scheduler = DynamicBatcher([echo], [ThreadPoolExecutor(1)], ObserveFails(2, mc.ModelDynamicBatching()), VersionStats())
        return await serve(scheduler, [1, 2, 3])

    assert tags_of(asyncio.run(main())) == [1, 2, 3]


def test_a_sequence_request_whose_execution_fails_fails_alone_and_the_sequence_goes_on(tmp_path):
    config = mc.ModelConfig()
    text = (
        'name: "acc" max_batch_size: 4 input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]'
        ' output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]'
        ' sequence_batching { control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ] }'
    )
    text_format.Parse(text, config)
    sequence.apply_defaults(config)
    sequences = sequence.SequenceBatching(config, tmp_path)

    def runner(requests_, execution=None):
        if 13 in [int(r["INPUT"][0, 0]) for r in requests_]:
            raise RuntimeError("device fell over")
        return [{"OUTPUT": r["INPUT"]} for r in requests_]

    async def main():
        scheduler = SequenceScheduler(sequences, ["OUTPUT"], [runner], [ThreadPoolExecutor(1)], VersionStats(), [{}])
        results = []
        for value, flags in ((11, {"sequence_start": True}), (13, {}), (17, {}), (19, {"sequence_end": True})):
            options = RequestOptions.parse({"sequence_id": 7, **flags})
            request = Request({"INPUT": np.full((1, 1), value, np.int32)}, 1, (), options, RequestTiming())
            call = scheduler.submit(request)
            try:
                results.append(int((await asyncio.wait_for(call, BOUND_S))["OUTPUT"][0, 0]))
            except RuntimeError as error:
                results.append(str(error))
        return results, scheduler

    results, scheduler = asyncio.run(main())
    assert results == [11, "device fell over", 17, 19]
    assert scheduler.outstanding == 0 and scheduler.in_rotation == 1


def test_a_cancelled_caller_leaves_the_queue_and_one_in_a_running_batch_is_dropped():
    started, release = threading.Event(), threading.Event()
    ran = []

    def runner(requests_, execution=None):
        ran.extend(int(r["x"][0, 0]) for r in requests_)
        started.set()
        release.wait(BOUND_S)
        return echo(requests_)

    stats = VersionStats()

    async def main():
        scheduler = DynamicBatcher([runner], [ThreadPoolExecutor(1)], queue(), stats)
        running = asyncio.ensure_future(submit(scheduler, 1))
        await asyncio.to_thread(started.wait, BOUND_S)  # request 1 runs
        queued = asyncio.ensure_future(submit(scheduler, 2))
        served = asyncio.ensure_future(submit(scheduler, 3))
        await until(lambda: scheduler.queued == 2, "2 and 3 to wait")
        assert scheduler.queue._counts[0] == [2, 2]
        queued.cancel()
        running.cancel()
        await asyncio.gather(queued, running, return_exceptions=True)
        assert scheduler.queue._counts[0] == [1, 1]  # 2 left the queue when its caller did
        release.set()
        answer = await asyncio.wait_for(served, BOUND_S)
        return answer, running.cancelled() and queued.cancelled()

    answer, cancelled = asyncio.run(main())
    assert cancelled and tags_of([answer]) == [3]
    assert ran == [1, 3]  # 1 ran to its end; 2 never ran
    assert stats.failures["CANCELED"] == 2 and stats.success.count == 1 and stats.execution_count == 2


# -- on the real server


def write_row_dropping_model(repository) -> None:
    """`drops`: y = the rows of x whose sum is positive (Compress): an echo, but for the rows it drops."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["x"], ["sums"], keepdims=0, axes=[1]),
            helper.make_node("Greater", ["sums", "zero"], ["kept"]),
            helper.make_node("Compress", ["x", "kept"], ["y"], axis=0),
        ],
        "drops",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    (repository / "drops" / "1").mkdir(parents=True)
    onnx.save(model, repository / "drops" / "1" / "model.onnx")
    (repository / "drops" / "config.pbtxt").write_text(
        'name: "drops"\nbackend: "ascend"\nmax_batch_size: 8\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\noutput [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    )


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def server(request, tmp_path_factory):
    repository = tmp_path_factory.mktemp("faults_scheduler_repo")
    write_row_dropping_model(repository)
    copy_model("simple", repository)
    server = start_server(repository, repository.parent / f"faults_scheduler_{request.param}.log", workers=request.param)
    yield server
    stop_server(server)


def failures(server, model: str) -> dict[str, float]:
    return scrape(server).by("reason", "nv_inference_request_failure", model=model)


def test_a_model_that_does_not_keep_its_batch_fails_those_requests_and_serves_on(server):
    kept = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32)
    answer = post_infer(server, "drops", json_body({"x": kept}))
    assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [1, 2, 3, 4, 5, 6, 7, 8]
    before = failures(server, "drops")

    dropped = post_infer(server, "drops", json_body({"x": np.array([[1, 2, 3, 4], [-1, -2, -3, -4]], np.float32)}))
    expected = "model.onnx answered 1 rows of output 'y' for a batch of 2: the model does not keep the batch dimension"
    assert dropped.status_code == 500 and dropped.json() == {"error": expected}
    with pytest.raises(InferenceServerException) as refused:
        infer(server, "drops", {"x": np.zeros((1, 4), np.float32)}, "grpc")
    assert refused.value.status() == "StatusCode.INTERNAL" and "answered 0 rows of output 'y' for a batch of 1" in refused.value.message()
    assert failures(server, "drops")["BACKEND"] - before["BACKEND"] == 2

    # The model and the server serve on.
    assert post_infer(server, "drops", json_body({"x": kept})).status_code == 200
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16} for n in ("INPUT0", "INPUT1")]}
    assert post_infer(server, "simple", body).status_code == 200
    assert expected in server.output()  # logged

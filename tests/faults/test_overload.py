"""Overload: more requests than the models can serve, and requests that cannot be served in time.

- 1,000 concurrent HTTP connections on `simple` and on `sim` (queue policy max_queue_size) -> every
  request answered 200, or 503 `{"error": "Exceeds maximum queue size..."}` (retry); no 500, no
  connection dropped, the server's memory bounded, and it serves on
- a request whose queue timeout (the policy's, or its own `timeout` where the policy allows it) the
  requests ahead of it cannot meet, as the queue's cost model predicts -> refused on arrival with 503 /
  UNAVAILABLE `Request cannot be served within its timeout: N requests ahead, predicted X ms > Y ms`,
  counted REJECTED, rather than left to time out in the queue
- the same before any execution gave the model a cost, or under a DELAY policy -> admitted
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import re
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from conftest import copy_model, scrape, start_server, stop_server, wait_for
from kserve_ascend.core.scheduling.adaptive import CostModel
from kserve_ascend.core.scheduling.queue import BatchQueue, Pending
from kserve_ascend.core.errors import Unavailable

CONNECTIONS = 1000
LOAD_S = 3.0
#: What 1,000 open connections and a full queue may add to the server's resident memory (all its
#: processes). Measured: tens of MiB; a server that buffered without bound would pass it in seconds.
RSS_GROWTH_BOUND_MB = 300
QUEUE_POLICY = "default_queue_policy { max_queue_size: 64 }"


# -- admission, in the core


def batch_queue(policy: str, max_batch: int = 1) -> BatchQueue:
    return BatchQueue(max_batch, text_format.Parse(policy, mc.ModelDynamicBatching()))


def pending(rows: int = 1, level: int = 0) -> Pending:
    return Pending({}, rows, concurrent.futures.Future(), time.monotonic(), (), level)  # the queue asks it done() only


TIMEOUT_250_MS = "default_queue_policy { default_timeout_microseconds: 250000 allow_timeout_override: true }"


def fill(queue: BatchQueue, count: int, level: int = 0) -> list[Pending]:
    queued = [pending(level=level) for _ in range(count)]
    for request in queued:
        queue.put(request, 60_000_000)  # its own timeout: a minute
    return queued


def test_no_request_is_refused_before_an_execution_gave_a_cost():
    queue = batch_queue(TIMEOUT_250_MS)
    fill(queue, 100)
    assert queue.put(pending()) == 0.25


def test_a_request_the_queue_ahead_cannot_serve_in_time_is_refused_with_the_prediction():
    queue = batch_queue(TIMEOUT_250_MS)
    queue.observe(1, 0.100)  # one execution of one row: 100 ms
    fill(queue, 2)
    assert queue.put(pending()) == 0.25  # 2 ahead: 200 ms
    with pytest.raises(Unavailable) as refused:
        queue.put(pending())  # 3 ahead: 300 ms
    assert str(refused.value) == "Request cannot be served within its timeout: 3 requests ahead, predicted 300 ms > 250 ms"
    assert queue.put(pending(), 400_000) == 0.4  # its own timeout, which the policy allows, is longer
    assert queue.put(pending(), instances=2) == 0.25  # two instances: 4 ahead take two rounds


def test_admission_counts_the_full_batches_ahead_at_its_level_and_the_more_urgent_ones():
    urgent_policy = "priority_queue_policy { key: 1 value { default_timeout_microseconds: 250000 } }"
    queue = batch_queue(f"priority_levels: 2 default_priority_level: 2 {urgent_policy}", max_batch=4)
    queue.observe(4, 0.100)  # a full batch: 100 ms
    fill(queue, 40, level=1)  # less urgent (and without a timeout): never ahead of an urgent one
    fill(queue, 12, level=0)  # the last of these had 11 ahead: two full batches, 200 ms
    with pytest.raises(Unavailable, match="^Request cannot be served within its timeout: 12 requests ahead, predicted 300 ms > 250 ms$"):
        queue.put(pending(level=0))
    assert queue.put(pending(level=1)) == 0  # no timeout: admitted whatever waits


def test_a_request_whose_caller_left_is_not_ahead_any_more():
    queue = batch_queue(TIMEOUT_250_MS)
    queue.observe(1, 0.100)
    gone = fill(queue, 3)
    with pytest.raises(Unavailable):
        queue.put(pending())
    gone[0].future.cancel()
    queue.withdraw(gone[0])
    assert queue.put(pending()) == 0.25


def test_under_delay_a_request_is_never_refused_for_its_timeout():
    queue = batch_queue("default_queue_policy { default_timeout_microseconds: 1000 timeout_action: DELAY }")
    queue.observe(1, 0.100)
    fill(queue, 50)
    assert queue.put(pending()) == 0.001


def test_the_cost_model_errs_low_while_it_has_seen_one_batch_size():
    cost = CostModel()
    assert cost.estimate(8) is None
    for _ in range(3):
        cost.observe(8, 0.028)  # what full batches cost under overload
    assert cost.predicted(8) is None  # no line through one point...
    assert cost.estimate(8) == pytest.approx(0.028) and cost.estimate(16) == pytest.approx(0.028)
    assert cost.estimate(4) == pytest.approx(0.014)  # ...but one through the origin bounds it from below
    cost.observe(1, 0.021)
    assert 0.021 < cost.estimate(4) < 0.028  # two sizes: the fitted line


# -- on the real server


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def server(request, tmp_path_factory):
    """`simple` and `sim` with a queue of 64; `sim_deadline`: 100 ms a request, a 300 ms queue timeout."""
    repository = tmp_path_factory.mktemp("overload_repo")
    simple = copy_model("simple", repository)
    (simple / "config.pbtxt").write_text((simple / "config.pbtxt").read_text() + f"dynamic_batching {{ {QUEUE_POLICY} }}\n")
    sim = copy_model("sim", repository)
    text = (sim / "config.pbtxt").read_text()
    delay = "max_queue_delay_microseconds: 5000"
    (sim / "config.pbtxt").write_text(text.replace(delay, f"{delay} {QUEUE_POLICY}"))
    deadline = copy_model("sim", repository, "sim_deadline")
    text = (deadline / "config.pbtxt").read_text().replace("max_batch_size: 8", "max_batch_size: 1")
    text = text.replace('string_value: "20"', 'string_value: "100"').replace('string_value: "1"', 'string_value: "0"')
    text = text.replace(
        "dynamic_batching { max_queue_delay_microseconds: 5000 }",
        "dynamic_batching { default_queue_policy { default_timeout_microseconds: 300000 allow_timeout_override: true } }",
    )
    (deadline / "config.pbtxt").write_text(text)
    server = start_server(repository, repository.parent / f"overload_{request.param}.log", workers=request.param)
    yield server
    stop_server(server)


BODIES = {
    "simple": {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))} for n in ("INPUT0", "INPUT1")]},
    "sim": {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
}


def raise_open_files_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= wanted, "too few file descriptors for the test's connections"


async def closed_loop(url: str, body: bytes, connections: int, seconds: float) -> tuple[collections.Counter, set, list]:
    """`connections` clients on as many connections, each sending its next request once answered, for `seconds`.

    Returns the count of each status, the error texts of the answers that were not 200, and
    the exceptions of the connections that failed.
    """
    statuses, errors = collections.Counter(), set()
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        deadline = asyncio.get_running_loop().time() + seconds

        async def client():
            while asyncio.get_running_loop().time() < deadline:
                async with session.post(url, data=body, headers={"content-type": "application/json"}) as response:
                    answer = await response.read()
                statuses[response.status] += 1
                if response.status != 200:
                    errors.add(json.loads(answer)["error"].split(":")[0])

        outcomes = await asyncio.gather(*(client() for _ in range(connections)), return_exceptions=True)
    return statuses, errors, [o for o in outcomes if isinstance(o, BaseException)]


def rss_mb(process: psutil.Process) -> float:
    members = [process, *process.children(recursive=True)]
    return sum(m.memory_info().rss for m in members) / 2**20


@pytest.mark.parametrize("model", ["simple", "sim"])
def test_a_thousand_connections_are_answered_with_success_or_503_in_bounded_memory(server, model):
    raise_open_files_limit(CONNECTIONS + 256)
    process = psutil.Process(server.process.pid)
    baseline, peak, stop = rss_mb(process), [0.0], threading.Event()

    def sample():
        while not stop.wait(0.2):
            peak[0] = max(peak[0], rss_mb(process))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        url = f"{server.url}/v2/models/{model}/infer"
        statuses, errors, failed = asyncio.run(closed_loop(url, json.dumps(BODIES[model]).encode(), CONNECTIONS, LOAD_S))
    finally:
        stop.set()
        sampler.join()
    assert not failed, f"{len(failed)} connections failed, e.g. {failed[0]!r}"
    assert set(statuses) <= {200, 503} and statuses[200] and sum(statuses.values()) >= CONNECTIONS, statuses
    assert errors <= {"Exceeds maximum queue size"}, errors
    assert peak[0] - baseline < RSS_GROWTH_BOUND_MB, f"RSS grew from {baseline:.0f} to {peak[0]:.0f} MiB"
    assert server.process.poll() is None and "Traceback" not in server.output()
    assert requests.post(url, json=BODIES[model], timeout=30).status_code == 200


def rejected(server, model: str) -> float:
    return scrape(server)("nv_inference_request_failure", model=model, reason="REJECTED")


def test_a_request_that_cannot_be_served_within_its_timeout_is_refused_on_arrival(server):
    url = f"{server.url}/v2/models/sim_deadline/infer"
    body = BODIES["sim"]
    assert requests.post(url, json=body, timeout=30).status_code == 200  # the model now has a cost: 100 ms
    before = rejected(server, "sim_deadline")
    patient = {**body, "parameters": {"timeout": 30_000_000}}  # 30 s: admitted behind any of these
    with ThreadPoolExecutor(16) as pool:
        queued = [pool.submit(requests.post, url, json=patient, timeout=60) for _ in range(16)]
        # 800 ms of work ahead of the next request.
        wait_for(lambda: scrape(server)("nv_inference_pending_request_count", model="sim_deadline") >= 8, "eight requests queued", server=server)
        refused = requests.post(url, json=body, timeout=30)
        with grpcclient.InferenceServerClient(server.grpc) as client:
            tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
            with pytest.raises(InferenceServerException) as unavailable:
                client.infer("sim_deadline", [tensor])
        answers = [f.result() for f in queued]
    reason = r"Request cannot be served within its timeout: \d+ requests ahead, predicted \d+ ms > 300 ms"
    assert refused.status_code == 503 and re.fullmatch(reason, refused.json()["error"]), refused.json()
    assert unavailable.value.status() == "StatusCode.UNAVAILABLE" and re.fullmatch(reason, unavailable.value.message())
    assert [a.status_code for a in answers] == [200] * 16  # the patient ones were all served
    assert rejected(server, "sim_deadline") - before == 2

"""Prometheus metrics of the KServe server, scraped as Prometheus does and parsed with
prometheus_client's own parser: the counts match the requests sent, on the HTTP port's
/metrics and on --metrics_port alike, and agree with the statistics extension.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import (
    Metrics,
    copy_model,
    fake_acl_env,
    hold_executions,
    json_body,
    load_fake_acl,
    post_infer,
    release_executions,
    scrape,
    start_on_fake_acl,
    start_server,
    stop_server,
    wait_for,
)
from tritonclient.grpc import model_config_pb2 as mc

from kserve_ascend.core.execution.runtimes.acl import AclRuntime

# One instance busy 2 s per request, one request may wait, no batching: of 4 concurrent
# requests, one runs, one waits and the rest are refused with "Exceeds maximum queue size".
SLOW_CONFIG = """
name: "slow"
backend: "ascend"
max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { default_queue_policy { max_queue_size: 1 } }
parameters { key: "sim_fixed_ms" value: { string_value: "2000" } }
"""


def sim_inputs(module, rows: int):
    tensor = module.InferInput("INPUT0", [rows, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((rows, 4), np.float32))
    return [tensor]


def simple_inputs(module):
    tensors = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in tensors:
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    return tensors


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("metrics_repo")
    copy_model("simple", repository)
    copy_model("sim", repository)
    (copy_model("sim", repository, "slow") / "config.pbtxt").write_text(SLOW_CONFIG)
    server = start_server(repository, repository.parent / "metrics.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def sent(metrics_server):
    """Sends known traffic; returns what the clients saw per model, and the queue depth seen meanwhile."""
    server = metrics_server
    seen = {"simple": {"success": 0, "rows": 0}, "sim": {"success": 0, "rows": 0}, "slow": {"success": 0, "rows": 0}}

    def succeeded(model: str, rows: int) -> None:
        seen[model]["success"] += 1
        seen[model]["rows"] += rows

    with httpclient.InferenceServerClient(server.http) as client:
        for _ in range(4):
            client.infer("simple", simple_inputs(httpclient))
            succeeded("simple", 1)
    with grpcclient.InferenceServerClient(server.grpc) as client:
        for _ in range(2):
            client.infer("simple", simple_inputs(grpcclient))
            succeeded("simple", 1)
        # One execution of exactly 3 rows, then 6 single rows sent at once, which the queue batches.
        for rows in (1, 3):
            client.infer("sim", sim_inputs(grpcclient, rows))
            succeeded("sim", rows)
        answers: queue.Queue = queue.Queue()
        for _ in range(6):
            client.async_infer("sim", sim_inputs(grpcclient, 1), callback=lambda result, error: answers.put(error))
        assert [answers.get(timeout=30) for _ in range(6)] == [None] * 6
        for _ in range(6):
            succeeded("sim", 1)

    # The slow model: four at once; one runs, at most one waits, the rest are refused.
    body = json_body({"INPUT0": np.array([[1, 2, 3, 4]], np.float32)})
    with ThreadPoolExecutor(4) as pool:
        statuses = [answer.status_code for answer in pool.map(lambda _: post_infer(server, "slow", body), range(4))]
    for status in statuses:
        if status == 200:
            succeeded("slow", 1)
    seen["slow"]["rejected"] = statuses.count(503)
    assert sorted(set(statuses)) == [200, 503], statuses
    return seen


@pytest.fixture(scope="module", params=["http_port", "metrics_port"])
def metrics(request, metrics_server, sent) -> Metrics:
    """What Prometheus reads after the traffic, from /metrics of the HTTP port or of --metrics_port."""
    return scrape(metrics_server, getattr(metrics_server, request.param))


@pytest.mark.parametrize("model", ["simple", "sim", "slow"])
def test_request_counts_match_the_requests_sent(metrics, sent, model):
    successes = sent[model]["success"]
    rejected = sent[model].get("rejected", 0)
    labels = {"model": model, "version": "1"}
    assert metrics("nv_inference_request_success", **labels) == successes
    assert metrics("nv_inference_count", **labels) == sent[model]["rows"]
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        expected = rejected if reason == "REJECTED" else 0
        assert metrics("nv_inference_request_failure", reason=reason, **labels) == expected
        assert metrics("infer_request_failure_count", reason=reason, **labels) == expected
    assert metrics("infer_request_count", **labels) == successes + rejected
    assert metrics("inference_queue_depth", **labels) == metrics("nv_inference_pending_request_count", **labels) == 0
    # Triton's sample names exactly, with no `_total` suffix.
    assert {"nv_inference_request_success", "nv_inference_exec_count", "nv_inference_request_duration_us",
            "nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
            "nv_inference_compute_output_duration_us"} <= {s.name for s in metrics.samples}


@pytest.mark.parametrize("model", ["simple", "sim", "slow"])
def test_latency_histogram_counts_every_successful_request(metrics, sent, model):
    labels = {"model": model, "version": "1"}
    buckets = metrics.buckets("inference_latency_seconds", **labels)
    counts = [buckets[bound] for bound in sorted(buckets)]
    assert counts == sorted(counts)  # cumulative
    assert buckets[float("inf")] == metrics("inference_latency_seconds_count", **labels) == sent[model]["success"]
    # The sum is the request duration Triton's counter reports, in seconds.
    duration_us = metrics("nv_inference_request_duration_us", **labels)
    assert metrics("inference_latency_seconds_sum", **labels) == pytest.approx(duration_us / 1e6, abs=1e-6)
    if model == "slow":  # each ran for 2 s of simulated device time: none in the buckets below
        assert buckets[1.0] == 0


def test_batch_size_histogram_reflects_batching(metrics, sent):
    labels = {"model": "sim", "version": "1"}
    buckets = metrics.buckets("batch_size_distribution", **labels)
    executions = metrics("nv_inference_exec_count", **labels)
    assert buckets[float("inf")] == metrics("batch_size_distribution_count", **labels) == executions
    assert metrics("batch_size_distribution_sum", **labels) == sent["sim"]["rows"]
    # The 3-row request ran as one execution of at least 3 rows: above the 2 bucket.
    assert buckets[2.0] < executions
    assert executions < sent["sim"]["success"]  # 8 requests did not take 8 executions
    simple = metrics.buckets("batch_size_distribution", model="simple", version="1")
    assert simple[1.0] == simple[float("inf")] == sent["simple"]["success"]  # one at a time: batches of 1


@pytest.fixture(scope="module")
def held_server(tmp_path_factory):
    """`held`: an .om model on the FAKE pyACL, one request at a time; its executions can be held in a
    device call (hold_executions)."""
    repository = tmp_path_factory.mktemp("held_metrics_repo")
    (repository / "held" / "1").mkdir(parents=True)
    fake.fake_write_om(repository / "held" / "1" / "model.om", [("INPUT0", fake.ACL_FLOAT, [1, 4])])
    (repository / "held" / "config.pbtxt").write_text('name: "held"\nbackend: "ascend"\nmax_batch_size: 1\n')
    server = start_on_fake_acl(repository, "held_metrics")
    yield server
    stop_server(server)


def test_queue_depth_counts_the_requests_waiting_for_the_busy_instance(held_server):
    """Three requests at once: one executes (held in its device call), two wait. The queue depth, and
    Triton's pending count, are 2 (the executing one is not counted), and 0 once all are answered."""
    server = held_server
    body = json_body({"INPUT0": np.array([[1, 2, 3, 4]], np.float32)})

    def depths() -> tuple[float, float]:
        metrics = scrape(server, server.http_port)
        return metrics("inference_queue_depth", model="held"), metrics("nv_inference_pending_request_count", model="held")

    assert depths() == (0, 0)
    with ThreadPoolExecutor(3) as pool:
        hold_executions(server)
        try:
            calls = [pool.submit(post_infer, server, "held", body) for _ in range(3)]
            wait_for(lambda: depths() == (2, 2), "one request executing, two waiting")
        finally:
            release_executions(server)
        answers = [call.result() for call in calls]
    assert [answer.status_code for answer in answers] == [200] * 3
    assert depths() == (0, 0)


def test_statistics_extension_agrees_with_the_metrics(metrics_server, metrics):
    statistics = requests.get(f"{metrics_server.url}/v2/models/stats", timeout=10).json()["model_stats"]
    assert {s["name"] for s in statistics} == {"simple", "sim", "slow"}
    for stats in statistics:
        labels = {"model": stats["name"], "version": stats["version"]}
        inference = stats["inference_stats"]
        assert metrics("nv_inference_request_success", **labels) == inference["success"]["count"]
        assert metrics("infer_request_count", **labels) == inference["success"]["count"] + inference["fail"]["count"]
        assert metrics("nv_inference_count", **labels) == stats["inference_count"]
        assert metrics("nv_inference_exec_count", **labels) == stats["execution_count"]
        assert metrics("nv_inference_request_duration_us", **labels) == inference["success"]["ns"] // 1000
        assert metrics("nv_inference_queue_duration_us", **labels) == inference["queue"]["ns"] // 1000
        for phase in ("input", "infer", "output"):
            assert metrics(f"nv_inference_compute_{phase}_duration_us", **labels) == inference[f"compute_{phase}"]["ns"] // 1000
        buckets = metrics.buckets("batch_size_distribution", **labels)
        for bound, count in buckets.items():
            assert count == sum(b["compute_infer"]["count"] for b in stats["batch_stats"] if b["batch_size"] <= bound)


def test_no_npu_utilization_where_no_runtime_reads_a_device(metrics):
    # onnxruntime on the CPU and the simulated device cannot tell: the metric is absent, not 0.
    assert "npu_utilization_percent" not in metrics.families


# ---- NPU utilization through the FAKE pyACL ------------------------------------------------




fake = load_fake_acl()


def write_om_model(repository, name: str, config: str):
    model = repository / name
    (model / "1").mkdir(parents=True)
    fake.fake_write_om(model / "1" / "model.om", [("images", fake.ACL_FLOAT, [-1, 3, 8, 8])], dynamic_batch=[1, 2, 4])
    (model / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: 4\n{config}')


@pytest.fixture(scope="module")
def om_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("om_metrics_repo")
    # Two instances on NPU 1; on NPU 0 the ONNX model (which cannot tell) and an .om model that can.
    write_om_model(
        repository,
        "detector",
        'instance_group [ { count: 2 kind: KIND_MODEL } ]\nparameters { key: "device_ids" value: { string_value: "1" } }\n',
    )
    copy_model("simple", repository)
    write_om_model(repository, "tracker", "")
    env = fake_acl_env()
    server = start_server(repository, repository.parent / "om_metrics.log", "--metrics_port", "0", env=env)
    yield server
    stop_server(server)


def test_npu_utilization_is_read_from_each_device_once(om_server):
    samples = scrape(om_server, om_server.http_port).families["npu_utilization_percent"].samples
    assert sorted((s.labels["device"], s.value) for s in samples) == [("0", 37.0), ("1", 37.0)]  # FAKE_UTILIZATION's Cube


def test_metrics_port_zero_serves_metrics_on_the_http_port_only(om_server):
    assert scrape(om_server, om_server.http_port)("nv_inference_request_success", model="detector") == 0
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{om_server.metrics_port}/metrics", timeout=5)


@pytest.fixture
def om_runtime(tmp_path):
    fake.fake_reset()
    path = fake.fake_write_om(tmp_path / "model.om", [("x", fake.ACL_FLOAT, [2, 3])])
    runtime = AclRuntime(path, 3, mc.ModelConfig(), acl=fake)
    yield runtime
    runtime.close()
    assert fake.fake_leaks() == {}


@pytest.mark.parametrize(
    "rates, percent",
    [
        ({}, 37.0),  # Cube only, Vector reads -1
        ({"cube_utilization": 20, "vector_utilization": 65}, 65.0),  # the busier unit
        ({"cube_utilization": -1, "vector_utilization": -1}, None),  # nothing measured
    ],
)
def test_acl_runtime_reads_ai_core_utilization_of_its_device(om_runtime, rates, percent):
    fake.fake_set_utilization(3, **rates)
    assert om_runtime.utilization() == percent
    assert fake.fake_calls()[-1].name == "acl.rt.get_device_utilization_rate"
    assert fake.fake_calls()[-1].args == (3,)


def test_acl_runtime_utilization_is_none_when_the_query_fails_or_the_model_is_unloaded(om_runtime):
    fake.fake_inject("acl.rt.get_device_utilization_rate", fake.ACL_ERROR_RT_INVALID_DEVICEID)
    assert om_runtime.utilization() is None
    om_runtime.close()
    assert om_runtime.utilization() is None

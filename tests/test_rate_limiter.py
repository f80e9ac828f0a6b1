"""Triton's rate limiter (`--rate_limit execution_count`, `--rate_limit_resource`) on real servers.

Two sim models whose instances need the one resource R (count 1, the most any instance needs)
never execute at the same time, nor do two instances of one model: the `execute` spans the server
exports over OTLP never overlap (with `--rate_limit off` they do). Saturated, the priority 1 model
runs about twice as often as the priority 2 one, as under real Triton 2.51's own rate limiter with
the `ascend` backend. A resource is per NPU unless global; a sequence model's instances take their
turns too, and a decoupled model's, for their whole stream (as in Triton 2.51). A version leaving service, or an instance whose execution hung, leaves its resources to
the others. A model needing more than the server has is refused at load in Triton's words
(conformance/cases/test_rate_limiter.py checks the same against real Triton 2.51).
"""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
import requests
from tritonclient.grpc import service_pb2_grpc

from conftest import (
    attributes,
    copy_model,
    infer,
    load_fake_acl,
    otel_env,
    post_infer,
    start_on_fake_acl,
    start_server,
    start_triton,
    statistics,
    stop_server,
    wait_for,
    write_faults,
)
from conformance.harness import repeat_request, response_outputs
from test_device_health import IMAGES

ROW = {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}


def sim_config(name: str, resources: str, priority: int = 1, instances: int = 1, fixed_ms: int = 10, npus: str = "0") -> str:
    """A sim model (no batching: one request an execution) whose instances, spread over `npus`, have a rate_limiter."""
    return f"""
name: "{name}"
backend: "ascend"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_MODEL count: {instances} rate_limiter {{ resources [ {resources} ] priority: {priority} }} }} ]
parameters {{ key: "sim_fixed_ms" value: {{ string_value: "{fixed_ms}" }} }}
parameters {{ key: "device_ids" value: {{ string_value: "{npus}" }} }}
"""


def add_model(repository, name: str, config: str) -> None:
    """model_repository's sim model, as `name`, with its own config."""
    (copy_model("sim", repository, name) / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def shared_repository(tmp_path_factory):
    """`first` (priority 1) and `second` (priority 2), two instances each, each instance needing one R.

    Two each, so that when R frees, instances of both models wait for it (with one each, the one that
    just ran is not waiting yet, and the models simply alternate, in Triton too)."""
    repository = tmp_path_factory.mktemp("repository")
    add_model(repository, "first", sim_config("first", '{ name: "R" count: 1 }', priority=1, instances=2))
    add_model(repository, "second", sim_config("second", '{ name: "R" count: 1 }', priority=2, instances=2))
    # An instance on each of NPUs 0 and 1, needing one N of its NPU, or the server's one global G.
    add_model(repository, "per_npu", sim_config("per_npu", '{ name: "N" count: 1 }', instances=2, npus="0,1"))
    add_model(repository, "global", sim_config("global", '{ name: "G" count: 1 global: true }', instances=2, npus="0,1"))
    # A sequence model (its own batcher per instance) needing R too.
    sequence = copy_model("sequence_accumulator", repository) / "config.pbtxt"
    sequence.write_text(sequence.read_text().replace(
        "instance_group [ { kind: KIND_CPU count: 1 } ]",
        'instance_group [ { kind: KIND_CPU count: 2 rate_limiter { resources [ { name: "R" count: 1 } ] } } ]',
    ))
    return repository


def start_limited(repository, log, collector, *flags: str, workers: int = 1):
    return start_server(
        repository, log, "--enable_tracing", "--model_control_mode", "explicit", "--load_model", "*", *flags,
        env=otel_env(collector), workers=workers,
    )


@pytest.fixture(scope="module", params=[1, 2], ids=["one_process", "two_workers"])
def limited(request, shared_repository, tmp_path_factory, collector):
    server = start_limited(
        shared_repository, tmp_path_factory.mktemp("logs") / "server.log", collector, "--rate_limit", "execution_count",
        workers=request.param,
    )
    yield server
    stop_server(server)


def post(server, model: str) -> int:
    return requests.post(f"{server.url}/v2/models/{model}/infer", json={"inputs": [ROW]}, timeout=30).status_code


def executions(collector, models=("first", "second")) -> dict[str, list[tuple[int, int]]]:
    """The (start, end) of every `execute` span of each model, in ns of the server's clock."""
    spans = {model: [] for model in models}
    for span in collector.named("execute"):
        model = attributes(span)["model.name"]
        if model in spans:
            spans[model].append((span.start_time_unix_nano, span.end_time_unix_nano))
    return spans


def overlaps(spans: dict[str, list[tuple[int, int]]]) -> list:
    """Executions (of either model, on any instance) that began before the one before them had ended."""
    ordered = sorted(span for model in spans.values() for span in model)
    return [(before, after) for before, after in itertools.pairwise(ordered) if after[0] < before[1]]


def run_both_at_once(server, collector, models=("first", "second"), each: int = 12) -> dict[str, list[tuple[int, int]]]:
    """`each` concurrent requests to each model, all answered 200; the executions the server traced."""
    collector.clear()
    with futures.ThreadPoolExecutor(len(models) * each) as pool:
        codes = list(pool.map(lambda model: post(server, model), list(models) * each))
    assert codes == [200] * (len(models) * each)

    def traced():
        spans = executions(collector, models)
        return spans if all(len(s) >= each for s in spans.values()) else None

    return wait_for(traced, "the execute spans of every request", timeout=15)


def test_models_sharing_one_resource_never_execute_at_once(limited, collector):
    spans = run_both_at_once(limited, collector)
    assert overlaps(spans) == []


def test_a_resource_is_per_npu_unless_global(limited, collector):
    """One N per NPU: the instances on NPUs 0 and 1 run at once. One global G: they take turns."""
    assert overlaps(run_both_at_once(limited, collector, ("per_npu",))) != []
    assert overlaps(run_both_at_once(limited, collector, ("global",))) == []


def test_a_sequence_model_runs_through_the_limiter(limited, collector):
    """Two sequences at once on `sequence_accumulator`'s two instances, which need R as `first` does: each
    keeps its running sum, and no two executions overlap."""
    collector.clear()

    def sequence(correlation_id: int) -> list[int]:
        sums = []
        for index, value in enumerate((1, 2, 3)):
            outputs = infer(
                limited, "sequence_accumulator", {"INPUT": np.array([[value]], np.int32)}, sequence_id=correlation_id,
                sequence_start=index == 0, sequence_end=index == 2,
            )
            sums.append(int(outputs["OUTPUT"][0][0]))
        return sums

    with futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(sequence, 1), pool.submit(sequence, 2), pool.submit(post, limited, "first")]
        assert [done.result() for done in running] == [[1, 3, 6], [1, 3, 6], 200]
    wait_for(lambda: len(collector.named("execute")) >= 7, "the execute spans of the 7 requests")
    assert overlaps(executions(collector, ("sequence_accumulator", "first"))) == []


def test_without_the_limiter_they_do(shared_repository, tmp_path, collector):
    """The measurement above can fail: with --rate_limit off (the default) the same load overlaps."""
    server = start_limited(shared_repository, tmp_path / "server.log", collector)
    try:
        assert overlaps(run_both_at_once(server, collector)) != []
    finally:
        stop_server(server)


def saturated_executions(server) -> dict[str, int]:
    """Executions of `first` and `second` while four clients each keep them saturated (a closed loop), 90 in all."""
    stop = threading.Event()

    def client(model: str) -> None:
        while not stop.is_set():
            assert post(server, model) == 200

    def count(model: str) -> int:
        return int(statistics(server, model)["execution_count"])

    before = {model: count(model) for model in ("first", "second")}
    with futures.ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(client, model) for model in ("first", "second") * 4]
        try:
            wait_for(lambda: sum(count(m) - before[m] for m in before) >= 90, "90 executions", timeout=30)
        finally:
            stop.set()
        for done in clients:
            done.result()
    return {model: count(model) - before[model] for model in before}


def test_priority_two_gets_about_half_the_turns_of_priority_one(limited):
    ran = saturated_executions(limited)
    # 2:1 as Triton schedules them; 1:1 without the limiter or without priorities.
    assert ran["first"] > 1.5 * ran["second"], ran


def test_tritons_own_limiter_gives_the_ascend_backend_the_same_shares(shared_repository, tmp_path):
    """Real Triton 2.51, --rate-limit=execution_count, the same two models on the `ascend` backend and the
    same load: its own rate limiter schedules them 2:1 too (measured 253:127; 751:750 with --rate-limit=off)."""
    repository = tmp_path / "repository"
    for model in ("first", "second"):
        shutil.copytree(shared_repository / model, repository / model)
    triton = start_triton(repository, tmp_path, "--rate-limit=execution_count")
    try:
        ran = saturated_executions(triton)
    finally:
        stop_server(triton)
    assert ran["first"] > 1.5 * ran["second"], ran


def test_a_retired_version_leaves_the_limiter(limited, collector):
    """`first` reloaded needing 2 R (the server then has 2: the most any instance needs), then back to 1:
    once the version needing 2 retires, R counts 1 again and the two models take turns again."""
    config = json.loads(requests.get(f"{limited.url}/v2/models/first/config", timeout=10).text)
    config["instance_group"][0]["rate_limiter"]["resources"][0]["count"] = 2
    load = f"{limited.url}/v2/repository/models/first/load"
    assert requests.post(load, json={"parameters": {"config": json.dumps(config)}}, timeout=30).status_code == 200
    assert requests.post(load, json={}, timeout=30).status_code == 200  # config.pbtxt again: 1 R
    assert overlaps(run_both_at_once(limited, collector)) == []


def test_reload_and_unload_under_load_lose_no_request(limited):
    """Clients on both models while `first` reloads (a new version registers, the old one retires) and
    `second` unloads: every request is answered, `first` by 200 throughout."""
    stop = threading.Event()
    answers = {"first": [], "second": []}

    def client(model: str) -> None:
        while not stop.is_set():
            answers[model].append(post(limited, model))

    config = json.loads(requests.get(f"{limited.url}/v2/models/first/config", timeout=10).text)
    config["instance_group"][0]["rate_limiter"]["priority"] = 3
    with futures.ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, model) for model in ("first", "second") * 2]
        try:
            wait_for(lambda: min(map(len, answers.values())) >= 5, "answers to both models")
            load = f"{limited.url}/v2/repository/models/first/load"
            assert requests.post(load, json={"parameters": {"config": json.dumps(config)}}, timeout=30).status_code == 200
            assert requests.post(f"{limited.url}/v2/repository/models/second/unload", timeout=30).status_code == 200
            seen = len(answers["first"])
            wait_for(lambda: len(answers["first"]) >= seen + 5, "first answering after the changes")
        finally:
            stop.set()
        for done in clients:
            done.result()
    assert set(answers["first"]) == {200}
    assert 200 in answers["second"] and set(answers["second"]) <= {200, 400}  # 400: after the unload (not ready)
    load = f"{limited.url}/v2/repository/models"
    assert requests.post(f"{load}/first/load", json={}, timeout=30).status_code == 200
    assert requests.post(f"{load}/second/load", json={}, timeout=30).status_code == 200


# ---------------------------------------------------------------- refusal at load


TRITON_REFUSAL = (
    'Resource count for "R" is limited to 1 which will prevent scheduling of one or more model instances,'
    " the minimum required count is 2"
)


@pytest.fixture(scope="module")
def budget_repository(tmp_path_factory):
    repository = tmp_path_factory.mktemp("budget")
    add_model(repository, "fits", sim_config("fits", '{ name: "R" count: 1 }'))
    add_model(repository, "too_big", sim_config("too_big", '{ name: "R" count: 2 }'))
    return repository


def reasons(server) -> dict[str, str]:
    index = requests.post(f"{server.url}/v2/repository/index", json={}, timeout=10).json()
    return {entry["name"]: entry.get("reason", "") for entry in index}


@pytest.mark.parametrize("workers", [1, 2], ids=["one_process", "two_workers"])
def test_a_config_needing_more_than_the_server_has_is_refused_at_load(budget_repository, tmp_path, workers):
    server = start_server(
        budget_repository, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "*",
        "--rate_limit", "execution_count", "--rate_limit_resource", "R:1", wait="loaded", workers=workers,
    )
    try:
        assert reasons(server)["too_big"] == TRITON_REFUSAL
        answer = requests.post(f"{server.url}/v2/repository/models/too_big/load", json={}, timeout=30)
        assert answer.status_code == 400
        assert answer.json()["error"] == f"failed to load 'too_big': {TRITON_REFUSAL}"
        assert post(server, "fits") == 200
    finally:
        stop_server(server)


def test_with_the_limiter_off_rate_limiter_configs_are_ignored(budget_repository, tmp_path):
    """As Triton's --rate-limit off: the same flags and configs, every model loads."""
    server = start_server(
        budget_repository, tmp_path / "server.log", "--rate_limit", "off", "--rate_limit_resource", "R:1",
    )
    try:
        assert post(server, "too_big") == 200 and post(server, "fits") == 200
    finally:
        stop_server(server)


# ---------------------------------------------------------------- a hung execution


@pytest.mark.parametrize("server", ["kserve-ascend", "workers", "triton"])
def test_a_decoupled_model_takes_its_turn_as_under_tritons_limiter(tmp_path, server):
    """Two decoupled models whose one instance each needs the one R: while the first's stream is under way, the
    second's waits (as real Triton 2.51 runs them); once the first is cancelled, the second streams."""
    for name in ("rl_a", "rl_b"):
        config = copy_model("repeat_int32", tmp_path / "repository", name) / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "repeat_int32"', f'name: "{name}"').replace(
            "instance_group [ { kind: KIND_CPU count: 1 } ]",
            'instance_group [ { kind: KIND_CPU count: 1 rate_limiter { resources [ { name: "R" count: 1 } ] } } ]',
        ))
    if server == "triton":
        (tmp_path / "triton").mkdir()
        target = start_triton(tmp_path / "repository", tmp_path / "triton", "--rate-limit=execution_count")
    else:
        target = start_server(tmp_path / "repository", tmp_path / "server.log", "--rate_limit", "execution_count",
                              workers=2 if server == "workers" else 1)  # fmt: skip

    def request(name: str, values: list[int], delays: list[int]):
        request = repeat_request(values, delays)
        request.model_name = name
        return request

    try:
        with grpc.insecure_channel(target.grpc) as channel, futures.ThreadPoolExecutor(1) as pool:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            holding = stub.ModelStreamInfer(iter([request("rl_a", [1, 2], [0, 120_000])]), timeout=120)
            assert response_outputs(next(holding).infer_response)["OUT"].tolist() == [1]  # rl_a holds R from here
            waiting = pool.submit(lambda: [
                response_outputs(r.infer_response)["OUT"].item() for r in stub.ModelStreamInfer(iter([request("rl_b", [3], [0])]), timeout=60)
            ])
            with pytest.raises(futures.TimeoutError):
                waiting.result(timeout=1)  # (without the limiter it is answered in milliseconds)
            holding.cancel()  # rl_a's model stops, its instance gives R back
            assert waiting.result(timeout=30) == [3]
    finally:
        stop_server(target)


def test_a_hung_execution_leaves_the_resource_to_the_others(tmp_path):
    """On the FAKE pyACL: `hangs` (NPU 2) and `other` (NPU 3) share one global G. `hangs`'s execution never
    returns; at its execution timeout its instance leaves rotation, and the rate limiter: `other` runs."""
    fake_acl = load_fake_acl()
    repository = tmp_path / "repository"
    limiter = 'instance_group [ { rate_limiter { resources [ { name: "G" count: 1 global: true } ] } } ]'
    for name, npu in (("hangs", 2), ("other", 3)):
        (repository / name / "1").mkdir(parents=True)
        fake_acl.fake_write_om(repository / name / "1" / "model.om", [("images", fake_acl.ACL_FLOAT, [1, 4])])
        (repository / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "ascend"\nmax_batch_size: 1\n{limiter}\n'
            f'parameters {{ key: "device_ids" value: {{ string_value: "{npu}" }} }}\n'
            'parameters { key: "execution_timeout_ms" value: { string_value: "300" } }\n'
        )
    server = start_on_fake_acl(repository, "hung", "--rate_limit", "execution_count")
    try:
        assert post_infer(server, "other", IMAGES).status_code == 200
        write_faults(server.faults, [{"call": "acl.rt.set_context", "hang": True, "device": 2}])
        answer = post_infer(server, "hangs", IMAGES)
        assert answer.status_code == 500 and "execution_timeout_ms" in answer.json()["error"]
        assert post_infer(server, "other", IMAGES, timeout=10).status_code == 200
    finally:
        stop_server(server)


# ---------------------------------------------------------------- flags


def test_the_flags_read_as_tritons():
    from kserve_ascend.server.cli import build_parser, rate_limiter

    args = build_parser().parse_args(["--rate_limit", "EXECUTION_COUNT", "--rate_limit_resource", "R1:10", "--rate_limit_resource", "R2:5:1"])
    assert (args.rate_limit, args.rate_limit_resource) == ("execution_count", [("R1", 10, -1), ("R2", 5, 1)])
    assert rate_limiter(args) is not None
    assert rate_limiter(build_parser().parse_args(["--rate_limit_resource", "R1:10"])) is None  # off by default


@pytest.mark.parametrize("value", ["R", "R:x", "R:1:2:3", ":1", "R:-1", "R:1:-2"])
def test_a_malformed_resource_flag_is_refused_with_the_format(value, capsys):
    from kserve_ascend.server.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--rate_limit_resource", value])
    assert (
        "argument --rate_limit_resource: format is '<resource_name>:<count>:<device>' or '<resource_name>:<count>'"
        f" (count and device non-negative integers), got {value!r}"
    ) in capsys.readouterr().err

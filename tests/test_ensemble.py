"""Ensembles (`platform: "ensemble"`) served unchanged by both servers (issue 19).

One repository of Triton ensembles over the `simple` model (sum and difference) is served by
the KServe server and by real Triton 2.51, whose own ensemble scheduler runs each step on the
`ascend` backend; every answer is compared: outputs, metadata, configuration, statistics,
errors, the steps that run for a subset of outputs, pinned versions, batching of concurrent
ensemble requests at a step model, broken ensembles and, in explicit mode, how an ensemble
follows its step models being unloaded and loaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import shutil
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from tritonclient.utils import InferenceServerException

from conftest import both_servers, copy_model, fake_acl_env, infer, load_fake_acl, start_server, start_triton, statistics, stop_server, wait_for
from kserve_ascend.core.errors import ModelLoadError
from kserve_ascend.core.execution.processing import image, yolo
from kserve_ascend.core.models.repository import Repository

A = np.arange(32, dtype=np.int32).reshape(2, 16)
B = np.full((2, 16), 3, dtype=np.int32)


def step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: {version} {" ".join(maps)} }}'


def tensors(names, dims: str, datatype: str = "TYPE_INT32") -> str:
    return ", ".join(f'{{ name: "{n}" data_type: {datatype} dims: {dims} }}' for n in names)


def ensemble(name: str, max_batch_size: int, inputs: str, outputs: str, steps: list[str]) -> str:
    return textwrap.dedent(f"""\
        name: "{name}"
        platform: "ensemble"
        max_batch_size: {max_batch_size}
        input [ {inputs} ]
        output [ {outputs} ]
        ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
        """)


SUM_DIFF = {"OUTPUT0": "S", "OUTPUT1": "D"}
ENSEMBLES = {
    # A diamond and a parallel branch: S, D from (A, B); (SUM2, DIFF2) = simple(S, D) = (2A, 2B), pinned to
    # version 1; SUM = A + B beside them. simple serves versions 1 and 2 (the latest, for -1).
    "pipe": ensemble("pipe", 8, tensors("AB", "[ 16 ]"), tensors(["SUM2", "DIFF2", "SUM"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A", "INPUT1": "B"}, SUM_DIFF),
        step("simple", {"INPUT0": "S", "INPUT1": "D"}, {"OUTPUT0": "SUM2", "OUTPUT1": "DIFF2"}, version=1),
        step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]),
    # A non-batching ensemble over a batching model: [16] gains a batch of 1 on the way in, loses it on the way out.
    "single": ensemble("single", 0, tensors("AB", "[ 16 ]"), tensors(["SUM"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]),
    # Variable dims the step's model is stricter about: a request of the wrong length fails at the step.
    "loose": ensemble("loose", 8, tensors("AB", "[ -1 ]"), tensors(["SUM"], "[ -1 ]"), [
        step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]),
    # One step on a model with a dynamic batcher: concurrent ensemble requests meet there.
    "batched": ensemble("batched", 8, tensors("AB", "[ 16 ]"), tensors(["SUM"], "[ 16 ]"), [
        step("simple_batched", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]),
}
#: Ensembles neither server can load, with the reason this one gives.
BROKEN = {
    "unknown_step": (ensemble("unknown_step", 8, tensors("AB", "[ 16 ]"), tensors(["SUM"], "[ 16 ]"), [
        step("nope", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]), "step 1 (model 'nope'): Request for unknown model: 'nope' is not found"),
    "wrong_input": (ensemble("wrong_input", 8, tensors("AB", "[ 16 ]"), tensors(["SUM"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A", "INPUT9": "B"}, {"OUTPUT0": "SUM"}),
    ]), "step 1 (model 'simple') maps ensemble tensor 'B' to 'INPUT9', not an input of the model"),
    "unmapped": (ensemble("unmapped", 8, tensors("A", "[ 16 ]"), tensors(["SUM"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A"}, {"OUTPUT0": "SUM"}),
    ]), "step 1 (model 'simple') leaves the model's input 'INPUT1' unmapped"),
    "datatype": (ensemble("datatype", 8, tensors("AB", "[ 16 ]", "TYPE_FP32"), tensors(["SUM"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]), "ensemble tensor 'A' is FP32 in ensemble 'datatype' but INT32 in step 1 (model 'simple')"),
    "too_large": (ensemble("too_large", 16, tensors("AB", "[ 16 ]"), tensors(["SUM"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]), "the ensemble allows batches of 16, but step 1 (model 'simple') takes at most 8"),
    "cycle": (ensemble("cycle", 8, tensors("AB", "[ 16 ]"), tensors(["SUM"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A", "INPUT1": "X"}, {"OUTPUT0": "SUM", "OUTPUT1": "Y"}),
        step("simple", {"INPUT0": "B", "INPUT1": "Y"}, {"OUTPUT1": "X"}),
    ]), "wait on each other's outputs (a cycle)"),
    "unwritten": (ensemble("unwritten", 8, tensors("AB", "[ 16 ]"), tensors(["SUM", "MORE"], "[ 16 ]"), [
        step("simple", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "SUM"}),
    ]), "ensemble output 'MORE' is written by no step"),
}


def write_repository(root: Path, broken: bool) -> Path:
    simple = copy_model("simple", root)
    shutil.copytree(simple / "1", simple / "2")
    config = simple / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy: { all: {} }\n")
    batched = copy_model("simple", root, "simple_batched")
    config = batched / "config.pbtxt"
    # A long delay so that requests sent together are surely batched together, on both servers.
    config.write_text(config.read_text() + "dynamic_batching { max_queue_delay_microseconds: 300000 }\n")
    configs = {name: text for name, text in ENSEMBLES.items()}
    if broken:
        configs.update({name: text for name, (text, _) in BROKEN.items()})
    for name, text in configs.items():
        (root / name / "1").mkdir(parents=True)  # an ensemble's version directory holds nothing
        (root / name / "config.pbtxt").write_text(text)
    return root


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repository = write_repository(tmp_path_factory.mktemp("ensembles"), broken=True)
    yield from both_servers(repository, tmp_path_factory, "--exit-on-error=false", wait_ready=False)


def simple_versions(target) -> dict[str, dict]:
    """The statistics of both versions of `simple`."""
    return {version: statistics(target, "simple", version) for version in "12"}


def test_every_ensemble_loads_or_fails_alike(servers):
    for target in servers.values():
        index = requests.post(f"{target.url}/v2/repository/index").json()
        assert {e["name"] for e in index} == {"simple", "simple_batched", *ENSEMBLES, *BROKEN}
        # Triton lists a model that failed before loading without a state, this server as UNAVAILABLE.
        assert {e["name"] for e in index if e.get("state") == "READY"} == {"simple", "simple_batched", *ENSEMBLES}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_ensemble_says_why(servers, name):
    entries = requests.post(f"{servers['kserve-ascend'].url}/v2/repository/index").json()
    reason = next(e["reason"] for e in entries if e["name"] == name)
    assert BROKEN[name][1] in reason
    for target in servers.values():
        assert requests.get(f"{target.url}/v2/models/{name}/ready").status_code == 400


@pytest.mark.parametrize("name", sorted(ENSEMBLES))
def test_metadata_and_config_are_triton_s(servers, name):
    ours, theirs = (requests.get(f"{t.url}/v2/models/{name}").json() for t in servers.values())
    assert ours.pop("parameters") == {}  # Triton writes none for an ensemble
    assert ours == theirs and ours["platform"] == "ensemble"
    ours, theirs = (requests.get(f"{t.url}/v2/models/{name}/config").json() for t in servers.values())
    assert ours == theirs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_steps_run_as_their_inputs_exist_and_answer_as_triton(servers, protocol):
    answers = [infer(target, "pipe", {"A": A, "B": B}, protocol) for target in servers.values()]
    expected = {"SUM2": 2 * A, "DIFF2": 2 * B, "SUM": A + B}
    for answer in answers:
        assert answer.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_array_equal(answer[name], value, err_msg=name)


def test_only_the_steps_of_the_requested_outputs_run_and_pinned_versions_hold(servers):
    for target in servers.values():
        before = simple_versions(target)
        assert infer(target, "pipe", {"A": A, "B": B}, outputs=["SUM"]).keys() == {"SUM"}
        middle = simple_versions(target)
        infer(target, "pipe", {"A": A, "B": B})
        after = simple_versions(target)
        # SUM alone: one step, on the latest version; everything: steps 1 and 3 on version 2, step 2 on version 1.
        assert [middle[v]["execution_count"] - before[v]["execution_count"] for v in "12"] == [0, 1]
        assert [after[v]["execution_count"] - middle[v]["execution_count"] for v in "12"] == [1, 2]


def test_a_tensor_gains_and_loses_the_batch_dimension_between_models(servers):
    for target in servers.values():
        answer = infer(target, "single", {"A": A[0], "B": B[0]})
        assert answer["SUM"].shape == (16,)
        np.testing.assert_array_equal(answer["SUM"], A[0] + B[0])


def test_a_failing_step_fails_the_request_with_the_ensemble_named(servers):
    short = np.ones((1, 8), dtype=np.int32)
    messages = {}
    for name, target in servers.items():
        with pytest.raises(InferenceServerException) as raised:
            infer(target, "loose", {"A": short, "B": short})
        assert raised.value.status() == "400"
        with pytest.raises(InferenceServerException) as raised_grpc:
            infer(target, "loose", {"A": short, "B": short}, "grpc")
        assert raised_grpc.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        messages[name] = raised.value.message()
        assert messages[name].startswith("in ensemble 'loose', ") and "INPUT" in messages[name]
    # This server names the step too.
    assert messages["kserve-ascend"].startswith("in ensemble 'loose', step 1 (model 'simple'): ")
    # ... and both go on serving.
    for target in servers.values():
        np.testing.assert_array_equal(infer(target, "loose", {"A": A, "B": B})["SUM"], A + B)


def test_concurrent_ensemble_requests_batch_at_the_step_model_and_are_counted_as_triton_counts(servers):
    requests_sent = 8
    for name, target in servers.items():
        before = statistics(target, "batched", "1")
        with concurrent.futures.ThreadPoolExecutor(requests_sent) as pool:
            answers = list(pool.map(lambda i: infer(target, "batched", {"A": A[:1] + i, "B": B[:1]}), range(requests_sent)))
        for i, answer in enumerate(answers):
            np.testing.assert_array_equal(answer["SUM"], A[:1] + i + B[:1])
        step_batches = {b["batch_size"] for b in statistics(target, "simple_batched", "1")["batch_stats"]}
        assert max(step_batches) > 1, f"{name}: the step model ran batches of {step_batches}"
        after = statistics(target, "batched", "1")
        # The ensemble counts each request as one execution of its own batch size, charged with its steps' compute.
        assert after["inference_count"] - before["inference_count"] == requests_sent
        assert after["execution_count"] - before["execution_count"] == requests_sent
        phases = ("success", "queue", "compute_input", "compute_infer", "compute_output")
        for phase in phases:
            assert after["inference_stats"][phase]["count"] - before["inference_stats"][phase]["count"] == requests_sent
        assert [b["batch_size"] for b in after["batch_stats"]] == [1]


def test_an_ensemble_follows_its_step_model_in_explicit_mode(tmp_path):
    """As Triton: loading an ensemble loads its steps' models, unloading one of those unloads the
    ensemble (the server stays ready), and loading it again brings the ensemble back."""
    repository = write_repository(tmp_path / "repository", broken=False)
    ours = start_server(repository, tmp_path / "server.log", "--model_control_mode", "explicit", "--load_model", "single")
    try:
        triton = start_triton(repository, tmp_path, "--model-control-mode=explicit", "--load-model=single")
    except BaseException:
        stop_server(ours)
        raise
    try:
        def states(target) -> dict[str, str]:
            entries = requests.post(f"{target.url}/v2/repository/index").json()
            return {e["name"]: e["state"] for e in entries if e["name"] in ("single", "simple") and "state" in e}

        def unloading(target) -> bool:
            """Whether any version of any model is still UNLOADING (each version has its entry in the index)."""
            return any(e.get("state") == "UNLOADING" for e in requests.post(f"{target.url}/v2/repository/index").json())

        for target in (ours, triton):
            assert states(target) == {"single": "READY", "simple": "READY"}
            assert requests.post(f"{target.url}/v2/repository/models/simple/unload").status_code == 200
            # Triton unloads in the background, version by version (each has its entry in the index).
            wait_for(lambda: not unloading(target), "every version unloaded", server=target)
            assert states(target) == {"single": "UNAVAILABLE", "simple": "UNAVAILABLE"}
            assert requests.get(f"{target.url}/v2/health/ready").status_code == 200
            assert requests.post(f"{target.url}/v2/repository/models/simple/load").status_code == 200
            assert states(target) == {"single": "READY", "simple": "READY"}
            np.testing.assert_array_equal(infer(target, "single", {"A": A[0], "B": B[0]})["SUM"], A[0] + B[0])
    finally:
        stop_server(triton)
        stop_server(ours)



def test_unload_dependents_unloads_the_steps_nothing_else_runs_as_triton(tmp_path):
    """Triton's `unload_dependents` (core's DependencyGraph::RemoveNodes): the step models the ensemble's
    load brought in go with it, unless another loaded ensemble still runs them. `single` and `pipe` both run
    `simple`. (Steps a client loaded by name, and an unload without it: conformance/cases/test_unload_dependents.py.)"""
    repository = write_repository(tmp_path / "repository", broken=False)
    flags = [("--model_control_mode", "explicit"), ("--model-control-mode=explicit",)]
    ours = start_server(repository, tmp_path / "server.log", *flags[0], "--load_model", "single", "--load_model", "pipe")
    try:
        triton = start_triton(repository, tmp_path, *flags[1], "--load-model=single", "--load-model=pipe")
    except BaseException:
        stop_server(ours)
        raise
    try:
        def unload(target, name: str, dependents: bool) -> None:
            body = {"parameters": {"unload_dependents": dependents}}
            assert requests.post(f"{target.url}/v2/repository/models/{name}/unload", json=body).status_code == 200

        def states(target) -> dict[str, str]:
            """Each model's state once nothing is UNLOADING any more (Triton unloads in the background)."""
            def settled():
                entries = requests.post(f"{target.url}/v2/repository/index").json()
                return None if any(e.get("state") == "UNLOADING" for e in entries) else entries
            entries = wait_for(settled, "every unload finished", server=target)
            return {e["name"]: e["state"] for e in entries if e["name"] in ("single", "pipe", "simple")}

        for target in (ours, triton):
            unload(target, "single", dependents=True)  # `pipe` still runs `simple`
            assert states(target) == {"single": "UNAVAILABLE", "pipe": "READY", "simple": "READY"}, target.name
            unload(target, "pipe", dependents=True)  # now nothing does: it goes
            assert states(target) == {"single": "UNAVAILABLE", "pipe": "UNAVAILABLE", "simple": "UNAVAILABLE"}, target.name
    finally:
        stop_server(triton)
        stop_server(ours)

def test_an_ensemble_outside_a_repository_cannot_load(tmp_path):
    from kserve_ascend.core.models.model import Model

    model_dir = tmp_path / "single"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(ENSEMBLES["single"])
    with pytest.raises(ModelLoadError, match="served from a repository"):
        Model("single", model_dir).load()


def test_a_step_model_that_is_not_ready_makes_the_ensemble_unready(tmp_path):
    """In process: a step model that loses readiness (here: unloaded behind the repository's back)
    makes the ensemble answer not ready, with the step named."""
    repository = Repository(write_repository(tmp_path, broken=False))
    asyncio.run(repository.load("single"))
    assert repository.models["single"].ready
    for version in repository.models["simple"].unload():
        version.close()
    single = repository.models["single"]
    assert not single.ready and not repository.ready
    assert re.match(r"step 1 \(model 'simple'\): model 'simple' is not ready", single.waiting_for)
    for model in repository.models.values():
        model.close()


def test_an_om_detector_serves_inside_the_detection_ensemble(tmp_path):
    """The detection ensemble's post-processing over an `.om` step (the FAKE pyACL, tests/fake_acl: an
    identity model with ATC's output names and dynamic batch gears), batched across concurrent requests."""
    fake_acl = load_fake_acl()
    repository = tmp_path / "repository"
    detector = repository / "head" / "1"
    detector.mkdir(parents=True)
    (detector.parent / "config.pbtxt").write_text(
        'name: "head"\nbackend: "ascend"\nmax_batch_size: 8\n'
        'input [ { name: "images" data_type: TYPE_FP32 dims: [ 6, 8400 ] } ]\n'
        'output [ { name: "output0" data_type: TYPE_FP32 dims: [ 6, 8400 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 300000 }\n"
    )
    fake_acl.fake_write_om(
        detector / "model.om", [("images", fake_acl.ACL_FLOAT, [-1, 6, 8400])],
        outputs=[("output0", fake_acl.ACL_FLOAT, [-1, 6, 8400])], dynamic_batch=[1, 2, 4, 8], atc_names=True,
    )
    copy_model("yolov8_postprocess", repository)
    (repository / "om_detect" / "1").mkdir(parents=True)
    (repository / "om_detect" / "config.pbtxt").write_text(ensemble(
        "om_detect", 0,
        '{ name: "head" data_type: TYPE_FP32 dims: [ 1, 6, 8400 ] }, { name: "letterbox" data_type: TYPE_FP32 dims: [ 5 ] }',
        tensors(["detection_boxes"], "[ -1, 4 ]", "TYPE_FP32") + ", " + tensors(["detection_scores"], "[ -1 ]", "TYPE_FP32")
        + ", " + tensors(["detection_classes"], "[ -1 ]") + ", " + tensors(["num_detections"], "[ 1 ]"),
        [
            step("head", {"images": "head"}, {"output0": "output0"}),
            step("yolov8_postprocess", {"output0": "output0", "letterbox": "letterbox"},
                 {n: n for n in ("detection_boxes", "detection_scores", "detection_classes", "num_detections")}),
        ],
    ))
    env = fake_acl_env()
    server = start_server(repository, tmp_path / "server.log", env=env)
    try:
        rng = np.random.default_rng(5)
        heads = np.zeros((6, 1, 6, 8400), dtype=np.float32)
        heads[:, :, :4] = rng.uniform(20, 600, (6, 1, 4, 8400))
        heads[:, :, 4:] = rng.uniform(0, 0.3, (6, 1, 2, 8400))  # some anchors above 0.25
        frame = image.Letterbox(1280, 720, 0.5, 0, 140)
        letterbox = np.array([frame.width, frame.height, frame.scale, frame.left, frame.top], dtype=np.float32)

        def detect(head):
            answer = infer(server, "om_detect", {"head": head, "letterbox": letterbox}, "grpc")
            return answer["detection_boxes"], answer["detection_scores"], answer["detection_classes"]

        with concurrent.futures.ThreadPoolExecutor(len(heads)) as pool:
            answers = list(pool.map(detect, heads))
        for head, (boxes, scores, classes) in zip(heads, answers):
            expected = yolo.decode(head[0])
            assert len(scores) > 1
            np.testing.assert_array_equal(scores, expected.scores)
            np.testing.assert_array_equal(classes, expected.classes)
            np.testing.assert_allclose(boxes, frame.to_image(expected.boxes), rtol=1e-6)
        batches = {b["batch_size"] for b in statistics(server, "head", "1")["batch_stats"]}
        assert max(batches) > 1, batches
    finally:
        stop_server(server)

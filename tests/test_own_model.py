"""A user's own model on both servers (issue 31): one repository served alike, or refused alike, by the KServe
server and real Triton 2.51 started as `make triton` starts it (tools/run_triton.py)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc

from conftest import REPOSITORY, ROOT, both_servers, copy_model, free_port, start_server, stop_server, tensors
from kserve_ascend.core import config as cfg
from test_manifests import run_triton_module

#: The KServe server's one log line saying the repository is loaded and served (server/lifecycle.py).
READY_LINE = "repository loaded, serving:"
ADDER_INPUTS = {"INPUT0": np.arange(32, dtype=np.int32).reshape(2, 16), "INPUT1": np.ones((2, 16), np.int32)}


def make_triton_args(**variables: str) -> list[str]:
    """The tritonserver flags `make triton` passes (after run_triton.py's `--`), as the Makefile says."""
    command = subprocess.run(
        ["make", "-s", "-n", "triton", *(f"{k}={v}" for k, v in variables.items())],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.replace("\\\n", " ").strip().splitlines()[-1]  # the last line: pip may come first on a fresh clone
    words = shlex.split(command)
    assert words[1] == "tools/run_triton.py", command
    return words[words.index("--") + 1:]


def misnamed(repository: Path) -> Path:
    """The issue's bad model: a config.pbtxt input name the model file lacks."""
    model = copy_model("simple", repository, "misnamed")
    config = model / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "INPUT0"', 'name: "IMAGE0"'))
    return model


#: instance_group kinds (on the `sim` model, device_ids "0,1"): what both servers accept, and what Triton refuses
#: on a host without NVIDIA GPUs (every Ascend host) that the KServe server serves with a warning.
KINDS = {
    "kind_cpu": "{ kind: KIND_CPU count: 2 }",
    "kind_auto": "{ count: 1 }",
    "kind_gpu": "{ kind: KIND_GPU count: 1 }",
    "kind_model_gpus": "{ kind: KIND_MODEL count: 1 gpus: [ 1 ] }",
}


def image_mean(path: Path) -> None:
    """A config-less detector's input, as NudeNet's: `images` FP32 [N, 3, H, W] (H, W dynamic); its output, the mean
    of each channel [N, 3]."""
    images = helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, "H", "W"])
    mean = helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["N", 3])
    node = helper.make_node("ReduceMean", ["images"], ["mean"], axes=[2, 3], keepdims=0)
    model = helper.make_model(helper.make_graph([node], "image_mean", [images], [mean]), opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True)
    onnx.save(model, path)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repository = tmp_path_factory.mktemp("own")
    # docs/own-model.md's first step: a folder with the model file and no config.pbtxt.
    (repository / "adder" / "1").mkdir(parents=True)
    (repository / "adder" / "1" / "model.onnx").write_bytes((REPOSITORY / "simple" / "1" / "model.onnx").read_bytes())
    copy_model("simple", repository)
    misnamed(repository)
    image_mean(repository / "image_mean" / "1" / "model.onnx")
    for name, group in KINDS.items():
        config = copy_model("sim", repository, name) / "config.pbtxt"
        config.write_text(config.read_text().replace("{ kind: KIND_MODEL count: 1 }", group)
                          + 'parameters { key: "device_ids" value: { string_value: "0,1" } }\n')
    # Both as `make serve` and `make triton` start them.
    yield from both_servers(repository, tmp_path_factory, *make_triton_args(), wait_ready=False)


def index(server) -> dict[str, dict]:
    return {entry["name"]: entry for entry in requests.post(f"{server.url}/v2/repository/index").json()}


# ---------------------------------------------------------------- item 1: a folder without config.pbtxt


def test_a_config_less_onnx_folder_answers_alike_on_both(servers):
    answers = {}
    for name, server in servers.items():
        with httpclient.InferenceServerClient(server.http) as client:
            result = client.infer("adder", tensors(httpclient, ADDER_INPUTS))
        answers[name] = (result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1"))
    for name, (total, difference) in answers.items():
        assert (total == ADDER_INPUTS["INPUT0"] + 1).all() and (difference == ADDER_INPUTS["INPUT0"] - 1).all(), name


def test_a_config_less_onnx_folder_reports_the_backend_triton_names(servers):
    ours, theirs = (requests.get(f"{s.url}/v2/models/adder/config").json() for s in servers.values())
    fields = ("backend", "platform", "default_model_filename", "max_batch_size", "input", "output")
    assert {f: ours[f] for f in fields} == {f: theirs[f] for f in fields}
    assert (ours["backend"], ours["platform"]) == ("onnxruntime", "onnxruntime_onnx")
    # Triton runs it with the ascend backend laid out as `onnxruntime` (tools/run_triton.py).
    assert theirs["runtime"] == "model.py"
    ours, theirs = (requests.get(f"{s.url}/v2/models/adder").json() for s in servers.values())
    assert ours["platform"] == theirs["platform"] == "onnxruntime_onnx"


def test_the_kserve_server_says_what_triton_needs_for_a_config_less_folder(servers):
    ours, theirs = index(servers["kserve-ascend"]), index(servers["triton"])
    assert "installed under this name" in ours["adder"]["triton"] and theirs["adder"]["state"] == "READY"
    assert f"model 'adder': {ours['adder']['triton']}" in servers["kserve-ascend"].output()


def test_a_config_less_file_triton_names_no_backend_for_is_served_as_ascend():
    # Triton 2.51 on a config-less model.sim folder: "Could not determine backend for model 'bare_sim' with
    # no backend in model configuration. Expected model name of the form 'model.<backend_name>'."
    read = mc.ModelConfig(name="bare")
    served = mc.ModelConfig(name="bare")
    cfg.complete_backend(served, Path("1/model.om"))
    assert served.backend == "ascend" and not served.platform
    assert 'needs a config.pbtxt with backend: "ascend"' in cfg.triton_needs(read, served)
    # A config naming its backend (or platform) needs nothing more, and is left as it is.
    named = mc.ModelConfig(name="named", backend="ascend")
    cfg.complete_backend(named, Path("1/model.onnx"))
    assert named.backend == "ascend" and cfg.triton_needs(named, named) == ""


def test_the_onnxruntime_alias_can_be_left_out(tmp_path):
    launcher = run_triton_module()
    launcher.assemble_backends(tmp_path)
    alias = tmp_path / "onnxruntime" / "model.py"
    assert alias.read_bytes() == (ROOT / "triton_backend" / "ascend" / "model.py").read_bytes()
    # Off: a previous start's alias goes, so Triton refuses config-less ONNX folders as it ships.
    assert launcher.parse_args(["--no-onnxruntime-as-ascend"]).onnxruntime_as_ascend is False
    launcher.assemble_backends(tmp_path, onnxruntime_as_ascend=False)
    assert not alias.parent.exists() and (tmp_path / "ascend" / "model.py").is_file()


# ---------------------------------------------------------------- item 2: one failed model


def test_one_failed_model_is_reported_and_the_others_served_on_both(servers):
    for name, server in servers.items():
        entries = index(server)
        assert entries["misnamed"]["state"] == "UNAVAILABLE" and "IMAGE0" in entries["misnamed"]["reason"], name
        assert entries["simple"]["state"] == entries["adder"]["state"] == "READY", name
        with httpclient.InferenceServerClient(server.http) as client:
            assert (client.infer("simple", tensors(httpclient, ADDER_INPUTS)).as_numpy("OUTPUT1") == ADDER_INPUTS["INPUT0"] - 1).all()
            # Strict readiness, both: the server is not ready while a model it was asked to serve is not.
            assert not client.is_server_ready() and client.is_server_live(), name
            assert client.is_model_ready("simple") and not client.is_model_ready("misnamed"), name


def test_the_default_make_triton_flags_are_the_documented_ones():
    assert make_triton_args() == ["--exit-on-error=false"]
    assert make_triton_args(TRITON_ARGS="") == []
    assert make_triton_args(TRITON_ARGS="--log-verbose=1 --exit-on-error=true") == ["--log-verbose=1", "--exit-on-error=true"]


def test_triton_by_its_own_default_stops_on_one_failed_model(tmp_path):
    """`make triton TRITON_ARGS=`, and the kserve-ascend-triton image: Triton's own --exit-on-error=true."""
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    misnamed(repository)
    command = [
        sys.executable, str(ROOT / "tools" / "run_triton.py"), "--model-repository", str(repository),
        "--backend-directory", str(tmp_path / "backends"), "--http-port", str(free_port()),
        "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--", *make_triton_args(TRITON_ARGS=""),
    ]  # fmt: skip
    stopped = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert stopped.returncode != 0
    assert "error: creating server: Internal - failed to load all models" in stopped.stderr + stopped.stdout


# ---------------------------------------------------------------- item 3: instance_group kinds


def test_instance_group_kinds_both_servers_accept_read_alike(servers):
    for model in ("kind_cpu", "kind_auto", "adder"):
        ours, theirs = (requests.get(f"{s.url}/v2/models/{model}/config").json()["instance_group"] for s in servers.values())
        assert [(g["kind"], g["count"], g["gpus"]) for g in ours] == [(g["kind"], g["count"], g["gpus"]) for g in theirs], model
    # Placed on the NPUs of device_ids, round-robin, on both (the backend places KIND_CPU instances as KIND_MODEL ones).
    assert requests.get(f"{servers['kserve-ascend'].url}/v2/models/kind_cpu").json()["parameters"]["device_ids"] == "0,1"
    log = servers["triton"].output()
    assert "kind_cpu_0_0: model.sim with runtime sim on device 0" in log and "kind_cpu_0_1: model.sim with runtime sim on device 1" in log


def test_what_triton_refuses_the_kserve_server_serves_with_tritons_words(servers):
    ours, theirs = index(servers["kserve-ascend"]), index(servers["triton"])
    for model in ("kind_gpu", "kind_model_gpus"):
        assert theirs[model]["state"] == "UNAVAILABLE" and ours[model]["state"] == "READY", model
        refusal = theirs[model]["reason"].removeprefix("Invalid argument: ").split(". GPUs with")[0]
        assert refusal in ours[model]["triton"], (refusal, ours[model]["triton"])
        assert f"WARNING [model.py:load():" in servers["kserve-ascend"].output() and refusal in servers["kserve-ascend"].output()
    for model in ("kind_cpu", "kind_auto"):
        assert "triton" not in ours[model] and theirs[model]["state"] == "READY", model


# ---------------------------------------------------------------- item 4: load errors without tracebacks


def test_a_load_error_reads_alike_on_both(servers):
    ours, theirs = index(servers["kserve-ascend"])["misnamed"]["reason"], index(servers["triton"])["misnamed"]["reason"]
    assert ours == "config.pbtxt declares 'IMAGE0', the model file has ['INPUT0', 'INPUT1']"
    # Triton's python backend writes "<code>: <exception type>: <message>", then the frames the exception left
    # ("At:"): only the one it cannot avoid, the backend's `initialize`, none of the core's.
    first, _, frames = theirs.partition("\n\nAt:\n")
    assert first == f"Internal: ModelLoadError: {ours}"
    assert [line.strip().rsplit(": ", 1)[-1] for line in frames.splitlines()] == ["initialize"]


# ---------------------------------------------------------------- item 5: large requests


#: One 320x320 image as an FP32 tensor (NudeNet's 320n.onnx input): a body of about 6 MB as JSON, 1.2 MB binary.
#: Sent by curl with its default Content-Type (application/x-www-form-urlencoded) such a body crashes Triton 2.51
#: (signal 11, triton-inference-server/server#5840; measured by hand, never sent so here); named, it is answered.
IMAGE = np.random.default_rng(0).random((1, 3, 320, 320), dtype=np.float32)


def binary_request(inputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The binary tensor data extension's request as docs/triton.md sends it with curl: the JSON header, then each
    input's bytes; `Inference-Header-Content-Length` says where the header ends."""
    header = json.dumps({"inputs": [
        {"name": name, "shape": list(array.shape), "datatype": "FP32", "parameters": {"binary_data_size": array.nbytes}}
        for name, array in inputs.items()
    ]}).encode()  # fmt: skip
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    return header + b"".join(a.tobytes() for a in inputs.values()), headers


def test_a_large_image_request_in_the_documented_forms_answers_alike_on_both(servers):
    expected = IMAGE.mean(axis=(2, 3))
    json_body = json.dumps({"inputs": [{"name": "images", "shape": list(IMAGE.shape), "datatype": "FP32", "data": IMAGE.ravel().tolist()}]})
    assert len(json_body) > 5_000_000
    for name, server in servers.items():
        with httpclient.InferenceServerClient(server.http) as client:  # binary_data: tritonclient's default
            result = client.infer("image_mean", tensors(httpclient, {"images": IMAGE}))
        np.testing.assert_allclose(result.as_numpy("mean"), expected, rtol=1e-4, err_msg=name)
        body, headers = binary_request({"images": IMAGE})
        for data, headers in ((body, headers), (json_body, {"Content-Type": "application/json"})):
            answer = requests.post(f"{server.url}/v2/models/image_mean/infer", data=data, headers=headers, timeout=60)
            assert answer.status_code == 200, (name, headers, answer.text)
            np.testing.assert_allclose(answer.json()["outputs"][0]["data"], expected.ravel(), rtol=1e-4, err_msg=name)
    assert servers["triton"].process.poll() is None


# ---------------------------------------------------------------- item 6: finding what happened


def test_the_editable_install_of_make_serve_prints_no_setuptools_warning(tmp_path):
    """`make serve` runs `pip install -e`, which builds the project with setuptools' PEP 660 hook: run here on a copy
    of what it reads (no install), its warnings (the boxes between "!!" lines) are what pip would print."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "kserve_ascend", tmp_path / "kserve_ascend", ignore=shutil.ignore_patterns("__pycache__"))
    build = "from setuptools import build_meta; print(build_meta.build_editable('dist'))"
    built = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "!!" not in built.stderr and "Warning" not in built.stderr, built.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "dist" / built.stdout.split()[-1]) as wheel:
        (pth,) = [name for name in wheel.namelist() if name.endswith(".pth")]
        assert wheel.read(pth).decode().split() == [str(tmp_path)]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_ready_line_is_the_last_a_user_sees_at_start(tmp_path, workers):
    repository = tmp_path / "repository"
    repository.mkdir()
    copy_model("simple", repository)
    server = start_server(repository, tmp_path / "server.log", workers=workers, wait=lambda s: READY_LINE in s.output())
    stop_server(server)
    lines = server.output().splitlines()
    (ready,) = [i for i, line in enumerate(lines) if READY_LINE in line]
    assert lines[ready].endswith(f"{READY_LINE} {{'simple': 'READY'}}")
    # After every line of the start-up (the edges': uvicorn's, gRPC's, each frontend's; the models'), before the stop.
    assert [i for i, line in enumerate(lines) if "Uvicorn running on" in line or "gRPC server listening" in line]
    assert all(i < ready for i, line in enumerate(lines) if "Uvicorn running on" in line or "gRPC server listening" in line)
    assert "shutting down" in lines[ready + 1], lines[ready:]

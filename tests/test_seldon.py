"""Seldon Core 2's `triton` ServerConfig running this project's Triton image (manifests/seldon/).

Seldon makes the Server's StatefulSet from its ServerConfig with the Server merged in
(tests/seldon_merge.py: Seldon's merge rules, on the real ServerConfig of tests/upstream/); the
API server must take that StatefulSet. The ServerConfig starts `tritonserver` itself, with a
command line of its own; the image answers with /opt/tritonserver as docker/triton.Dockerfile
installs it (tools/run_triton.py --install). Here that install runs into a temporary root, Seldon's
command line runs against it (its ports and model directory substituted, /opt/tritonserver under
the root), and the Model is placed in Triton's repository, loaded and inferred as Seldon's agent does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import numpy as np
import onnxruntime
import pytest
import requests
import seldon_merge
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from conftest import REPOSITORY, ROOT, Server, free_port, stop_server, wait_for
from google.protobuf import text_format
from kubernetes.utils.quantity import parse_quantity
from test_kubernetes_examples import SELDON, shm_regions
from test_manifests import (  # noqa: F401  (kubectl: a fixture)
    DOCKER,
    KUBERNETES_VERSION,
    TRITON_EXIT_TIMEOUT_S,
    handler_errors,
    instructions,
    kubectl,
    kustomize,
    the,
)
from tritonclient.grpc import model_config_pb2

#: Seldon's `triton` ServerConfig, unchanged (tests/upstream/README.md says from where).
SERVER_CONFIG = ROOT / "tests" / "upstream" / "seldon-core-v2.6.0-triton-serverconfig.yaml"

# The `triton` container of Seldon Core 2's triton ServerConfig (SeldonIO/seldon-core,
# operator/config/serverconfigs/triton.yaml): its env, and its command and args at v2.6.0 and
# from v2.7.0 on (unchanged up to v2.10.2). The kubelet expands $(VAR) from the env.
SELDON_ENV = {
    "SERVER_HTTP_PORT": "9000",
    "SERVER_GRPC_PORT": "9500",
    "SERVER_MODELS_DIR": "/mnt/agent/models",
    "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
}
SELDON_COMMANDS = {
    "v2.6.0": [
        "/opt/tritonserver/bin/tritonserver",
        "--model-repository=$(SERVER_MODELS_DIR)",
        "--http-port=$(SERVER_HTTP_PORT)",
        "--grpc-port=$(SERVER_GRPC_PORT)",
        "--log-verbose=1",
        "--model-control-mode=explicit",
        "--backend-config=python,shm-default-byte-size=16777216",
    ],
    "v2.7.0": [
        "bash",
        "-c",
        (
            "tritonserver --model-repository=$(SERVER_MODELS_DIR) --http-port=$(SERVER_HTTP_PORT) --grpc-port=$(SERVER_GRPC_PORT)"
            " --log-verbose=1 --model-control-mode=explicit --backend-config=python,shm-default-byte-size=16777216"
        ),
    ],
}
#: The ServerConfig's `dshm` volume at /dev/shm (emptyDir, medium Memory), v2.6.0 to v2.10.2.
SELDON_SHM = parse_quantity("256Mi")


def image_prefix() -> str:
    """Where docker/triton.Dockerfile installs Triton (`run_triton.py --install PREFIX`), PREFIX/bin first on its PATH."""
    steps = instructions(DOCKER / "triton.Dockerfile")
    (prefix,) = [m[1] for step, arguments in steps if step == "RUN" and (m := re.search(r"tools/run_triton\.py --install (\S+)", arguments))]
    assert ("ENV", f"PATH={prefix}/bin:${{PATH}}") in steps
    return prefix


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    """A root holding /opt/tritonserver installed by the Dockerfile's own command."""
    root = tmp_path_factory.mktemp("image")
    subprocess.run([sys.executable, "tools/run_triton.py", "--install", f"{root}{image_prefix()}"], cwd=ROOT, check=True, timeout=60)
    return root


def placed_by_seldons_agent(model: dict, repository: Path) -> str:
    """The Model's folder as Seldon's agent puts it in Triton's repository: under <name>_<version>
    (version 1 for a new Model), its highest version folder copied to 1/, its config.pbtxt with that
    name (seldon-core scheduler/pkg/agent/repository/model_repository.go DownloadModelVersion,
    repository/triton/triton.go UpdateModelRepository, pkg/util/model.go GetVersionedModelName)."""
    name = f"{model['metadata']['name']}_1"
    folder = REPOSITORY / model["spec"]["storageUri"].rstrip("/").rsplit("/", 1)[1]  # the bucket's copy of it
    highest = max((d for d in folder.iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    shutil.copytree(highest, repository / name / "1")
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.name = name
    (repository / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    return name


def seldons_command(version: str, root: Path, env: dict[str, str]) -> list[str]:
    """The ServerConfig's command line as the kubelet runs it: $(VAR) expanded, image paths under
    `root`, and Triton's metrics port (its default, 8002, in the pod) a free one."""
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg) for arg in SELDON_COMMANDS[version]]
    if argv[0].startswith("/"):
        argv[0] = f"{root}{argv[0]}"
    metrics = f"--metrics-port={free_port()}"
    return [*argv[:-1], f"{argv[-1]} {metrics}"] if argv[0] == "bash" else [*argv, metrics]


@pytest.mark.parametrize("version", SELDON_COMMANDS)
def test_seldons_triton_command_line_serves_the_model_its_agent_loads(image_root, tmp_path, version):
    model = the(SELDON / "model.yaml", "Model")
    name = placed_by_seldons_agent(model, tmp_path / "models")
    http_port, grpc_port = free_port(), free_port()
    env = {**SELDON_ENV, "SERVER_HTTP_PORT": str(http_port), "SERVER_GRPC_PORT": str(grpc_port), "SERVER_MODELS_DIR": str(tmp_path / "models")}
    pod_env = {**os.environ, **env, "PATH": f"{image_root}{image_prefix()}/bin{os.pathsep}{os.environ['PATH']}"}
    log = tmp_path / "triton.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(seldons_command(version, image_root, env), stdout=out, stderr=subprocess.STDOUT, env=pod_env)
    live = f"http://127.0.0.1:{http_port}/v2/health/live"  # the ServerConfig's probes
    triton = Server(process, http_port, grpc_port, log)
    wait_for(lambda: requests.get(live, timeout=1).status_code == 200, "Triton live", timeout=60, server=triton)
    try:
        # Every hop execs the next: the kubelet's SIGTERM reaches Triton itself.
        assert Path(f"/proc/{process.pid}/exe").resolve().name == "tritonserver"
        with grpcclient.InferenceServerClient(triton.grpc) as client:
            assert not client.is_model_ready(name)  # explicit model control: nothing loads by itself
            client.load_model(name)  # RepositoryModelLoad, as the agent (modelserver_controlplane/oip/v2.go)
            assert client.is_model_ready(name)
        config = text_format.Parse((tmp_path / "models" / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        (tensor,) = config.input
        images = np.random.default_rng(3).random((config.max_batch_size, *tensor.dims), dtype=np.float32)
        request = httpclient.InferInput(tensor.name, list(images.shape), "FP32")
        request.set_data_from_numpy(images)
        with httpclient.InferenceServerClient(triton.http) as client:  # the agent's proxy forwards REST to Triton's HTTP port
            answer = client.infer(name, [request])
        session = onnxruntime.InferenceSession(tmp_path / "models" / name / "1" / "model.onnx", providers=["CPUExecutionProvider"])
        (expected,) = session.run(None, {tensor.name: images})
        np.testing.assert_allclose(answer.as_numpy(config.output[0].name), expected, rtol=1e-4, atol=1e-4)
        # A full batch passed through the python backend's region fits the ServerConfig's /dev/shm.
        (region,) = shm_regions(process.pid)
        assert region <= SELDON_SHM
    finally:
        stop_server(triton)


# --- The StatefulSet Seldon makes of the Server ----------------------------------------------


@pytest.fixture(scope="module")
def server_statefulset(kubectl) -> dict:
    (server,) = [obj for obj in kustomize(kubectl, SELDON) if obj["kind"] == "Server"]
    return seldon_merge.statefulset(yaml.safe_load(SERVER_CONFIG.read_text()), server)


def test_the_api_server_takes_the_statefulset_seldon_makes_of_the_server(server_statefulset):
    kubernetes_validate.validate(server_statefulset, KUBERNETES_VERSION, strict=True)
    pod = server_statefulset["spec"]["template"]["spec"]
    assert handler_errors(pod) == []  # a hook of the Server's own would join the ServerConfig's
    (triton,) = [container for container in pod["containers"] if container["name"] == "triton"]
    assert triton["image"] == the(SELDON / "server.yaml", "Server")["spec"]["podSpec"]["containers"][0]["image"]
    assert triton["resources"]["limits"]["huawei.com/Ascend910"] == "1"
    env = {var["name"]: var.get("value") for container in pod["containers"] for var in container.get("env", [])}
    assert env[seldon_merge.CAPABILITIES_ENV] == "ascend"


def test_every_container_of_the_server_asks_seldons_agent_to_drain_before_it_stops(server_statefulset):
    # Seldon's agent has the scheduler move the server's models elsewhere, then answers, only when
    # three /terminate calls ("the number of containers in a pod") arrive at its drainer together
    # (seldon-core scheduler/pkg/agent/drainservice/server.go, eventsTarget; v2.6.0 to v2.10.2): the
    # ServerConfig's preStop hook of each container. Triton gets SIGTERM once its hook returns.
    pod = server_statefulset["spec"]["template"]["spec"]
    (agent,) = [container for container in pod["containers"] if container["name"] == "agent"]
    drainer = int({var["name"]: var.get("value") for var in agent["env"]}["SELDON_DRAINER_PORT"])
    for container in pod["containers"]:
        assert container["lifecycle"]["preStop"] == {"httpGet": {"port": drainer, "path": "terminate"}}, container["name"]
    assert len(pod["containers"]) == 3
    # The draining, then Triton's own stop (--exit-timeout-secs: the ServerConfig sets none), within the grace period.
    assert pod["terminationGracePeriodSeconds"] > TRITON_EXIT_TIMEOUT_S


def test_the_merge_follows_mergos_rules():
    """seldon_merge applies mergo's rules (WithOverride, WithAppendSlice) as Seldon's operator does."""
    config = {"name": "triton", "command": ["bash"], "lifecycle": {"preStop": {"httpGet": {"port": 9007, "path": "terminate"}}},
              "securityContext": {"runAsNonRoot": True}, "resources": {"requests": {"cpu": "1", "memory": "1G"}},
              "readinessProbe": {"httpGet": {"path": "/ready", "port": "server-http"}}}
    server = {"name": "triton", "command": ["-c"], "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
              "securityContext": {"runAsNonRoot": False, "runAsUser": 1000}, "resources": {"requests": {"cpu": "2"}},
              "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": 8000}}}
    other = {"name": "agent", "image": "agent:latest"}
    merged, agent = seldon_merge.merge_containers([config, other], [server])
    assert agent == other
    # Pointers merge field by field: both handlers in one hook.
    assert merged["lifecycle"]["preStop"] == {"httpGet": {"port": 9007, "path": "terminate"}, "exec": {"command": ["sleep", "5"]}}
    assert merged["command"] == ["bash", "-c"]  # slices append
    assert merged["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000}  # false (empty) overrides nothing
    assert merged["resources"]["requests"] == {"cpu": "2", "memory": "1G"}  # maps by key
    # IntOrString is a struct of Type, IntVal, StrVal: an int port does not replace a named one.
    assert merged["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "server-http"}
    assert seldon_merge.merge_containers([config], [{"name": "sidecar"}])[0] == {"name": "sidecar"}

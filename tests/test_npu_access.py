"""The NPU's device nodes and driver library, as the images' user (uid 1000) meets them.

On a host they are the HwHiAiUser group's, whose gid differs between hosts (kserve_ascend/core/
npu_access.py). Here FAKE device nodes (regular files: access(2) reads only their owner and mode)
and a fake driver library are made under a directory the check takes for / (its test-only
KSERVE_ASCEND_TEST_DEVICE_ROOT), owned by root and group 1234, a "host's HwHiAiUser gid" uid 1000
is not in; then uid 1000 is run without that group, with it as its group (an image built with
--build-arg HWHIAIUSER_GID=1234) and with it as a supplementary group (Kubernetes' supplementalGroups).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import requests

from conftest import ROOT, Server, fake_acl_env, free_port, load_fake_acl, start, stop_server
from kserve_ascend.core.execution import compile_cache, npu_access
from test_cann_ep import CANN_VENV, CHECK_HOST, cann_python, environment, stubs, user_stubs, workspace  # noqa: F401 (fixtures)
from test_manifests import DOCKER, instructions
from unprivileged import GID, UID, Workspace, as_user

HOST_GID = 1234  # the host's HwHiAiUser group, in this test
NODES = ("davinci0", "davinci_manager", "devmm_svm", "hisi_hdc")
FakeAcl = load_fake_acl()


@pytest.fixture
def device_root(workspace: Workspace) -> Path:
    """/dev/davinci0 ... and the driver's lib64 as a host has them: root's, group HOST_GID, not for others."""
    root = workspace.directory("host", owner=None)
    (root / "dev").mkdir()
    for node in NODES:
        (root / "dev" / node).write_bytes(b"")
    driver = root / "usr/local/Ascend/driver/lib64"
    (driver / "driver").mkdir(parents=True)
    (driver / "driver" / npu_access.DRIVER_LIBRARY).write_bytes(b"\x7fELF")
    for path, mode in [*((root / "dev" / n, 0o660) for n in NODES), (driver, 0o750), (driver / "driver", 0o750),
                       (driver / "driver" / npu_access.DRIVER_LIBRARY, 0o640)]:
        os.chown(path, 0, HOST_GID)
        path.chmod(mode)
    return root


def problems_as(workspace: Workspace, root: Path, **user) -> list[str]:
    """npu_access.problems() in a process of the user `as_user` makes of `user`."""
    script = "import json; from kserve_ascend.core.execution import npu_access; print(json.dumps(npu_access.problems()))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), npu_access.TEST_ROOT_ENV: str(root)}
    python = workspace.python(ROOT / ".venv")
    done = subprocess.run(as_user([str(python), "-c", script], **user), capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout)


def test_outside_the_hosts_group_each_node_and_the_library_are_named_with_the_gid_to_join(workspace, device_root):
    found = problems_as(workspace, device_root)
    fix = (f"Run it in group {HOST_GID}, the NPU driver's group (HwHiAiUser) on this host: build the image with"
           f" --build-arg HWHIAIUSER_GID={HOST_GID}, or add the group (Kubernetes: securityContext.supplementalGroups: [{HOST_GID}]")
    for node, problem in zip(NODES, found):
        assert problem.startswith(f"{device_root}/dev/{node} cannot be opened for reading and writing: it is -rw-rw---- uid 0 gid {HOST_GID},"
                                  f" this process is uid {UID} with gids [{GID}]. {fix}")
    library = found[len(NODES)]
    assert library.startswith(f"the NPU driver's {npu_access.DRIVER_LIBRARY} cannot be reached: {device_root}/usr/local/Ascend/driver/lib64"
                              " cannot be entered: it is drwxr-x---") and fix in library
    assert len(found) == len(NODES) + 1


@pytest.mark.parametrize("user", [{"gid": HOST_GID}, {"groups": (HOST_GID,)}], ids=["its group", "a supplementary group"])
def test_in_the_hosts_group_nothing_is_in_the_way(workspace, device_root, user):
    assert problems_as(workspace, device_root, **user) == []


def test_an_owners_only_node_names_the_owner(workspace, device_root):
    (device_root / "dev" / "hisi_hdc").chmod(0o600)
    (problem,) = problems_as(workspace, device_root, gid=HOST_GID)
    assert problem.endswith("Only its owner may: run as uid 0 (build the image with --build-arg HWHIAIUSER_UID=0)")


def test_a_container_given_no_npu_is_told_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv(npu_access.TEST_ROOT_ENV, str(tmp_path))
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "davinci_manager").write_bytes(b"")
    nodes, library = npu_access.problems()
    assert nodes.startswith(f"no {tmp_path}/dev/davinci<N>, {tmp_path}/dev/devmm_svm, {tmp_path}/dev/hisi_hdc: give the container the NPU")
    assert library.startswith(f"the NPU driver's {npu_access.DRIVER_LIBRARY} is in none of {tmp_path}/usr/local/Ascend/driver/lib64/driver")


def test_the_images_user_is_in_the_group_the_image_is_built_with(workspace, device_root):
    """docker/kserve.Dockerfile's USER, built with --build-arg HWHIAIUSER_GID=<the host's gid>: the process's
    one group (Docker gives a USER uid:gid process no other), which is all the device nodes ask."""
    (user,) = [arguments for instruction, arguments in instructions(DOCKER / "kserve.Dockerfile") if instruction == "USER"]
    built = {"HWHIAIUSER_UID": str(UID), "HWHIAIUSER_GID": str(HOST_GID)}
    uid, gid = re.sub(r"\$\{(\w+)\}", lambda m: built[m[1]], user).split(":")
    assert problems_as(workspace, device_root, uid=int(uid), gid=int(gid)) == []
    assert problems_as(workspace, device_root, uid=int(uid), gid=GID) != []  # built with the default gid, 1000


# ---- the server says it at start, when it serves on the NPU; make check-ascend checks it ---------------


def start_as_user(workspace: Workspace, repository: Path, python: Path, env: dict, **user) -> Server:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [str(python), "-m", "kserve_ascend", "--model_dir", str(repository), "--http_port", str(http_port),
               "--grpc_port", str(grpc_port), "--metrics_port", str(metrics_port)]

    def loaded(server: Server) -> bool:
        index = requests.post(f"{server.url}/v2/repository/index", timeout=1).json()
        return bool(index) and all(entry["state"] != "LOADING" for entry in index)

    return start(as_user(command, **user), workspace.path / "server.log", http_port, grpc_port, metrics_port,
                 ready=loaded, timeout=60, env=env, cwd=workspace.directory("opt", owner=None))


def om_repository(workspace: Workspace) -> Path:
    repository = workspace.directory("models", owner=None)
    (repository / "om" / "1").mkdir(parents=True)
    (repository / "om" / "config.pbtxt").write_text('name: "om"\nbackend: "ascend"\nmax_batch_size: 0\n')
    FakeAcl.fake_write_om(repository / "om" / "1" / "model.om", [("x", FakeAcl.ACL_FLOAT, [4, 3])])
    return repository


def test_the_server_names_what_it_cannot_open_when_it_loads_an_om_model(workspace, device_root):
    env = {**os.environ, **fake_acl_env(), npu_access.TEST_ROOT_ENV: str(device_root)}
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{ROOT}"
    server = start_as_user(workspace, om_repository(workspace), workspace.python(ROOT / ".venv"), env)
    try:
        said = re.findall(r"WARNING.*NPU access: (\S+) cannot be opened", server.output())
        assert said == [str(device_root / "dev" / node) for node in NODES]
        assert f"supplementalGroups: [{HOST_GID}]" in server.output()
    finally:
        stop_server(server)


def test_a_cpu_model_is_served_without_a_word_about_the_npu(workspace, device_root):
    """A CPU-only host serving CPU models: the NPU is never looked for (the CPU build of onnxruntime, `auto`)."""
    repository = workspace.directory("models", owner=None)
    (repository / "simple" / "1").mkdir(parents=True)
    for name in ("config.pbtxt", "1/model.onnx"):
        (repository / "simple" / name).write_bytes((ROOT / "model_repository" / "simple" / name).read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT), npu_access.TEST_ROOT_ENV: str(device_root)}
    server = start_as_user(workspace, repository, workspace.python(ROOT / ".venv"), env)
    try:
        assert requests.get(f"{server.url}/v2/models/simple/ready", timeout=5).status_code == 200
        assert "NPU access" not in server.output()
    finally:
        stop_server(server)


def test_the_cann_execution_provider_path_names_what_it_cannot_open(cann_python, stubs, workspace, device_root):
    env = environment(user_stubs(stubs, workspace), HOME=str(workspace.directory("home")), **{npu_access.TEST_ROOT_ENV: str(device_root)})
    env.pop(compile_cache.ENV, None)  # the user's own, under HOME
    model = workspace.directory("model", owner=None) / "model.onnx"
    model.write_bytes((ROOT / "model_repository" / "simple" / "1" / "model.onnx").read_bytes())
    done = subprocess.run(as_user([str(workspace.python(CANN_VENV)), str(ROOT / "tests/cann_stubs/probe.py"), "load", str(model),
                                   json.dumps([{"execution_provider": "cann"}]), "0", "8"]),
                          capture_output=True, text=True, env=env, cwd=workspace.directory("opt", owner=None), timeout=120)
    (loaded,) = json.loads(done.stdout.splitlines()[-1])
    assert loaded["info"]["execution_provider"] == "CANNExecutionProvider"  # the stubs open no device
    said = re.findall(r"WARNING.*NPU access: (\S+) cannot be opened", done.stderr)
    assert said == [str(device_root / "dev" / node) for node in NODES]


def test_check_ascend_names_what_it_cannot_open_and_passes_in_the_group(cann_python, workspace, device_root):
    toolkit = workspace.directory("toolkit", owner=None)
    (toolkit / "lib64").mkdir()
    (toolkit / "lib64" / "libascendcl.so").write_bytes(b"")
    env = {**environment(), "ASCEND_HOME_PATH": str(toolkit), npu_access.TEST_ROOT_ENV: str(device_root)}
    python = str(workspace.python(CANN_VENV))

    def check(**user) -> list[str]:
        done = subprocess.run(as_user([python, str(CHECK_HOST)], **user), capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 1
        return done.stdout.splitlines()

    denied = check()
    assert denied[1] == "FAIL 2. NPU device access: this user cannot open everything the NPU needs:"
    assert [line.split(" cannot")[0] for line in denied[2:7]] == [
        *(f"     - {device_root}/dev/{node}" for node in NODES), f"     - the NPU driver's {npu_access.DRIVER_LIBRARY}",
    ]
    allowed = check(gid=HOST_GID)
    assert allowed[1] == f"PASS 2. NPU device access: the NPU's device nodes and {npu_access.DRIVER_LIBRARY} are open to uid {UID}"
    assert allowed[2].startswith("FAIL 3. pyACL: import acl failed")  # no CANN here

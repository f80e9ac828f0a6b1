"""ONNX Runtime's CANN execution provider, for real: the onnxruntime-cann wheel the `ascend` extra
pins, in its own virtualenv (.venv/cann, built once by the Makefile), against STUB CANN libraries
that this test compiles (tests/cann_stubs: libascendcl.so, libacl_op_compiler.so,
libfmk_onnx_parser.so export what the provider links, drive no device and compute nothing).

With the stubs the real provider loads, parses its options, calls aclInit and aclrtSetDevice and
a session lands on it; without them it cannot load, as on a host without CANN. The FAKE pyACL
(tests/fake_acl) can run on the stub's ACL too, so an `.om` and the provider share one ACL in a
process, with its once-per-process rule, as they do on a real host. What stubs cannot
show: a model executing on the provider (it compiles the graph through CANN's graph engine on the
first run, saves it as an .om file, which the stub writes as CANN does, and reads results the stubs
never compute); the host check's test shows that failing loudly, past the save.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
import yaml
from onnx import TensorProto, helper

from conftest import FAKE_ACL, REPOSITORY, ROOT, Server, free_port, load_fake_acl, stop_server, wait_for
from kserve_ascend.core.execution import compile_cache, npu_access
from kserve_ascend.core.errors import ModelLoadError
from kserve_ascend.core.execution.runtimes import onnx as onnx_runtime
from kserve_ascend.core.execution.runtimes.tiny_onnx import relu_model
from unprivileged import UID, Workspace, as_user

CANN_VENV = ROOT / ".venv" / "cann"
CANN_PYTHON = CANN_VENV / "bin" / "python"
STUBS = ROOT / "tests" / "cann_stubs"
SIMPLE = REPOSITORY / "simple" / "1" / "model.onnx"
CANN = "CANNExecutionProvider"
CPU = "CPUExecutionProvider"
#: The FAKE pyACL, for its constants and fake_write_om (the probes import their own copy).
FakeAcl = load_fake_acl()


@pytest.fixture(scope="session")
def cann_python() -> Path:
    """The `ascend` install's interpreter (make's stamped target: a no-op once built)."""
    subprocess.run(["make", "--no-print-directory", "-s", str(CANN_VENV.relative_to(ROOT) / ".installed")], cwd=ROOT, check=True)
    return CANN_PYTHON


@pytest.fixture(scope="session")
def stubs(tmp_path_factory) -> Path:
    """The three stub CANN libraries, compiled with gcc / g++."""
    out = tmp_path_factory.mktemp("cann_stubs")
    for compiler, source, library in (
        ("gcc", "acl_stub.c", "libascendcl.so"),
        ("gcc", "acl_op_compiler_stub.c", "libacl_op_compiler.so"),
        ("g++", "fmk_onnx_parser_stub.cc", "libfmk_onnx_parser.so"),
    ):
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(out / library), str(STUBS / source)], check=True)
    return out


#: The compile cache of the processes these tests start (`cache_dir`), not the user's ~/.cache.
CACHE: Path | None = None


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory) -> Path:
    global CACHE
    CACHE = tmp_path_factory.mktemp("compile_cache")
    return CACHE


def environment(stubs: Path | None = None, **extra: str) -> dict[str, str]:
    """This environment without any CANN of its own; the stub libraries first when given."""
    ours = ("ASCEND_", "STUB_ACL_", compile_cache.ENV, npu_access.TEST_ROOT_ENV)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH" and not k.startswith(ours)}
    env["PYTHONPATH"] = str(ROOT)
    if CACHE:
        env[compile_cache.ENV] = str(CACHE)
    if stubs:
        env["LD_LIBRARY_PATH"] = str(stubs)
    return {**env, **extra}


def probe(python: Path, *args: str, env: dict[str, str]) -> tuple[list[dict] | dict, str]:
    """tests/cann_stubs/probe.py in the `ascend` virtualenv: its JSON answer and its stderr.

    In a directory of its own: the provider writes files into the working directory (dump_graphs)."""
    with tempfile.TemporaryDirectory() as workdir:
        done = subprocess.run([str(python), str(STUBS / "probe.py"), *args], capture_output=True, text=True, env=env,
                              cwd=workdir, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def load(python: Path, *cases: dict, env: dict[str, str], model: Path = SIMPLE, device_id: int = 0, max_batch_size: int = 8):
    return probe(python, "load", str(model), json.dumps(cases), str(device_id), str(max_batch_size), env=env)


# ---- the install ---------------------------------------------------------------------------


def test_ascend_extra_installs_onnxruntime_cann_alone(cann_python):
    script = (
        "import importlib.metadata as m, onnxruntime\n"
        "names = {d.metadata['Name'].lower() for d in m.distributions()}\n"
        "print(sorted(n for n in names if n.startswith('onnxruntime')), onnxruntime.__version__,"
        " onnxruntime.get_available_providers())"
    )
    shown = subprocess.run([str(cann_python), "-c", script], capture_output=True, text=True, check=True).stdout
    assert shown.split("]")[0] == "['onnxruntime-cann'"
    assert "1.22.1" in shown and CANN in shown
    check = subprocess.run([str(cann_python), "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_stubs_export_every_cann_symbol_the_provider_links(cann_python, stubs):
    library = next((CANN_VENV / "lib").glob("python3.*/site-packages/onnxruntime/capi/libonnxruntime_providers_cann.so"))
    needed = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True).stdout
    wanted = {line.split()[-1] for line in needed.splitlines() if line.split()[-1].startswith(("acl", "_ZN2ge", "_ZNK2ge"))}
    exported = set()
    for stub in stubs.glob("*.so"):
        defined = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True, check=True).stdout
        exported |= {line.split()[-1] for line in defined.splitlines()}
    assert len(wanted) >= 50 and wanted <= exported, sorted(wanted - exported)


def test_images_install_the_ascend_extra_on_the_paired_cann_and_expose_the_manifests_ports():
    kserve = (ROOT / "docker" / "kserve.Dockerfile").read_text()
    assert "pip install --no-cache-dir '.[ascend]'" in kserve  # into which environment: test_image_python.py
    assert 'ascend = ["onnxruntime-cann==1.22.1"]' in (ROOT / "pyproject.toml").read_text()
    cann = re.search(r"^ARG CANN_IMAGE=quay.io/ascend/cann:(\d+\.\d+)\.", kserve, re.M).group(1)
    assert cann == "8.2"  # onnxruntime's CANN EP documentation: v1.22.1 with CANN 8.2
    runtime = yaml.safe_load((ROOT / "manifests" / "base" / "servingruntime.yaml").read_text())
    args = dict(arg.removeprefix("--").split("=", 1) for arg in runtime["spec"]["containers"][0]["args"])
    assert exposed(kserve) == [args["http_port"], args["grpc_port"], args["metrics_port"]] == ["8080", "8081", "8082"]
    triton = yaml.safe_load((ROOT / "manifests" / "triton" / "deployment.yaml").read_text())
    ports = [str(p["containerPort"]) for p in triton["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert exposed((ROOT / "docker" / "triton.Dockerfile").read_text()) == ports == ["8000", "8001", "8002"]


def exposed(dockerfile: str) -> list[str]:
    return re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()


# ---- without CANN: the wheel lists the provider, which cannot load -------------------------


def test_without_cann_libraries(cann_python):
    """`cann` refuses to load with ORT's reason; `auto` serves on the CPU, degraded, saying why."""
    (cann, auto), stderr = load(cann_python, {"execution_provider": "cann"}, {}, env=environment())
    assert "create CANN ExecutionProvider fail" in cann["error"]  # ORT's own words
    assert "libascendcl.so: cannot open shared object file" in cann["error"]  # why, as the loader says it
    assert auto["info"]["execution_provider"] == CPU
    assert auto["info"]["degraded"] == "true"
    assert "libascendcl.so: cannot open shared object file" in auto["info"]["degraded_reason"]
    assert auto["compiles_per_shape"] is False
    assert "WARNING" in stderr and "serves on the CPU, not on the NPU" in stderr


def test_auto_without_cann_serves_through_the_real_server(cann_python, tmp_path):
    """The KServe server of the `ascend` install: the degraded model answers (on the CPU) and
    says why in its metadata; the one that demands CANN is UNAVAILABLE with the reason."""
    repository = tmp_path / "models"
    for name, mode in (("auto", None), ("demands_cann", "cann")):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "1" / "model.onnx").write_bytes(SIMPLE.read_bytes())
        config = (REPOSITORY / "simple" / "config.pbtxt").read_text().replace('name: "simple"', f'name: "{name}"')
        if mode:
            config += f'parameters {{ key: "execution_provider" value {{ string_value: "{mode}" }} }}\n'
        (repository / name / "config.pbtxt").write_text(config)
    server = start_cann_server(cann_python, repository, tmp_path / "server.log")
    try:
        metadata = requests.get(f"{server.url}/v2/models/auto", timeout=5).json()
        assert metadata["parameters"]["execution_provider"] == CPU
        assert metadata["parameters"]["degraded"] == "true"
        assert "libascendcl.so" in metadata["parameters"]["degraded_reason"]
        a = np.arange(16, dtype=np.int32)
        body = {"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": a.tolist()} for n in ("INPUT0", "INPUT1")]}
        outputs = requests.post(f"{server.url}/v2/models/auto/infer", json=body, timeout=10).json()["outputs"]
        assert {o["name"]: o["data"] for o in outputs} == {"OUTPUT0": (2 * a).tolist(), "OUTPUT1": [0] * 16}
        index = {m["name"]: m for m in requests.post(f"{server.url}/v2/repository/index", timeout=5).json()}
        assert index["demands_cann"]["state"] == "UNAVAILABLE"
        assert "execution_provider is 'cann'" in index["demands_cann"]["reason"]
        assert "libascendcl.so" in index["demands_cann"]["reason"]
    finally:
        stop_server(server)


def start_cann_server(python: Path, repository: Path, log: Path) -> Server:
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [str(python), "-m", "kserve_ascend", "--model_dir", str(repository), "--http_port", str(http_port),
               "--grpc_port", str(grpc_port), "--metrics_port", str(metrics_port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent, env=environment())
    server = Server(process, http_port, grpc_port, log, metrics_port)

    def loaded() -> bool:
        index = requests.post(f"{server.url}/v2/repository/index", timeout=1).json()
        return len(index) == 2 and all(entry["state"] != "LOADING" for entry in index)

    wait_for(loaded, "both models tried", timeout=60, server=server)
    return server


# ---- with the stub CANN libraries: the provider loads ----------------------------------------


def test_with_stubs_the_session_lands_on_cann(cann_python, stubs):
    parameters = {"execution_provider": "cann", "cann.npu_mem_limit": "2147483648", "cann.arena_extend_strategy": "kSameAsRequested",
                  "cann.enable_cann_graph": "0", "cann.precision_mode": "must_keep_origin_dtype"}
    (cann, auto), stderr = load(cann_python, parameters, {}, env=environment(stubs, STUB_ACL_TRACE="1"))
    for loaded in (cann, auto):
        assert loaded["info"]["execution_provider"] == CANN
        assert "degraded" not in loaded["info"]
        assert loaded["compiles_per_shape"] is True
    applied = cann["provider_options"][CANN]
    assert applied["device_id"] == "0" and applied["npu_mem_limit"] == "2147483648"
    assert applied["arena_extend_strategy"] == "kSameAsRequested" and applied["enable_cann_graph"] == "0"
    assert applied["precision_mode"] == "must_keep_origin_dtype"
    assert "stub-acl: aclInit" in stderr and "stub-acl: aclrtSetDevice" in stderr
    # Issue 30: without pyACL the NPU's memory cannot be read, and the measurement says so.
    assert cann["memory"][0] is None and "pyACL is not importable" in cann["memory"][1]


def test_cpu_never_tries_cann(cann_python, stubs):
    (cpu,), stderr = load(cann_python, {"execution_provider": "cpu"}, env=environment(stubs, STUB_ACL_TRACE="1"))
    assert cpu["info"]["execution_provider"] == CPU and "degraded" not in cpu["info"]
    assert "stub-acl" not in stderr


def test_a_device_the_host_lacks_is_a_load_error_in_every_mode(cann_python, stubs):
    """ORT refuses the device id (Triton too refuses an instance on a GPU it lacks)."""
    results, _ = load(cann_python, {"execution_provider": "cann"}, {}, env=environment(stubs, STUB_ACL_DEVICE_COUNT="2"), device_id=2)
    for loaded in results:
        assert "Invalid device ID: 2, must be between 0 (inclusive) and 2 (exclusive)" in loaded["error"]


def test_acl_init_failure(cann_python, stubs):
    """aclInit failing (a driver missing or broken): `cann` refuses, `auto` degrades; ORT logs the code."""
    (cann, auto), stderr = load(cann_python, {"execution_provider": "cann"}, {}, env=environment(stubs, STUB_ACL_INIT_ERROR="500000"))
    assert "create CANN ExecutionProvider fail" in cann["error"]
    assert auto["info"]["degraded"] == "true" and auto["info"]["execution_provider"] == CPU
    assert "CANN failure 500000" in stderr and "aclInit" in stderr


# ---- an .om (FAKE pyACL) and the CANN EP in one process, on one (stub) ACL ---------------------


def mixed(python: Path, stubs: Path, tmp_path: Path, order: str, priming: str = "on") -> dict:
    """probe.py mixed: the FAKE pyACL runs on the stub libascendcl.so's ACL, as the provider does."""
    om = FakeAcl.fake_write_om(tmp_path / "model.om", [("x", FakeAcl.ACL_FLOAT, [4, 3])])
    env = environment(stubs, FAKE_ACL_LIBRARY=str(stubs / "libascendcl.so"), PYTHONPATH=f"{FAKE_ACL}{os.pathsep}{ROOT}")
    result, _ = probe(python, "mixed", order, str(om), str(SIMPLE), priming, env=env)
    return result


@pytest.mark.parametrize("order", ["om,cann", "cann,om"])
def test_an_om_and_a_cann_ep_model_share_acl_in_either_order(cann_python, stubs, tmp_path, order):
    """The provider's own aclInit goes first either way; pyACL's acl.init then answers 100002, and
    nothing of ours finalizes the ACL the provider initialised."""
    result = mixed(cann_python, stubs, tmp_path, order)
    assert result["cann"].get("execution_provider") == CANN, result["cann"]
    assert result["om_output"] == result["om_output_after_cann_closed"] == [[2.5] * 3] * 4
    assert result["acl_init"] == [FakeAcl.ACL_ERROR_REPEAT_INITIALIZE]
    assert result["acl_finalize"] == [] and result["acl_up"] is True and "om_close" not in result
    # Issue 30: with pyACL importable, the session's memory is the device's free memory before and after it.
    assert isinstance(result["cann_memory"][0], int) and result["cann_memory"][1] is None


def test_without_priming_an_om_loaded_first_breaks_the_cann_ep_and_acl(cann_python, stubs, tmp_path):
    """What the priming prevents, with the real provider: after pyACL's acl.init its aclInit gets
    100002 and throws, and unloading its library on that failure calls aclFinalize (ProviderLibrary::Get
    in onnxruntime/core/session/provider_bridge_ort.cc, DeleteRegistry in cann_execution_provider.cc):
    the ONNX model does not load and ACL is gone under the .om."""
    result = mixed(cann_python, stubs, tmp_path, "om,cann", priming="off")
    assert "create CANN ExecutionProvider fail" in result["cann"]["error"]
    assert result["acl_init"] == [FakeAcl.ACL_SUCCESS] and result["acl_up"] is False
    assert f"return code {FakeAcl.ACL_ERROR_UNINITIALIZE}" in result["om_output"]["error"]


# ---- the options, checked as the installed ORT checks them -----------------------------------


def test_option_table_is_the_installed_providers(cann_python, stubs):
    (session,), _ = probe(cann_python, "ort", str(SIMPLE), json.dumps([{}]), env=environment(stubs))
    assert session["providers"][0] == CANN
    assert set(session["provider_options"][CANN]) == {*onnx_runtime.CANN_OPTIONS, onnx_runtime.DEVICE_OPTION}


#: (option, value): what a config may write; ORT's verdict on each is the reference.
OPTION_CASES = [
    ("npu_mem_limit", "2147483648"), ("npu_mem_limit", "0"), ("npu_mem_limit", "18446744073709551615"),
    ("npu_mem_limit", "2G"), ("npu_mem_limit", "-1"), ("npu_mem_limit", " 5"), ("npu_mem_limit", "0x10"),
    ("npu_mem_limit", "1e9"), ("npu_mem_limit", "18446744073709551616"), ("npu_mem_limit", ""),
    ("arena_extend_strategy", "kNextPowerOfTwo"), ("arena_extend_strategy", "kSameAsRequested"),
    ("arena_extend_strategy", "knextpoweroftwo"), ("arena_extend_strategy", "bogus"),
    *(("enable_cann_graph", v) for v in ("0", "1", "true", "false", "True", "False", "TRUE", "yes", "2", "")),
    ("dump_graphs", "1"), ("dump_graphs", "on"), ("dump_om_model", "0"),
    ("precision_mode", "force_fp16"), ("op_select_impl_mode", "high_precision"), ("optypelist_for_implmode", "Gelu"),
    # Unknown to 1.22.1: an invention, one of older documentation, one of later releases.
    ("bogus_key", "1"), ("do_copy_in_default_stream", "1"), ("precision_mode_v2", "fp16"),
]


def test_options_are_refused_exactly_where_ort_refuses_them(cann_python, stubs):
    env = environment(stubs)
    verdicts, _ = probe(cann_python, "ort", str(SIMPLE), json.dumps([{k: v} for k, v in OPTION_CASES]), env=env)
    ours, _ = load(cann_python, *({"execution_provider": "cann", f"cann.{k}": v} for k, v in OPTION_CASES), env=env)
    for (option, value), verdict, loaded in zip(OPTION_CASES, verdicts, ours, strict=True):
        ort_accepts = verdict["providers"][0] == CANN
        assert ort_accepts == ("error" not in loaded), (option, value, verdict["printed"], loaded)
        if not ort_accepts:
            assert "provider option" in verdict["printed"]  # ORT refused it, then fell back to the CPU
            assert f"'cann.{option}'" in loaded["error"] and (option not in onnx_runtime.CANN_OPTIONS or repr(value) in loaded["error"])


def test_option_errors_do_not_depend_on_cann_being_there(cann_python):
    """Without CANN, `auto` would fall back to the CPU; a bad option is still a load error."""
    results, _ = load(cann_python, {"cann.npu_mem_limit": "2G"}, {"cann.enable_cann_subgraph": "1"}, env=environment())
    assert [r.get("error", "")[:40] for r in results] == [
        "parameter 'cann.npu_mem_limit': onnxrunt",
        "parameter 'cann.enable_cann_subgraph': o",
    ]


# ---- in this process (the CPU build of onnxruntime) -------------------------------------------


def config(max_batch_size: int = 8, **parameters: str):
    from tritonclient.grpc import model_config_pb2 as mc

    result = mc.ModelConfig(name="m", max_batch_size=max_batch_size)
    for key, value in parameters.items():
        result.parameters[key].string_value = value
    return result


def write_model(path: Path, first_a, first_b) -> Path:
    """Two independent Relus: inputs a and b, outputs relu_a and relu_b, first dimensions as given."""
    dims = (("a", first_a), ("b", first_b))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [d, 4]) for n, d in dims]
    outputs = [helper.make_tensor_value_info(f"relu_{n}", TensorProto.FLOAT, [d, 4]) for n, d in dims]
    nodes = [helper.make_node("Relu", [n], [f"relu_{n}"]) for n, _ in dims]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(
    "first_a, first_b, max_batch_size, expected",
    [(4, 4, 8, (4,)), ("n", "n", 8, ()), (4, "n", 8, ()), (4, 2, 8, ()), (4, 4, 0, ())],
)
def test_batch_sizes(tmp_path, first_a, first_b, max_batch_size, expected):
    path = write_model(tmp_path / "m.onnx", first_a, first_b)
    runtime = onnx_runtime.OnnxRuntime(path, 0, config(max_batch_size, execution_provider="cpu"))
    assert runtime.batch_sizes == expected
    assert runtime.max_batch_size == (expected[-1] if expected else 0)
    assert runtime.compiles_per_shape is False


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"execution_provider": "npu"}, "execution_provider must be one of auto, cann, cpu, got 'npu'"),
        ({"npu_mem_limit": "4294967296"}, "parameter 'npu_mem_limit' is not read: CANN execution provider options are named cann.npu_mem_limit"),
        ({"cann.device_id": "1"}, "parameter 'cann.device_id' is not allowed: each instance runs on its own NPU"),
        ({"cann.npu_mem_limit": "4G"}, "parameter 'cann.npu_mem_limit': onnxruntime's CANN execution provider refuses '4G'"),
        ({"intra_op_thread_count": "two"}, "parameter intra_op_thread_count must be a whole number, got 'two'"),
    ],
)
def test_config_mistakes_are_load_errors(parameters, message):
    with pytest.raises(ModelLoadError) as error:
        onnx_runtime.OnnxRuntime(SIMPLE, 0, config(**{"execution_provider": "cpu", **parameters}))
    assert message in str(error.value)


@pytest.mark.parametrize("parameters", [{}, {"execution_provider": "auto"}])
def test_auto_with_the_cpu_build_is_the_cpu_without_a_warning(caplog, parameters):
    """A build without the provider (the `cpu` extra) is not a silent fallback: `auto` means the CPU."""
    with caplog.at_level(logging.INFO, logger=onnx_runtime.log.name):
        runtime = onnx_runtime.OnnxRuntime(SIMPLE, 0, config(**parameters))
    assert runtime.info["execution_provider"] == CPU and "degraded" not in runtime.info
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == onnx_runtime.log.name]
    assert (
        "INFO", f"m: model.onnx runs on the CPU: onnxruntime {onnx_runtime.ort.__version__} is a build without {CANN}"
        " (the 'ascend' extra, onnxruntime-cann, has it)"
    ) in said
    assert [level for level, _ in said if level != "INFO"] == []


def test_cann_with_the_cpu_build_names_the_extra():
    with pytest.raises(ModelLoadError) as error:
        onnx_runtime.OnnxRuntime(SIMPLE, 0, config(execution_provider="cann"))
    assert "has no CANNExecutionProvider" in str(error.value) and "'ascend' extra" in str(error.value)


def test_no_onnxruntime_names_both_extras(tmp_path):
    """An install with neither extra: loading an ONNX model says which to install."""
    (tmp_path / "onnxruntime.py").write_text("raise ImportError('No module named onnxruntime')\n")
    script = (
        "from pathlib import Path\n"
        "from kserve_ascend.core.errors import ModelLoadError\n"
        "from kserve_ascend.core.execution.runtimes import load_runtime\n"
        "from tritonclient.grpc import model_config_pb2 as mc\n"
        "try:\n"
        f"    load_runtime(mc.ModelConfig(name='m'), Path({str(SIMPLE)!r}), 0)\n"
        "except ModelLoadError as error:\n"
        "    print(error)\n"
    )
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}).stdout
    assert "onnxruntime is not installed" in shown
    assert "pip install '.[cpu]'" in shown and "pip install '.[ascend]'" in shown


# ---- tools/check_ascend_host.py ----------------------------------------------------------------

CHECK_HOST = ROOT / "tools" / "check_ascend_host.py"


def test_host_check_fails_cleanly_at_the_first_check_here(cann_python):
    done = subprocess.run([str(cann_python), str(CHECK_HOST)], capture_output=True, text=True, env=environment(), timeout=60)
    assert done.returncode == 1 and done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0].startswith("FAIL 1. CANN toolkit environment:") and "no ASCEND_HOME_PATH" in lines[0]
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in lines[1]
    sys.path.insert(0, str(CHECK_HOST.parent))
    import check_ascend_host as check

    assert [name for name, _ in check.CHECKS[:3]] == ["CANN toolkit environment", "NPU device access", "pyACL"]
    assert lines[2:] == [f"SKIP {number}. {name}: needs check 1" for number, (name, _) in enumerate(check.CHECKS[1:], 2)]


def test_the_hand_written_relu_model_is_valid_onnx():
    """Written without `onnx` (not in an Ascend install) for the host check and the ACL priming:
    onnx's full check passes and the CPU computes the host check's expected answer."""
    import onnxruntime

    sys.path.insert(0, str(CHECK_HOST.parent))
    import check_ascend_host as check

    model = relu_model()
    onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
    session = onnxruntime.InferenceSession(model, providers=[CPU])
    assert session.run(None, {"x": np.array([check.INPUT], np.float32)})[0].tolist() == [check.EXPECTED]


# ---- as the images run: uid 1000 in a root-owned working directory ---------------------------


@pytest.fixture
def workspace():
    made = Workspace()
    yield made
    made.remove()


def user_stubs(stubs: Path, workspace: Workspace) -> Path:
    """The stub libraries where the user can load them."""
    copy = workspace.directory("stubs", owner=None)
    for library in stubs.glob("*.so"):
        shutil.copy(library, copy)
    return copy


def test_the_provider_saves_what_it_compiles_in_the_compile_cache_from_a_read_only_directory(cann_python, stubs, workspace):
    """The CANN execution provider saves each compiled subgraph under a relative name (CANN's
    aclgrphSaveModel, written by the stub as CANN's FileSaver writes it) and fails the run when it
    cannot. Run as uid 1000 in a root-owned directory, with the default cache under its HOME (as in the
    images): the .om lands in the cache, the run gets past the save to where the stubs stop."""
    home, workdir = workspace.directory("home"), workspace.directory("opt", owner=None)
    env = {**environment(user_stubs(stubs, workspace), HOME=str(home)), "PYTHONPATH": str(ROOT)}
    env.pop(compile_cache.ENV)  # the default, under HOME, as in the images
    model = workspace.directory("models", owner=None) / "relu.onnx"
    model.write_bytes(relu_model())
    done = subprocess.run(as_user([str(workspace.python(CANN_VENV)), str(STUBS / "probe.py"), "run", str(model)]),
                          capture_output=True, text=True, env=env, cwd=workdir, timeout=120)
    result = json.loads(done.stdout.splitlines()[-1])
    assert "aclgrphSaveModel" not in done.stderr + result.get("run_error", "")
    assert "Unsupported OrtValue type" in result["run_error"]  # ORT's words where the stubs compute nothing
    cache = home / ".cache" / "kserve-ascend" / "onnxruntime-1.22.1-cann-unknown"
    assert result["cwd"] == str(cache)
    (saved,) = cache.glob("*.om")
    assert saved.name.startswith("CANNExecutionProvider_relu_") and saved.stat().st_uid == UID
    assert saved.read_bytes().startswith(b"STUB OM") and stat.S_IMODE(saved.stat().st_mode) == 0o600  # FileSaver's mode
    assert list(workdir.iterdir()) == []


def test_host_check_of_the_provider_and_the_server_as_the_images_user(cann_python, stubs, workspace):
    """Checks 5 and 6 against the real provider on stub CANN, as `docker run ... tools/check_ascend_host.py`
    runs them: uid 1000 in the image's root-owned working directory. The model lands on CANN, its
    compiled subgraph in the compile cache, and both checks fail with ORT's reason where the stubs stop."""
    home, workdir, temporary = workspace.directory("home"), workspace.directory("opt", owner=None), workspace.directory("tmp")
    script = (
        "import argparse, sys, tempfile\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(CHECK_HOST.parent)!r})\n"
        "import check_ascend_host as check\n"
        "work = Path(tempfile.mkdtemp()); (work / 'check.onnx').write_bytes(check.relu_model())\n"
        "args = argparse.Namespace(device=0, workdir=work, timeout=60)\n"
        "for step in (check.cann_provider, check.serve_once):\n"
        "    try:\n"
        "        print('PASS', step(args))\n"
        "    except check.Failed as failure:\n"
        "        print('FAIL', failure)\n"
    )
    env = environment(user_stubs(stubs, workspace), HOME=str(home), TMPDIR=str(temporary))
    env.pop(compile_cache.ENV)  # the default, under HOME, as in the images
    done = subprocess.run(as_user([str(workspace.python(CANN_VENV)), "-c", script]), capture_output=True, text=True,
                          env=env, cwd=workdir, timeout=120)
    provider, served = done.stdout.splitlines()
    assert provider.startswith("FAIL the model loaded on CANNExecutionProvider but running it failed: [ONNXRuntimeError]")
    assert "Unsupported OrtValue type" in provider and "aclgrphSaveModel" not in provider
    assert served.startswith("FAIL") and "Unsupported OrtValue type" in served  # ORT's words, from the server
    saved = list((home / ".cache" / "kserve-ascend").glob("*/CANNExecutionProvider_relu_*.om"))
    assert len(saved) == 2 and all(om.stat().st_uid == UID for om in saved)  # the session's and the server's
    assert list(workdir.iterdir()) == []


def test_the_compile_cache_serves_the_next_process_and_forgets_a_changed_model(cann_python, stubs, tmp_path):
    """The provider loads `<subgraph>_<shape hash>.om` from the working directory instead of compiling;
    the name hashes the model's path, not its content, so a model replaced at the same path must
    compile again, not load what its predecessor compiled."""
    model = tmp_path / "model.onnx"
    env = environment(stubs, STUB_ACL_TRACE="1", **{compile_cache.ENV: str(tmp_path / "cache")})

    def run() -> str:
        result, stderr = probe(cann_python, "run", str(model), env=env)
        assert "Unsupported OrtValue type" in result["run_error"]
        return stderr

    model.write_bytes(relu_model())
    first = run()
    assert "stub-ge: aclgrphBuildModel" in first and "stub-ge: aclgrphSaveModel" in first
    again = run()  # a restart: the compiled model is loaded from the cache
    assert "stub-acl: aclmdlLoadFromFile" in again and "stub-ge: aclgrphBuildModel" not in again
    changed = onnx.load_from_string(relu_model())
    changed.graph.node[0].op_type = "Abs"  # same graph, tensor names and shapes: the same .om name
    onnx.save(changed, model)
    replaced = run()
    assert "stub-ge: aclgrphBuildModel" in replaced and "stub-acl: aclmdlLoadFromFile" not in replaced
    assert f"{model} changed since models were compiled from it" in replaced and "1 compiled model(s) removed" in replaced
    assert "stub-acl: aclmdlLoadFromFile" in run()  # the new one is kept


def test_a_compile_cache_that_cannot_be_made_fails_the_cann_load_naming_it(cann_python, stubs, tmp_path):
    (tmp_path / "file").write_text("")
    env = environment(stubs, **{compile_cache.ENV: str(tmp_path / "file" / "cache")})
    (cann, auto), _ = load(cann_python, {"execution_provider": "cann"}, {}, env=env)
    assert f"the compile cache {tmp_path}/file/cache/onnxruntime-1.22.1-cann-unknown cannot be made (Not a directory)" in cann["error"]
    assert f"Set {compile_cache.ENV} to a writable directory" in cann["error"]
    assert auto["info"]["degraded"] == "true" and "cannot be made" in auto["info"]["degraded_reason"]


def test_a_user_without_a_home_is_told_to_name_the_compile_cache(workspace):
    """Kubernetes may run an image as a uid its /etc/passwd lacks, with no HOME."""
    script = (
        "from pathlib import Path\n"
        "from kserve_ascend.core.execution import compile_cache\n"
        "try:\n"
        "    compile_cache.enter(Path('model.onnx'), 'onnxruntime-1.22.1')\n"
        "except compile_cache.Unwritable as error:\n"
        "    print(error)\n"
    )
    env = {k: v for k, v in environment().items() if k not in ("HOME", "XDG_CACHE_HOME", compile_cache.ENV)}
    done = subprocess.run(as_user([str(workspace.python(ROOT / ".venv")), "-c", script], uid=4321, gid=4321),
                          capture_output=True, text=True, env=env, cwd=workspace.path, check=True)
    assert done.stdout == f"uid 4321 has no home directory for the compile cache: set {compile_cache.ENV} to a writable directory\n"

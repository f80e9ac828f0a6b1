"""Is this host ready to serve on Ascend NPUs? `make check-ascend` (or, in the kserve-ascend image,
`python tools/check_ascend_host.py`). Five checks in order, each a PASS or FAIL line, a FAIL with
its fix; the first failure ends the run, as every check needs the ones before it:

  1. the CANN toolkit's environment (set_env.sh sourced: ASCEND_HOME_PATH, libascendcl.so);
  2. the NPU's device nodes and the driver's library, open to this user (kserve_ascend/core/execution/npu_access.py);
  3. pyACL: `import acl` and `acl.init`;
  4. an NPU: `acl.rt.get_device_count` and the device asked for;
  5. ONNX Runtime's CANN execution provider: onnxruntime-cann installed alone, the provider listed,
     and a tiny generated model that loads on it and runs once with the right result;
  6. that model served by the real server (`python -m kserve_ascend`) and one request answered;
  7. that model compiled by ATC with batch gears, run by the acl runtime through pyACL, every pyACL
     call recorded into a trace that replays as a test (kserve_ascend/core/execution/runtimes/acl_trace.py).

Checks 5 and 6 run in the directory they are started in, as the images do (a root-owned one):
the provider saves what it compiles in the compile cache (kserve_ascend/core/execution/compile_cache.py).

Exit status: 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kserve_ascend.core.execution import compile_cache, npu_access
from kserve_ascend.core.execution.runtimes.tiny_onnx import relu_model

ROOT = Path(__file__).resolve().parent.parent
CANN = "CANNExecutionProvider"
#: The CANN that onnxruntime's CANN EP documentation pairs with the onnxruntime-cann of the `ascend` extra.
PAIRED_CANN = "8.2"
ACL_ERROR_REPEAT_INITIALIZE = 100002  # acl_base.h: someone in this process initialised ACL already
INPUT = [-1.5, 2.0, -3.0, 4.0]
EXPECTED = [0.0, 2.0, 0.0, 4.0]


class Failed(Exception):
    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.fix = fix


# ---- the checks: each returns what it found, or raises Failed ----------------------------------


def cann_toolkit(args) -> str:
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if not home:
        raise Failed(
            "the CANN toolkit's environment is not set (no ASCEND_HOME_PATH): ONNX Runtime's CANN execution"
            " provider and pyACL cannot find CANN's libraries",
            "install the CANN toolkit and run `source /usr/local/Ascend/ascend-toolkit/set_env.sh` in this shell"
            " (the kserve-ascend image, built on Ascend's CANN image, sets it)",
        )
    library = Path(home, "lib64", "libascendcl.so")
    if not library.exists():
        raise Failed(f"ASCEND_HOME_PATH is {home}, but {library} does not exist", "reinstall the CANN toolkit, or source the set_env.sh of the one installed")
    version = compile_cache.cann_version()
    found = f"CANN toolkit {version or '(version unknown)'} at {home}"
    if version and not version.startswith(PAIRED_CANN):
        found += f"; note: the pinned onnxruntime-cann is documented for CANN {PAIRED_CANN}"
    return found


def npu_device_access(args) -> str:
    unusable = npu_access.problems()
    if unusable:
        raise Failed(
            "this user cannot open everything the NPU needs:" + "".join(f"\n     - {problem}" for problem in unusable),
            "as each line says; the host's HwHiAiUser gid is `getent group HwHiAiUser | cut -d: -f3` on the host",
        )
    return f"the NPU's device nodes and {npu_access.DRIVER_LIBRARY} are open to uid {os.getuid()}"


def pyacl(args) -> str:
    try:
        import acl
    except ImportError as error:
        raise Failed(f"import acl failed: {error}", "pyACL ships with the CANN toolkit: `source set_env.sh` puts it on PYTHONPATH") from None
    ret = acl.init()
    if ret not in (0, ACL_ERROR_REPEAT_INITIALIZE):
        raise Failed(
            f"acl.init() returned {ret}",
            "look the code up in CANN's acl_base.h / rt_error_codes.h; check the NPU driver (`npu-smi info`) and CANN's logs (~/ascend/log)",
        )
    return f"import acl ({Path(acl.__file__).parent}), acl.init() = {ret}"


def npu(args) -> str:
    import acl

    count, ret = acl.rt.get_device_count()
    if ret != 0 or count < 1:
        raise Failed(
            f"no NPU is visible (acl.rt.get_device_count: {count} devices, return code {ret})",
            "check the driver with `npu-smi info`; in a container, give it the NPUs (Ascend Docker Runtime, or the"
            " device plugin's huawei.com/Ascend910 / Ascend310 resource in Kubernetes)",
        )
    if not 0 <= args.device < count:
        raise Failed(f"device {args.device} does not exist: this host has NPUs 0..{count - 1}", "pass --device with one of those")
    acl.finalize()  # the next checks initialise ACL in their own processes
    return f"{count} NPU(s); checking device {args.device}"


def cann_provider(args) -> str:
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    if "onnxruntime-cann" not in installed:
        raise Failed("onnxruntime-cann is not installed", "install kserve-ascend's `ascend` extra: pip install '.[ascend]' in the clone")
    if "onnxruntime" in installed:
        raise Failed(
            "the CPU onnxruntime is installed beside onnxruntime-cann: both own the `onnxruntime` package, the last one installed wins",
            "pip uninstall -y onnxruntime onnxruntime-cann && pip install '.[ascend]'",
        )
    import onnxruntime

    if CANN not in onnxruntime.get_available_providers():
        raise Failed(f"onnxruntime {onnxruntime.__version__} does not list {CANN}", "pip uninstall -y onnxruntime onnxruntime-cann && pip install '.[ascend]'")
    # In a process of its own: the provider initialises ACL, which this process just finalised.
    done = subprocess.run(
        [sys.executable, __file__, "--session", str(args.workdir / "check.onnx"), "--device", str(args.device)],
        capture_output=True, text=True, env=environment(),
    )
    try:
        result = json.loads(done.stdout.splitlines()[-1])
    except (IndexError, ValueError):
        raise Failed(f"the session check crashed (exit {done.returncode}): {done.stderr.strip()[-2000:]}", "see onnxruntime's and CANN's messages above") from None
    if "error" in result:
        raise Failed(result["error"], "see onnxruntime's reason; CANN's own logs are in ~/ascend/log")
    return f"onnxruntime {onnxruntime.__version__}: a session on {CANN}, device {args.device}, ran Relu correctly"


def session(model: str, device: int) -> dict:
    """Run as `--session`: the project's ONNX runtime demands CANN, loads `model` and runs it once."""
    import numpy as np
    from tritonclient.grpc import model_config_pb2 as mc

    from kserve_ascend.core.errors import ModelLoadError
    from kserve_ascend.core.execution.runtimes import load_runtime

    config = mc.ModelConfig(name="check")
    config.parameters["execution_provider"].string_value = "cann"
    try:
        runtime = load_runtime(config, Path(model), device)
        output = runtime.run({"x": np.array([INPUT], np.float32)}, ["y"])["y"]
    except ModelLoadError as error:
        return {"error": str(error)}
    except Exception as error:  # an execution on the NPU that failed
        return {"error": f"the model loaded on {CANN} but running it failed: {error}"}
    if output.tolist() != [EXPECTED]:
        return {"error": f"Relu({INPUT}) on the NPU gave {output.tolist()[0]}, not {EXPECTED}"}
    return {"info": dict(runtime.info)}


def serve_once(args) -> str:
    repository = args.workdir / "models"
    version = repository / "check" / "1"
    version.mkdir(parents=True)
    shutil.copy(args.workdir / "check.onnx", version / "model.onnx")
    (repository / "check" / "config.pbtxt").write_text(
        'name: "check"\nbackend: "ascend"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]\n'
        'parameters { key: "execution_provider" value { string_value: "cann" } }\n'
        f'parameters {{ key: "device_ids" value {{ string_value: "{args.device}" }} }}\n'
    )
    ports = [free_port() for _ in range(3)]
    log = args.workdir / "server.log"
    command = [sys.executable, "-m", "kserve_ascend", "--model_dir", str(repository), "--http_port", str(ports[0]),
               "--grpc_port", str(ports[1]), "--metrics_port", str(ports[2])]
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment())
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        wait_ready(server, url, log, args.timeout)
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": INPUT}]}
        try:
            answer = http(f"{url}/v2/models/check/infer", body)
        except urllib.error.HTTPError as error:
            raise Failed(f"the request failed with {error.code}: {error.read().decode(errors='replace')}", f"see the server's log, {log}") from None
        output = answer["outputs"][0]["data"]
        if output != EXPECTED:
            raise Failed(f"the server answered {output}, not {EXPECTED}", f"see the server's log, {log}")
        provider = http(f"{url}/v2/models/check")["parameters"].get("execution_provider")
        return f"python -m kserve_ascend served 'check' on {provider}: one request answered correctly"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def wait_ready(server: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Until the model is READY (it compiles and warms up first); a model that failed to load fails the check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise Failed(f"the server exited with {server.returncode}:{tail(log)}", f"see the server's log, {log}")
        try:
            (model,) = http(f"{url}/v2/repository/index", {})
        except (urllib.error.URLError, ConnectionError):
            model = {}
        if model.get("state") == "READY":
            return
        if model.get("state") == "UNAVAILABLE":
            raise Failed(f"the server could not load the model: {model.get('reason')}", f"see the server's log, {log}")
        time.sleep(0.5)
    raise Failed(f"the model was not ready after {timeout:.0f} s:{tail(log)}", f"see the server's log, {log}; --timeout allows longer")


# ---- helpers ----------------------------------------------------------------------------------


def environment() -> dict[str, str]:
    """This environment, with the project importable when run from a clone."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or b"{}")


def tail(log: Path, lines: int = 15) -> str:
    return "\n    ".join([""] + log.read_text(errors="replace").splitlines()[-lines:])


def om_through_pyacl(args) -> str:
    from kserve_ascend.core.execution.runtimes.acl_trace import HostCheckFailed, host_check  # numpy: only here

    try:
        return host_check(args.workdir, args.device, args.trace, args.timeout, environment())
    except HostCheckFailed as failure:
        raise Failed(str(failure), failure.fix) from None


CHECKS = [
    ("CANN toolkit environment", cann_toolkit),
    ("NPU device access", npu_device_access),
    ("pyACL", pyacl),
    ("NPU device", npu),
    ("ONNX Runtime CANN execution provider", cann_provider),
    ("a model served through kserve-ascend", serve_once),
    ("an ATC-built .om through pyACL, recorded", om_through_pyacl),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=0, help="the NPU to check (default 0)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the server may take to load and warm up the model")
    parser.add_argument("--trace", type=Path, help="where check 7 writes its pyACL trace (default: it says)")
    parser.add_argument("--session", metavar="MODEL", help=argparse.SUPPRESS)  # the child of check 4
    args = parser.parse_args()
    if args.session:
        print(json.dumps(session(args.session, args.device)))
        return 0
    with tempfile.TemporaryDirectory(prefix="check-ascend-") as workdir:
        args.workdir = Path(workdir)
        (args.workdir / "check.onnx").write_bytes(relu_model())
        for number, (name, check) in enumerate(CHECKS, 1):
            try:
                found = check(args)
            except Failed as failure:
                print(f"FAIL {number}. {name}: {failure}\n       fix: {failure.fix}")
                for later, (skipped, _) in enumerate(CHECKS[number:], number + 1):
                    print(f"SKIP {later}. {skipped}: needs check {number}")
                return 1
            print(f"PASS {number}. {name}: {found}")
    print("This host serves on its NPU.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

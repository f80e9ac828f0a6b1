"""pyACL traces (kserve_ascend/core/execution/runtimes/acl_trace.py): every trace in tests/data/acl_traces/ —
recorded on Ascend hosts by `make check-ascend`, or from the FAKE pyACL — replays through the `.om`
runtime here, and a replay fails naming the call where the runtime departs from the trace."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from conftest import FAKE_ACL, ROOT, load_fake_acl
from kserve_ascend.core.errors import DeviceError
from kserve_ascend.core.execution.runtimes.acl_trace import (
    DYNAMIC_BATCH_INPUT, HostCheckFailed, ReplayMismatch, dump, host_check, record, replay,
)
from kserve_ascend.core.execution.runtimes.tiny_onnx import relu_model

TRACES = sorted((ROOT / "tests" / "data" / "acl_traces").glob("*.json"))
WRITE_FAKE_TRACE = ROOT / "tools" / "fake_acl_trace.py"


def placeholder(trace: dict, folder: Path) -> Path:
    """A file where the replayed runtime expects the model: its content is never read."""
    model = folder / trace["model"]["file"]
    model.write_bytes(b"")
    return model


@pytest.mark.parametrize("path", TRACES, ids=[path.name for path in TRACES])
def test_every_trace_replays_through_the_om_runtime(path, tmp_path):
    trace = json.loads(path.read_text())
    runtime = replay(trace, placeholder(trace, tmp_path))
    described = trace["model"]
    gear_input = described.get("gear_input", {}).get("index")
    assert [s.name for s in runtime.inputs] == [t["name"] for i, t in enumerate(described["inputs"]) if i != gear_input]
    assert len(runtime.outputs) == len(described["outputs"])
    assert list(runtime.batch_sizes) == (described["gears"] or list(runtime.batch_sizes))
    if gear_input is not None:
        assert described["inputs"][gear_input]["name"] == DYNAMIC_BATCH_INPUT
        assert described["gear_input"]["size"] > 0


def test_traces_are_shipped_and_the_fake_one_is_what_its_command_writes(tmp_path):
    assert any(path.name == "fake-relu-gears.json" for path in TRACES)
    written = tmp_path / "fake.json"
    subprocess.run([sys.executable, str(WRITE_FAKE_TRACE), str(written)], check=True, capture_output=True, timeout=60)
    assert written.read_text() == (ROOT / "tests" / "data" / "acl_traces" / "fake-relu-gears.json").read_text()


@pytest.fixture
def fake_trace(tmp_path):
    trace = json.loads((ROOT / "tests" / "data" / "acl_traces" / "fake-relu-gears.json").read_text())
    return trace, placeholder(trace, tmp_path)


def first(trace: dict, call: str) -> int:
    return next(i for i, entry in enumerate(trace["calls"]) if entry["call"] == call)


def test_a_call_with_other_arguments_fails_the_replay_naming_it(fake_trace):
    trace, model = fake_trace
    changed = copy.deepcopy(trace)
    sync = first(changed, "acl.rt.synchronize_stream_with_timeout")
    changed["calls"][sync]["args"][1] = 1000  # the runtime waits 30000 ms, its default
    with pytest.raises(ReplayMismatch, match=rf"call {sync + 1}: the runtime called acl\.rt\.synchronize_stream_with_timeout\(\d+, 30000\)"):
        replay(changed, model)


def test_a_call_the_trace_does_not_have_fails_the_replay_naming_it(fake_trace):
    trace, model = fake_trace
    changed = copy.deepcopy(trace)
    del changed["calls"][first(changed, "acl.mdl.set_dynamic_batch_size")]
    with pytest.raises(ReplayMismatch, match=r"the runtime called acl\.mdl\.set_dynamic_batch_size\(.*the trace has acl\.mdl\.execute_async"):
        replay(changed, model)


def test_calls_the_runtime_no_longer_makes_fail_the_replay(fake_trace):
    trace, model = fake_trace
    changed = copy.deepcopy(trace)
    changed["calls"].append({"call": "acl.rt.reset_device", "args": [0], "result": 0})
    with pytest.raises(ReplayMismatch, match=r"made 73 of the trace's 74 calls; next was acl\.rt\.reset_device\(0\)"):
        replay(changed, model)


def test_a_failed_session_is_recorded_with_its_error_and_replays_to_the_same_error(tmp_path):
    fake = load_fake_acl()
    om = fake.fake_write_om(tmp_path / "check.om", [("x", fake.ACL_FLOAT, [-1, 4])], dynamic_batch=[1, 2])
    fake.fake_inject("acl.mdl.execute_async", fake.ACL_ERROR_RT_AICORE_EXCEPTION, after=1)  # the second batch
    with pytest.raises(DeviceError) as caught:
        record(fake, om, mc.ModelConfig())
    trace = json.loads(dump(caught.value.trace))
    assert trace["error"].startswith("DeviceError: acl.rt.synchronize_stream_with_timeout failed with return code 507015")
    assert [c["call"] for c in trace["calls"][-2:]] == ["acl.rt.reset_device", "acl.finalize"]  # to the end
    assert "acl.rt.destroy_stream_force" in {c["call"] for c in trace["calls"]}  # a fatal fault's release
    assert replay(trace, om) is None  # the same calls, the same error
    changed = copy.deepcopy(trace)
    changed["error"] = "DeviceError: something else"
    with pytest.raises(DeviceError):
        replay(changed, om)


def test_a_pyacl_without_a_call_is_recorded_and_replayed_without_it(tmp_path, monkeypatch):
    fake = load_fake_acl()
    monkeypatch.delattr(fake.util, "ptr_to_numpy")
    om = fake.fake_write_om(tmp_path / "m.om", [("x", fake.ACL_INT32, [-1, 3])], dynamic_batch=[1, 2])
    trace, done = record(fake, om, mc.ModelConfig(), device_id=0)
    assert trace["absent"] == ["acl.util.ptr_to_numpy"]
    assert all((outputs["x_out"] == inputs["x"]).all() for inputs, outputs in done)
    assert {"acl.rt.malloc_host"} <= {c["call"] for c in trace["calls"]}
    pinned = [c["result"][0] for c in trace["calls"] if c["call"] == "acl.rt.malloc_host"]
    assert pinned == [1 << 40, 2 << 40]  # stand-ins: the same in every run
    replay(json.loads(dump(trace)), om)  # views of the replay's own pinned memory, through ctypes


def test_the_record_command_records_any_om_with_the_acl_on_the_path(tmp_path):
    fake = load_fake_acl()
    om = fake.fake_write_om(tmp_path / "m.om", [("x", fake.ACL_FLOAT, [2, 3])], outputs=[("y", fake.ACL_FLOAT, [2, 3])])
    config = tmp_path / "config.pbtxt"
    config.write_text('name: "m"\nparameters { key: "execution_timeout_ms" value { string_value: "5000" } }\n')
    trace = tmp_path / "trace.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_ACL), str(ROOT)])}
    command = [sys.executable, "-m", "kserve_ascend.core.execution.runtimes.acl_trace", "record", str(om), str(trace)]
    subprocess.run(command + ["--config", str(config)], check=True, capture_output=True, env=env, timeout=60)
    written = json.loads(trace.read_text())
    assert written["runs"] == [2] and written["host"]["acl"] == str(FAKE_ACL / "acl.py")
    assert [c["args"][1] for c in written["calls"] if c["call"] == "acl.rt.synchronize_stream_with_timeout"] == [5000]
    replay(written, om)


# ---- make check-ascend's check 7, here with a stub ATC and the FAKE pyACL ----------------------------

STUB_ATC = """#!{python}
import json, sys
from pathlib import Path
import acl  # the FAKE, on PYTHONPATH: writes its kind of .om
options = dict(arg[2:].split("=", 1) for arg in sys.argv[1:])
Path({argv!r}).write_text(json.dumps(options))
gears = [int(g) for g in options["dynamic_batch_size"].split(",")]
acl.fake_write_om(options["output"] + ".om", [("x", acl.ACL_FLOAT, [-1, 4])],
                  outputs=[("y", acl.ACL_FLOAT, [-1, 4])], dynamic_batch=gears, atc_names=True, relu={relu})
"""


def check_environment(tmp_path, atc: bool = True, relu: bool = True) -> dict:
    """The FAKE pyACL, and on PATH a stub `atc` that writes a FAKE .om (computing Relu, or a copy)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if atc:
        (bin_dir / "atc").write_text(STUB_ATC.format(python=sys.executable, argv=str(tmp_path / "atc.json"), relu=relu))
        (bin_dir / "atc").chmod(0o755)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_ACL), str(ROOT)]),
            "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]])}


def test_the_host_check_compiles_with_atc_runs_each_gear_and_records_the_session(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "check.onnx").write_bytes(relu_model())
    trace = tmp_path / "host.json"
    found = host_check(work, 0, trace, 60, check_environment(tmp_path))
    assert found.startswith("ATC compiled the Relu model for FAKE_SOC with gears 1,2,4, the acl runtime ran each gear")
    assert f"its 73 pyACL calls are in {trace}" in found and "copy it into tests/data/acl_traces/" in found
    options = json.loads((tmp_path / "atc.json").read_text())
    assert options == {"model": str(work / "check.onnx"), "framework": "5", "output": str(work / "check"),
                       "soc_version": "FAKE_SOC", "input_shape": "x:-1,4", "dynamic_batch_size": "1,2,4"}
    written = json.loads(trace.read_text())
    assert written["host"]["soc"] == "FAKE_SOC" and written["runs"] == [1, 2, 4]
    assert written["model"]["outputs"][0]["name"] == "node_0:0:y"
    replay(written, work / "check.om")


def test_the_host_check_fails_on_a_wrong_answer_and_keeps_the_trace(tmp_path):
    (tmp_path / "check.onnx").write_bytes(relu_model())
    trace = tmp_path / "host.json"
    with pytest.raises(HostCheckFailed) as caught:
        host_check(tmp_path, 0, trace, 60, check_environment(tmp_path, relu=False))  # y is a copy of x
    assert str(caught.value).startswith("Relu([[-3.0, -2.0, -1.0, 0.0]]) on the NPU gave [[-3.0, -2.0, -1.0, 0.0]]")
    assert str(trace) in str(caught.value) and "report it with the trace" in caught.value.fix
    replay(json.loads(trace.read_text()), tmp_path / "check.om")


def test_the_host_check_without_atc_says_where_atc_comes_from(tmp_path):
    (tmp_path / "check.onnx").write_bytes(relu_model())
    with pytest.raises(HostCheckFailed, match="ATC") as caught:
        host_check(tmp_path, 0, None, 60, check_environment(tmp_path, atc=False))
    assert "set_env.sh" in caught.value.fix


def test_check_ascend_host_runs_it_as_its_last_check_and_reports_its_failure(tmp_path):
    (tmp_path / "check.onnx").write_bytes(relu_model())
    script = (
        "import argparse, sys\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(ROOT / 'tools')!r})\n"
        "import check_ascend_host as check\n"
        "assert check.CHECKS[-1][1] is check.om_through_pyacl\n"
        f"args = argparse.Namespace(workdir=Path({str(tmp_path)!r}), device=0, trace=Path({str(tmp_path / 't.json')!r}), timeout=60)\n"
        "try:\n"
        "    print('PASS', check.om_through_pyacl(args))\n"
        "except check.Failed as failure:\n"
        "    print('FAIL', failure, '| fix:', failure.fix)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=check_environment(tmp_path, relu=False))
    assert done.stdout.startswith("FAIL Relu([[-3.0, -2.0, -1.0, 0.0]]) on the NPU gave"), done.stderr[-2000:]
    assert "| fix: report it with the trace" in done.stdout
    assert json.loads((tmp_path / "t.json").read_text())["format"] == "kserve-ascend-acl-trace/1"


def test_a_load_that_fails_is_recorded_to_acl_finalize(tmp_path):
    fake = load_fake_acl()
    om = fake.fake_write_om(tmp_path / "check.om", [("x", fake.ACL_FLOAT, [2, 4])])
    fake.fake_inject("acl.rt.malloc", fake.ACL_ERROR_BAD_ALLOC)
    with pytest.raises(DeviceError) as caught:
        record(fake, om, mc.ModelConfig())
    trace = json.loads(dump(caught.value.trace))
    assert trace["error"].startswith("DeviceError: acl.rt.malloc failed with return code 200000")
    assert trace["calls"][-1]["call"] == "acl.finalize" and fake.fake_leaks() == {}
    assert replay(trace, om) is None

"""AclRuntime against the recording fake of pyACL (tests/fake_acl/acl.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from conftest import FAKE_ACL, ROOT, load_fake_acl
from kserve_ascend.core.errors import DeviceError, InvalidInput, ModelLoadError, ModelNotReady
from kserve_ascend.core.execution.runtimes import acl_process
from kserve_ascend.core.execution.runtimes.acl import AclRuntime, served_output_names

#: One FAKE pyACL for most tests; ACL's initialisation outlives fake_reset() as it outlives every
#: model of a process. Tests about the process itself take a `fresh` copy: a new process.
fake = load_fake_acl()
GEARS = [1, 2, 4, 8]


_loaded: list[AclRuntime] = []


@pytest.fixture(autouse=True)
def clean_fake():
    fake.fake_reset()
    yield
    # A failed test must not leave the process-wide reference of its runtimes behind.
    while _loaded:
        try:
            _loaded.pop().close()
        except DeviceError:
            pass
    fake.fake_release()
    fake.fake_reset()


@pytest.fixture
def fresh():
    """The FAKE pyACL of a new process: ACL not initialised yet, older CANN."""
    return load_fake_acl()


@pytest.fixture
def dynamic_om(tmp_path):
    return fake.fake_write_om(
        tmp_path / "dynamic.om",
        [("x", fake.ACL_FLOAT, [-1, 3]), ("ids", fake.ACL_INT64, [-1, 2])],
        dynamic_batch=GEARS,
    )


@pytest.fixture
def static_om(tmp_path):
    return fake.fake_write_om(tmp_path / "static.om", [("x", fake.ACL_FLOAT, [4, 3])])


def model_config(outputs=(), **parameters) -> mc.ModelConfig:
    config = mc.ModelConfig(output=[mc.ModelOutput(name=name) for name in outputs])
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


def load(path, device_id=0, config=None, acl=fake) -> AclRuntime:
    runtime = AclRuntime(path, device_id, config or mc.ModelConfig(), acl=acl)
    _loaded.append(runtime)
    return runtime


def batch(rows: int) -> dict[str, np.ndarray]:
    return {
        "x": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 0.5,
        "ids": np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) - 7,
    }


def names(calls) -> list[str]:
    return [c.name for c in calls]


def calls_since(mark: int, acl=fake):
    return acl.fake_calls()[mark:]


def is_subsequence(wanted: list[str], actual: list[str]) -> bool:
    remaining = iter(actual)
    return all(name in remaining for name in wanted)


# ---- lifecycle -------------------------------------------------------------------------------


def test_load_follows_the_pyacl_lifecycle_order(fresh, dynamic_om):
    runtime = load(dynamic_om, acl=fresh)
    loaded = fresh.fake_call_names()
    assert loaded[:8] == [
        "acl.init",
        "acl.rt.set_device",
        "acl.rt.create_context",
        "acl.rt.create_stream",
        "acl.rt.get_mem_info",  # the device's free memory before the load (what it takes: before - after)
        "acl.mdl.load_from_file",
        "acl.mdl.create_desc",
        "acl.mdl.get_desc",
    ]
    assert is_subsequence(
        [
            "acl.mdl.get_dynamic_batch",
            "acl.mdl.get_input_index_by_name",
            "acl.mdl.get_num_inputs",
            "acl.mdl.get_num_outputs",
            "acl.rt.malloc",
            "acl.rt.malloc_host",
            "acl.util.ptr_to_numpy",
            "acl.mdl.create_dataset",
            "acl.create_data_buffer",
            "acl.mdl.add_dataset_buffer",
        ],
        loaded,
    )
    runtime.close()


def test_run_queues_on_the_stream_and_waits_once(dynamic_om):
    runtime = load(dynamic_om, config=model_config(execution_timeout_ms="250"))
    mark = len(fake.fake_calls())
    runtime.run(batch(2), [])
    calls = calls_since(mark)
    assert names(calls) == [
        "acl.rt.set_context",
        "acl.rt.memcpy_async",
        "acl.rt.memcpy_async",  # H2D, one per input
        "acl.mdl.set_dynamic_batch_size",
        "acl.mdl.execute_async",
        "acl.rt.memcpy_async",
        "acl.rt.memcpy_async",  # D2H, one per output
        "acl.rt.synchronize_stream_with_timeout",
    ]
    (create_stream,) = [c for c in fake.fake_calls() if c.name == "acl.rt.create_stream"]
    stream = create_stream.result[0]
    assert {c.args[-1] for c in calls if c.name in ("acl.rt.memcpy_async", "acl.mdl.execute_async")} == {stream}
    assert calls[-1].args == (stream, 250)  # the config's execution_timeout_ms


def test_close_releases_everything_but_acl_itself(dynamic_om):
    runtime = load(dynamic_om)
    runtime.run(batch(2), [])
    mark = len(fake.fake_calls())
    runtime.close()
    closed = names(calls_since(mark))
    assert closed[0] == "acl.rt.set_context"
    assert closed.count("acl.destroy_data_buffer") == 5  # x, ids, the gear input, x_out, ids_out
    assert closed.count("acl.rt.free") == 5 and closed.count("acl.rt.free_host") == 4
    assert closed[-5:] == [
        "acl.mdl.unload",
        "acl.mdl.destroy_desc",
        "acl.rt.destroy_stream",
        "acl.rt.destroy_context",
        "acl.rt.reset_device",
    ]
    assert fake.fake_leaks() == {}
    assert fake.fake_initialized()  # acl.finalize is for the process's exit


def test_close_is_idempotent(dynamic_om):
    runtime = load(dynamic_om)
    runtime.close()
    mark = len(fake.fake_calls())
    runtime.close()
    assert calls_since(mark) == []
    with pytest.raises(ModelNotReady):
        runtime.run(batch(1), [])


def test_run_from_another_thread_rebinds_the_context(static_om):
    runtime = load(static_om)
    results = []
    worker = threading.Thread(
        target=lambda: results.append(runtime.run({"x": np.ones((4, 3), np.float32)}, []))
    )
    worker.start()
    worker.join()
    assert results and results[0]["x_out"].shape == (4, 3)
    runtime.close()


# ---- one ACL per process -----------------------------------------------------------------------


@pytest.mark.parametrize("newer_cann", [False, True])
def test_unloading_the_last_om_keeps_acl_so_the_next_load_works(fresh, static_om, newer_cann):
    fresh.fake_newer_cann(newer_cann)
    load(static_om, acl=fresh).close()
    assert fresh.fake_initialized()
    again = load(static_om, device_id=1, acl=fresh)
    np.testing.assert_array_equal(again.run({"x": np.ones((4, 3), np.float32)}, [])["x_out"], 1)
    again.close()
    assert fresh.fake_call_names().count("acl.init") == 1
    assert "acl.finalize" not in fresh.fake_call_names()
    assert fresh.fake_leaks() == {}


def test_runtimes_share_one_init(fresh, dynamic_om, static_om):
    first, second = load(dynamic_om, acl=fresh), load(static_om, device_id=1, acl=fresh)
    first.close()
    np.testing.assert_array_equal(second.run({"x": np.ones((4, 3), np.float32)}, [])["x_out"], 1)
    second.close()
    assert fresh.fake_call_names().count("acl.init") == 1


@pytest.mark.parametrize("newer_cann", [False, True])
@pytest.mark.parametrize("first_loaded", ["om", "cann_ep"])
@pytest.mark.parametrize("first_unloaded", ["om", "cann_ep"])
def test_om_and_a_cann_ep_user_share_acl_in_either_order(fresh, static_om, newer_cann, first_loaded, first_unloaded):
    """An .om model and (simulated) ONNX Runtime's CANN EP, whose provider calls aclInit itself."""
    fresh.fake_newer_cann(newer_cann)
    if first_loaded == "om":
        om = load(static_om, acl=fresh)
        ep = fresh.fake_external_user(device_id=0)
        # The real provider throws on this 100002 (its InitializeRegistry); AclRuntime therefore lets
        # it initialise ACL first when it is installed (next test; for real in tests/test_cann_ep.py).
        assert ep.init_ret == fresh.ACL_ERROR_REPEAT_INITIALIZE
    else:
        ep = fresh.fake_external_user(device_id=0)
        om = load(static_om, acl=fresh)
        assert ep.init_ret == fresh.ACL_SUCCESS
    assert [c.result for c in fresh.fake_calls() if c.name == "acl.init"] == [0, fresh.ACL_ERROR_REPEAT_INITIALIZE]
    sent = {"x": np.full((4, 3), 2.5, np.float32)}
    if first_unloaded == "om":
        om.close()
        assert ep.works()
        ep.close()
    else:
        ep.close()
        np.testing.assert_array_equal(om.run(sent, [])["x_out"], sent["x"])
        om.close()
    assert "acl.finalize" not in fresh.fake_call_names()
    assert fresh.fake_leaks() == {}
    # At exit: only the one whose acl.init initialised ACL finalizes it.
    acl_process.PROCESS_ACL.finalize(fresh)
    assert fresh.fake_call_names().count("acl.finalize") == (first_loaded == "om")


def test_onnxruntime_initialises_acl_before_the_first_acl_init_only(fresh, static_om, monkeypatch):
    """Where ONNX Runtime has the CANN EP, its provider initialises ACL (simulated here by an external
    user); acl.init then answers 100002 and ACL is never ours to finalize."""
    from kserve_ascend.core.execution.runtimes import onnx as onnx_runtime

    providers = []
    monkeypatch.setattr(onnx_runtime, "initialise_acl", lambda device_id: providers.append(fresh.fake_external_user(device_id)))
    first, second = load(static_om, device_id=1, acl=fresh), load(static_om, acl=fresh)
    assert [p.device_id for p in providers] == [1] and providers[0].init_ret == fresh.ACL_SUCCESS
    assert [c.result for c in fresh.fake_calls() if c.name == "acl.init"] == [fresh.ACL_SUCCESS, fresh.ACL_ERROR_REPEAT_INITIALIZE]
    for user in (first, second, providers[0]):
        user.close()
    acl_process.PROCESS_ACL.finalize(fresh)
    assert "acl.finalize" not in fresh.fake_call_names() and fresh.fake_initialized()


def test_with_the_cpu_build_of_onnxruntime_acl_init_is_ours(fresh, static_om):
    load(static_om, acl=fresh).close()
    assert [c.result for c in fresh.fake_calls() if c.name == "acl.init"] == [fresh.ACL_SUCCESS]


def test_no_finalize_at_exit_while_a_runtime_is_open(fresh, static_om):
    runtime = load(static_om, acl=fresh)
    acl_process.PROCESS_ACL.finalize(fresh)
    assert "acl.finalize" not in fresh.fake_call_names()
    runtime.run({"x": np.ones((4, 3), np.float32)}, [])
    runtime.close()


EXIT_PROBE = """
import atexit, sys
import acl  # the FAKE module, from PYTHONPATH
from tritonclient.grpc import model_config_pb2 as mc

def report():  # registered first, so it runs after the runtime module's own handler
    print(acl.fake_call_names().count("acl.finalize"), acl.fake_initialized(), acl.fake_leaks(), flush=True)

atexit.register(report)
from kserve_ascend.core.execution.runtimes.acl import AclRuntime
runtime = AclRuntime(sys.argv[1], 0, mc.ModelConfig())
if sys.argv[2] == "close":
    runtime.close()
"""


@pytest.mark.parametrize("ending, finalized", [("close", "1 False {}"), ("keep", "0 True")])
def test_acl_finalize_runs_at_process_exit_only_without_open_runtimes(static_om, ending, finalized):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_ACL), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE, str(static_om), ending],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    assert result.stdout.startswith(finalized), result.stdout + result.stderr


# ---- data --------------------------------------------------------------------------------------


def test_values_round_trip(dynamic_om):
    runtime = load(dynamic_om)
    for rows in GEARS:
        sent = batch(rows)
        got = runtime.run(sent, ["x_out", "ids_out"])
        np.testing.assert_array_equal(got["x_out"], sent["x"])
        np.testing.assert_array_equal(got["ids_out"], sent["ids"])
        assert got["x_out"].dtype == np.float32 and got["ids_out"].dtype == np.int64
    runtime.close()


@pytest.mark.parametrize(
    "acl_type, dtype",
    [
        (fake.ACL_FLOAT16, np.float16),
        (fake.ACL_INT8, np.int8),
        (fake.ACL_UINT8, np.uint8),
        (fake.ACL_INT16, np.int16),
        (fake.ACL_UINT16, np.uint16),
        (fake.ACL_INT32, np.int32),
        (fake.ACL_UINT32, np.uint32),
        (fake.ACL_UINT64, np.uint64),
        (fake.ACL_DOUBLE, np.float64),
        (fake.ACL_BOOL, np.bool_),
    ],
)
def test_every_datatype_round_trips(tmp_path, acl_type, dtype):
    om = fake.fake_write_om(tmp_path / "t.om", [("t", acl_type, [-1, 5])], dynamic_batch=[2, 4])
    runtime = load(om)
    sent = (np.arange(20).reshape(4, 5) % 2).astype(dtype)
    got = runtime.run({"t": sent}, [])["t_out"]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, sent)
    runtime.close()


def test_an_fp16_output_stays_fp16(tmp_path):
    """ATC --output_type FP16: the runtime reports the file's type; converting is the core's."""
    om = fake.fake_write_om(
        tmp_path / "half.om", [("x", fake.ACL_FLOAT, [2, 3])], outputs=[("y", fake.ACL_FLOAT16, [2, 3])]
    )
    runtime = load(om, config=model_config(["y"]))
    assert [(s.name, s.datatype) for s in runtime.outputs] == [("y", "FP16")]
    sent = np.array([[0.5, 1.25, -2.0], [3.0, 65504.0, 1e-3]], np.float32)
    got = runtime.run({"x": sent}, [])["y"]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, sent.astype(np.float16))
    runtime.close()


def test_only_requested_outputs_are_copied_back(dynamic_om):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    assert list(runtime.run(batch(1), ["ids_out"])) == ["ids_out"]
    assert names(calls_since(mark)).count("acl.rt.memcpy_async") == 3  # two H2D, one D2H
    with pytest.raises(InvalidInput, match="nope"):
        runtime.run(batch(1), ["nope"])
    runtime.close()


def test_specs_and_info(dynamic_om):
    runtime = load(dynamic_om)
    assert [(s.name, s.datatype, s.shape) for s in runtime.inputs] == [
        ("x", "FP32", (-1, 3)),
        ("ids", "INT64", (-1, 2)),
    ]  # the gear input ATC adds is not the client's to fill
    assert [s.name for s in runtime.outputs] == ["x_out", "ids_out"]
    assert runtime.info == {
        "runtime": "acl",
        "device_id": "0",
        "gears": "1,2,4,8",
        "max_batch_size": "8",
    }
    runtime.close()


# ---- ATC output names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "file_names, config_names, served",
    [
        (["output0"], ["output0"], ["output0"]),  # named as the config names it
        (["/model.22/Concat_5:0:output0"], ["output0"], ["output0"]),  # ATC from ONNX
        (["a:0:boxes", "b:1:scores"], ["scores", "boxes"], ["boxes", "scores"]),  # by name, any order
        (["Conv_9:0", "Sigmoid_3:0"], ["boxes", "scores"], ["boxes", "scores"]),  # --out_nodes: in order
        (["node_0:0:output0"], [], ["output0"]),  # no outputs in config.pbtxt: the ONNX names
        (["Conv_9:0"], [], ["Conv_9:0"]),
        (["a:0:boxes", "Sigmoid_3:0"], ["boxes", "scores"], ["boxes", "Sigmoid_3:0"]),  # left to the config check
        (["Conv_9:0"], ["boxes", "scores"], ["Conv_9:0"]),  # counts differ: no pairing in order
        (["output_0_Conv_9_0", "output_1_Sigmoid_3_0"], ["boxes", "scores"], ["boxes", "scores"]),  # Graph API
        (["output_1_Sigmoid_3_0", "output_0_Conv_9_0"], ["boxes", "scores"], ["scores", "boxes"]),  # by its index
        (["output_1_Sigmoid_3_0", "Conv_9:0"], ["boxes", "scores"], ["boxes", "scores"]),  # not all: in order
        (["output_0_Conv_9_0"], [], ["output_0_Conv_9_0"]),
    ],
)
def test_served_output_names(file_names, config_names, served):
    assert served_output_names(file_names, config_names) == served


def test_two_file_outputs_answering_to_one_name_is_a_load_error():
    with pytest.raises(ModelLoadError, match="output0"):
        served_output_names(["output0", "node_0:0:output0"], ["output0"])


def test_an_atc_converted_model_serves_its_outputs_under_the_config_names(tmp_path):
    om = fake.fake_write_om(
        tmp_path / "atc.om",
        [("images", fake.ACL_FLOAT, [-1, 3]), ("sizes", fake.ACL_INT32, [-1, 2])],
        outputs=[("output0", fake.ACL_FLOAT, [-1, 3]), ("output1", fake.ACL_INT32, [-1, 2])],
        dynamic_batch=[1, 2],
        atc_names=True,
    )
    runtime = load(om, config=model_config(["output1", "output0"]))
    described = [c.result for c in fake.fake_calls() if c.name == "acl.mdl.get_output_name_by_index"]
    assert described == ["node_0:0:output0", "node_1:0:output1"]
    assert [s.name for s in runtime.inputs] == ["images", "sizes"]
    assert [s.name for s in runtime.outputs] == ["output0", "output1"]
    sent = {"images": np.ones((2, 3), np.float32), "sizes": np.full((2, 2), 7, np.int32)}
    got = runtime.run(sent, ["output1"])
    assert list(got) == ["output1"]
    np.testing.assert_array_equal(got["output1"], sent["sizes"])
    runtime.close()


# ---- batch sizes the file fixes ----------------------------------------------------------------


def test_batch_sizes_are_the_gears_or_the_static_batch(dynamic_om, static_om, tmp_path):
    unbatched = fake.fake_write_om(tmp_path / "u.om", [("a", fake.ACL_FLOAT, [2, 3]), ("b", fake.ACL_INT32, [5])])
    dynamic, static, plain = load(dynamic_om), load(static_om), load(unbatched)
    assert (dynamic.batch_sizes, dynamic.max_batch_size) == ((1, 2, 4, 8), 8)
    assert (static.batch_sizes, static.max_batch_size, static.info["gears"]) == ((4,), 4, "static")
    assert (plain.batch_sizes, plain.max_batch_size) == ((), 0)
    for runtime in (dynamic, static, plain):
        runtime.close()


@pytest.mark.parametrize("gear", GEARS)
def test_each_gear_runs_at_its_own_size(dynamic_om, gear):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    sent = batch(gear)
    np.testing.assert_array_equal(runtime.run(sent, [])["x_out"], sent["x"])
    calls = calls_since(mark)
    (gear_call,) = [c for c in calls if c.name == "acl.mdl.set_dynamic_batch_size"]
    model_id, dataset, index, size = gear_call.args
    assert (index, size) == (2, gear)  # 2: the index get_input_index_by_name gave the gear input
    (execute_call,) = [c for c in calls if c.name == "acl.mdl.execute_async"]
    assert execute_call.args[:2] == (model_id, dataset)  # the gear is set on the input dataset
    h2d = [c.args[3] for c in calls if c.name == "acl.rt.memcpy_async" and c.args[4] == fake.ACL_MEMCPY_HOST_TO_DEVICE]
    assert h2d == [gear * 3 * 4, gear * 2 * 8]  # only the gear's rows cross
    runtime.close()


@pytest.mark.parametrize("rows", [3, 5, 9])
def test_a_batch_that_is_not_a_gear_is_refused_before_the_device(dynamic_om, rows):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    with pytest.raises(ValueError, match=f"batches of 1,2,4,8 rows only, not {rows}"):
        runtime.run(batch(rows), [])
    assert calls_since(mark) == []  # the Instance pads and splits; the runtime no longer does
    runtime.close()


def test_static_model_runs_exactly_its_batch(static_om):
    runtime = load(static_om)
    sent = np.arange(12, dtype=np.float32).reshape(4, 3)
    mark = len(fake.fake_calls())
    np.testing.assert_array_equal(runtime.run({"x": sent}, [])["x_out"], sent)
    assert "acl.mdl.set_dynamic_batch_size" not in names(calls_since(mark))
    with pytest.raises(ValueError, match="batches of 4 rows only, not 2"):
        runtime.run({"x": sent[:2]}, [])
    runtime.close()


def test_unbatched_model_takes_exact_shapes(tmp_path):
    om = fake.fake_write_om(
        tmp_path / "u.om", [("a", fake.ACL_FLOAT, [2, 3]), ("b", fake.ACL_INT32, [5])]
    )
    runtime = load(om)
    assert runtime.inputs[0].shape == (2, 3)
    sent = {"a": np.ones((2, 3), np.float32), "b": np.arange(5, dtype=np.int32)}
    got = runtime.run(sent, [])
    np.testing.assert_array_equal(got["b_out"], sent["b"])
    with pytest.raises(InvalidInput, match="shape"):
        runtime.run({"a": np.ones((1, 3), np.float32), "b": sent["b"]}, [])
    runtime.close()


# ---- buffer pool -------------------------------------------------------------------------------


def test_buffers_have_the_model_sizes(dynamic_om):
    runtime = load(dynamic_om)
    sizes = {
        (c.name, c.args): c.result
        for c in fake.fake_calls()
        if c.name in ("acl.mdl.get_input_size_by_index", "acl.mdl.get_output_size_by_index")
    }
    model_sizes = sorted(sizes.values())  # x 8*3*4, ids 8*2*8, gear input, and the outputs
    assert model_sizes == sorted([96, 128, 8, 96, 128])
    assert sorted(size for _, size, _ in fake.fake_mallocs()) == model_sizes
    assert {policy for _, _, policy in fake.fake_mallocs()} == {fake.ACL_MEM_MALLOC_HUGE_FIRST}
    data_buffers = [c.args for c in fake.fake_calls() if c.name == "acl.create_data_buffer"]
    assert sorted(data_buffers) == sorted((a, s) for a, s, _ in fake.fake_mallocs())
    assert sorted(fake.fake_host_memory().values()) == [96, 96, 128, 128]  # no staging for the gear input
    runtime.close()


def test_host_staging_is_pinned_memory(dynamic_om):
    runtime = load(dynamic_om)
    pinned = set(fake.fake_host_memory())
    mark = len(fake.fake_calls())
    runtime.run(batch(4), [])
    copies = [c.args for c in calls_since(mark) if c.name == "acl.rt.memcpy_async"]
    host_sides = {dst if kind == fake.ACL_MEMCPY_DEVICE_TO_HOST else src for dst, _, src, _, kind, _ in copies}
    assert host_sides == pinned
    runtime.close()
    assert fake.fake_leaks() == {}


def test_no_allocation_after_load(dynamic_om):
    runtime = load(dynamic_om)
    allocations = (
        "acl.rt.malloc",
        "acl.rt.malloc_host",
        "acl.util.ptr_to_numpy",
        "acl.mdl.create_dataset",
        "acl.create_data_buffer",
    )
    before = [n for n in fake.fake_call_names() if n in allocations]
    for i in range(100):
        runtime.run(batch(GEARS[i % 4]), [])
    assert [n for n in fake.fake_call_names() if n in allocations] == before
    assert fake.fake_call_names().count("acl.mdl.execute_async") == 100
    runtime.close()
    assert fake.fake_leaks() == {}


# ---- input checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"x": np.ones((2, 3), np.float64), "ids": np.ones((2, 2), np.int64)}, "datatype FP64"),
        ({"x": np.ones((2, 3), np.float32), "ids": np.ones((2, 2), np.int32)}, "datatype INT32"),
        ({"x": np.ones((2, 4), np.float32), "ids": np.ones((2, 2), np.int64)}, "shape"),
        ({"x": np.ones((2, 3), np.float32), "ids": np.ones((4, 2), np.int64)}, "different batch"),
        ({"x": np.ones((2, 3), np.float32)}, "missing ids"),
    ],
)
def test_mismatched_inputs_are_invalid(dynamic_om, inputs, message):
    runtime = load(dynamic_om)
    with pytest.raises(InvalidInput, match=message):
        runtime.run(inputs, [])
    runtime.close()


# ---- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        "acl.init",
        "acl.rt.set_device",
        "acl.rt.create_context",
        "acl.rt.create_stream",
        "acl.mdl.load_from_file",
        "acl.mdl.get_desc",
        "acl.mdl.get_dynamic_batch",
        "acl.rt.malloc",
        "acl.rt.malloc_host",
        "acl.mdl.add_dataset_buffer",
    ],
)
def test_load_failure_names_the_call_and_leaks_nothing(fresh, dynamic_om, call):
    fresh.fake_inject(call, ret=507011)
    with pytest.raises(DeviceError) as caught:
        load(dynamic_om, acl=fresh)
    assert (caught.value.call, caught.value.ret) == (call, 507011)
    assert call in str(caught.value) and "507011" in str(caught.value)
    assert fresh.fake_leaks() == {}


@pytest.mark.parametrize(
    "call", ["acl.mdl.create_desc", "acl.mdl.create_dataset", "acl.create_data_buffer"]
)
def test_null_handle_at_load_is_a_device_error(dynamic_om, call):
    fake.fake_inject(call)
    with pytest.raises(DeviceError, match=call):
        load(dynamic_om)
    assert fake.fake_leaks() == {}


@pytest.mark.parametrize(
    "call, ret, after, reported_by",
    [
        ("acl.rt.set_context", 107002, 0, "acl.rt.set_context"),
        ("acl.rt.memcpy_async", 107000, 0, "acl.rt.memcpy_async"),  # refused when queued
        ("acl.rt.memcpy_async", 107000, 3, "acl.rt.memcpy_async"),  # the second D2H copy
        ("acl.mdl.set_dynamic_batch_size", 145013, 0, "acl.mdl.set_dynamic_batch_size"),
        ("acl.mdl.execute_async", 507011, 0, "acl.rt.synchronize_stream_with_timeout"),  # failed on the device
        ("acl.rt.synchronize_stream_with_timeout", 507011, 0, "acl.rt.synchronize_stream_with_timeout"),
    ],
)
def test_a_failed_batch_names_the_call_and_the_runtime_recovers(dynamic_om, call, ret, after, reported_by):
    runtime = load(dynamic_om)
    fake.fake_inject(call, ret=ret, after=after)
    with pytest.raises(DeviceError) as caught:
        runtime.run(batch(2), [])
    assert (caught.value.call, caught.value.ret, caught.value.fatal) == (reported_by, ret, False)
    np.testing.assert_array_equal(runtime.run(batch(2), [])["x_out"], batch(2)["x"])
    runtime.close()
    assert fake.fake_leaks() == {}


def test_close_failure_still_releases_everything_else(dynamic_om):
    runtime = load(dynamic_om)
    fake.fake_inject("acl.mdl.unload", ret=100011)
    with pytest.raises(DeviceError, match="acl.mdl.unload"):
        runtime.close()
    assert fake.fake_leaks() == {"models": [1]}  # only what the failed call itself held
    runtime.close()  # idempotent even after a failed close


def test_device_error_carries_acl_recent_message(dynamic_om):
    fake.fake_inject("acl.rt.malloc", ret=fake.ACL_ERROR_BAD_ALLOC)
    with pytest.raises(DeviceError, match="injected failure of acl.rt.malloc"):
        load(dynamic_om)


# ---- device faults -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ret, fatal",
    [
        (fake.ACL_ERROR_RT_AICORE_EXCEPTION, True),
        (fake.ACL_ERROR_RT_AICORE_TIMEOUT, True),
        (fake.ACL_ERROR_RT_LOST_HEARTBEAT, True),
        (507054, True),  # ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR
        (fake.ACL_ERROR_RT_MODEL_EXECUTE, False),
        (fake.ACL_ERROR_INTERNAL_ERROR, False),
    ],
)
def test_device_faults_that_poison_the_context_are_fatal(static_om, ret, fatal):
    runtime = load(static_om)
    fake.fake_inject("acl.mdl.execute_async", ret=ret)
    with pytest.raises(DeviceError) as caught:
        runtime.run({"x": np.ones((4, 3), np.float32)}, [])
    assert (caught.value.ret, caught.value.fatal) == (ret, fatal)
    runtime.close()


def test_after_an_ai_core_exception_the_instance_refuses_work_and_still_closes_cleanly(static_om):
    runtime = load(static_om)
    fake.fake_inject("acl.mdl.execute_async", ret=fake.ACL_ERROR_RT_AICORE_EXCEPTION)
    with pytest.raises(DeviceError):
        runtime.run({"x": np.ones((4, 3), np.float32)}, [])
    mark = len(fake.fake_calls())
    with pytest.raises(DeviceError, match="out of service") as caught:
        runtime.run({"x": np.ones((4, 3), np.float32)}, [])
    assert (caught.value.ret, caught.value.fatal) == (fake.ACL_ERROR_RT_AICORE_EXCEPTION, True)
    assert calls_since(mark) == []  # the poisoned context is not touched again
    runtime.close()
    assert "acl.rt.destroy_stream_force" in fake.fake_call_names()
    assert fake.fake_leaks() == {}


def test_a_fault_on_one_device_leaves_the_others_serving(static_om):
    healthy, faulty = load(static_om, device_id=0), load(static_om, device_id=1)
    fake.fake_inject("acl.mdl.execute_async", ret=fake.ACL_ERROR_RT_AICORE_EXCEPTION, times=5, device=1)
    sent = {"x": np.full((4, 3), 3.0, np.float32)}
    np.testing.assert_array_equal(healthy.run(sent, [])["x_out"], sent["x"])
    with pytest.raises(DeviceError) as caught:
        faulty.run(sent, [])
    assert caught.value.fatal
    np.testing.assert_array_equal(healthy.run(sent, [])["x_out"], sent["x"])
    healthy.close(), faulty.close()


def test_a_hung_execution_times_out_fatally_and_the_instance_still_closes(static_om):
    runtime = load(static_om, device_id=0, config=model_config(execution_timeout_ms="200"))
    fake.fake_hang("acl.mdl.execute_async", device=0)
    with pytest.raises(DeviceError, match="execution_timeout_ms=200") as caught:
        runtime.run({"x": np.ones((4, 3), np.float32)}, [])
    assert (caught.value.call, caught.value.ret, caught.value.fatal) == (
        "acl.rt.synchronize_stream_with_timeout", fake.ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, True
    )
    runtime.close()  # drops the stuck task (destroy_stream_force) instead of waiting on it
    assert fake.fake_leaks() == {}


def test_default_execution_timeout_and_an_invalid_one(static_om):
    runtime = load(static_om)
    runtime.run({"x": np.ones((4, 3), np.float32)}, [])
    assert fake.fake_calls()[-1].args[1] == 30_000
    runtime.close()
    mark = len(fake.fake_calls())
    with pytest.raises(ModelLoadError, match="execution_timeout_ms"):
        load(static_om, config=model_config(execution_timeout_ms="soon"))
    assert calls_since(mark) == []


def test_an_execution_timeout_beyond_a_c_int_waits_as_long_as_pyacl_can(static_om):
    """pyACL parses the timeout with "i" (rt/rt_synchronize.cpp): 3e9 ms would be its TypeError."""
    runtime = load(static_om, config=model_config(execution_timeout_ms="3000000000"))
    sent = {"x": np.ones((4, 3), np.float32)}
    np.testing.assert_array_equal(runtime.run(sent, [])["x_out"], sent["x"])
    assert fake.fake_calls()[-1].args[1] == 2**31 - 1
    runtime.close()


def test_without_ptr_to_numpy_the_pinned_buffers_are_viewed_through_ctypes(dynamic_om, monkeypatch):
    """pyACL documents ptr_to_numpy as "will be deprecated"; a pyACL without it still stages in
    place, in the same pinned memory."""
    monkeypatch.delattr(fake.util, "ptr_to_numpy")
    runtime = load(dynamic_om)
    pinned = set(fake.fake_host_memory())
    for rows in GEARS:
        sent = batch(rows)
        got = runtime.run(sent, [])
        np.testing.assert_array_equal(got["x_out"], sent["x"])
        np.testing.assert_array_equal(got["ids_out"], sent["ids"])
    assert "acl.util.ptr_to_numpy" not in fake.fake_call_names()
    copies = [c.args for c in fake.fake_calls() if c.name == "acl.rt.memcpy_async"]
    assert {dst if kind == fake.ACL_MEMCPY_DEVICE_TO_HOST else src for dst, _, src, _, kind, _ in copies} == pinned
    runtime.close()
    assert fake.fake_leaks() == {}


def test_outputs_outlive_the_pinned_memory_they_were_staged_in(dynamic_om):
    """Closing frees the pinned buffers (the fake poisons them); what run returned are copies."""
    runtime = load(dynamic_om)
    sent = batch(2)
    got = runtime.run(sent, [])
    runtime.close()
    np.testing.assert_array_equal(got["x_out"], sent["x"])
    np.testing.assert_array_equal(got["ids_out"], sent["ids"])


def test_a_pyacl_without_the_timeout_synchronizes_without_one(static_om, monkeypatch):
    monkeypatch.delattr(fake.rt, "synchronize_stream_with_timeout")
    runtime = load(static_om)
    sent = {"x": np.full((4, 3), 1.5, np.float32)}
    np.testing.assert_array_equal(runtime.run(sent, [])["x_out"], sent["x"])
    assert fake.fake_call_names()[-1] == "acl.rt.synchronize_stream"
    runtime.close()


def test_faults_file_reaches_a_fake_in_another_process_style(static_om, tmp_path, monkeypatch):
    """The control file a server under test reads (FAKE_ACL_FAULTS), here read in-process."""
    faults = tmp_path / "faults.json"
    monkeypatch.setenv("FAKE_ACL_FAULTS", str(faults))
    zero, one = load(static_om, device_id=0), load(static_om, device_id=1)
    sent = {"x": np.ones((4, 3), np.float32)}

    def write(entries):
        staged = tmp_path / "faults.tmp"
        staged.write_text(json.dumps(entries))
        staged.replace(faults)

    write([{"call": "acl.mdl.execute_async", "ret": fake.ACL_ERROR_RT_AICORE_EXCEPTION, "device": 1}])
    zero.run(sent, [])
    with pytest.raises(DeviceError) as caught:
        one.run(sent, [])
    assert caught.value.ret == fake.ACL_ERROR_RT_AICORE_EXCEPTION
    write([{"call": "acl.mdl.execute_async", "hang": True, "device": 0}])
    with pytest.raises(DeviceError) as caught:
        zero.run(sent, [])
    assert caught.value.ret == fake.ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    write([{"release": True}])
    zero.close(), one.close()
    assert fake.fake_leaks() == {}


# ---- what the model file may hold --------------------------------------------------------------


def test_missing_file_is_a_load_error_before_any_acl_call(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load(tmp_path / "absent.om")
    assert fake.fake_calls() == []


def test_unsupported_datatype_is_a_load_error(tmp_path):
    om = fake.fake_write_om(tmp_path / "s.om", [("s", fake.ACL_FLOAT, [2])])
    text = om.read_text().replace('"dtype": 0', '"dtype": 13')  # ACL_STRING
    om.write_text(text)
    fake_item_sizes = dict(fake.ITEM_SIZES)
    fake.ITEM_SIZES[13] = 1  # let the fake describe it, so the runtime is the one refusing
    try:
        with pytest.raises(ModelLoadError, match="ACL data type 13"):
            load(om)
    finally:
        fake.ITEM_SIZES.clear()
        fake.ITEM_SIZES.update(fake_item_sizes)
    assert fake.fake_leaks() == {}


def test_dynamic_dims_without_gears_are_a_load_error(tmp_path):
    om = fake.fake_write_om(tmp_path / "d.om", [("x", fake.ACL_FLOAT, [1, 3])])
    om.write_text(om.read_text().replace("1,\n", "-1,\n"))
    with pytest.raises(ModelLoadError, match="dynamic_batch_size"):
        load(om)
    assert fake.fake_leaks() == {}


def test_missing_pyacl_is_a_clear_load_error(static_om, monkeypatch):
    monkeypatch.setitem(sys.modules, "acl", None)  # makes `import acl` raise ImportError
    with pytest.raises(ModelLoadError) as caught:
        AclRuntime(static_om, 0, mc.ModelConfig())
    message = str(caught.value)
    assert "pyACL" in message and "`acl`" in message and "CANN toolkit" in message
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in message


def test_acl_none_imports_the_acl_module(fresh, static_om, monkeypatch):
    monkeypatch.setitem(sys.modules, "acl", fresh)  # what `import acl` resolves to
    runtime = AclRuntime(static_om, 0, mc.ModelConfig())
    _loaded.append(runtime)
    assert fresh.fake_call_names()[0] == "acl.init"
    runtime.close()


# ---- the fake itself ---------------------------------------------------------------------------


def test_fake_enforces_call_order(fresh, static_om):
    assert fresh.mdl.load_from_file(str(static_om)) == (0, fresh.ACL_ERROR_UNINITIALIZE)
    assert fresh.init() == fresh.ACL_SUCCESS
    assert fresh.init() == fresh.ACL_ERROR_REPEAT_INITIALIZE
    assert fresh.mdl.load_from_file(str(static_om)) == (0, fresh.ACL_ERROR_RT_CONTEXT_NULL)
    assert fresh.rt.create_context(0) == (0, fresh.ACL_ERROR_RT_INVALID_DEVICEID)
    assert fresh.rt.set_device(0) == fresh.ACL_SUCCESS
    context, ret = fresh.rt.create_context(0)
    assert ret == fresh.ACL_SUCCESS
    stream, _ = fresh.rt.create_stream()
    assert fresh.rt.destroy_context(context) == fresh.ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(fresh.rt.malloc(8, 0)))
    worker.start()
    worker.join()
    assert other_thread == [(0, fresh.ACL_ERROR_RT_CONTEXT_NULL)]  # contexts are per thread
    assert fresh.rt.destroy_stream(stream) == fresh.rt.destroy_context(context) == fresh.ACL_SUCCESS
    assert fresh.rt.reset_device(0) == fresh.finalize() == fresh.ACL_SUCCESS
    assert fresh.fake_leaks() == {}


def test_fake_older_cann_cannot_initialise_again_after_finalize(fresh):
    assert fresh.init() == fresh.ACL_SUCCESS
    assert fresh.finalize() == fresh.ACL_SUCCESS
    assert fresh.init() == fresh.ACL_ERROR_REPEAT_INITIALIZE
    assert not fresh.fake_initialized()
    assert fresh.rt.set_device(0) == fresh.ACL_ERROR_UNINITIALIZE
    assert fresh.finalize() == fresh.ACL_ERROR_REPEAT_FINALIZE


def test_fake_newer_cann_initialises_again_but_finalize_tears_acl_down_under_everyone(fresh):
    fresh.fake_newer_cann()
    other = fresh.fake_external_user(device_id=0)
    assert other.init_ret == fresh.ACL_SUCCESS and other.works()
    assert fresh.init() == fresh.ACL_ERROR_REPEAT_INITIALIZE  # a second user: tolerated
    assert fresh.finalize() == fresh.ACL_SUCCESS  # ...whose finalize ends ACL for both
    assert not other.works()
    assert fresh.init() == fresh.ACL_SUCCESS


def test_fake_memcpy_moves_bytes_and_checks_bounds(fresh):
    fresh.init(), fresh.rt.set_device(0), fresh.rt.create_context(0)
    device, _ = fresh.rt.malloc(16, fresh.ACL_MEM_MALLOC_HUGE_FIRST)
    with pytest.warns(Warning, match="deprecated"):
        host = np.arange(4, dtype=np.int32)
        host_ptr = fresh.util.numpy_to_ptr(host)
    assert fresh.rt.memcpy(device, 16, host_ptr, 16, fresh.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert fresh.fake_read(device, 16) == host.tobytes()
    assert fresh.rt.memcpy(device, 16, host_ptr, 32, 1) == fresh.ACL_ERROR_INVALID_PARAM
    assert (
        fresh.rt.memcpy(device, 16, host_ptr, 16, fresh.ACL_MEMCPY_DEVICE_TO_HOST)
        == fresh.ACL_ERROR_INVALID_PARAM
    )
    with pytest.raises(ValueError):
        fresh.util.bytes_to_ptr(bytearray(4))  # like pyACL: bytes only
    assert fresh.fake_leaks()["device_memory"] == {device: 16}


def test_fake_async_copies_need_pinned_memory_and_land_at_synchronize(fresh):
    fresh.init(), fresh.rt.set_device(0), fresh.rt.create_context(0)
    stream, _ = fresh.rt.create_stream()
    device, _ = fresh.rt.malloc(16, fresh.ACL_MEM_MALLOC_HUGE_FIRST)
    pinned, ret = fresh.rt.malloc_host(16)
    assert ret == fresh.ACL_SUCCESS and pinned % 64 == 0
    with pytest.warns(Warning, match="ptr_to_numpy will be deprecated"):
        view = fresh.util.ptr_to_numpy(pinned, (4,), np.dtype(np.int32).num)
    view[:] = [1, 2, 3, 4]  # writes the pinned memory itself
    assert fresh.fake_read(pinned, 16) == np.array([1, 2, 3, 4], np.int32).tobytes()
    assert fresh.rt.memcpy_async(device, 16, pinned, 16, fresh.ACL_MEMCPY_HOST_TO_DEVICE, stream) == 0
    assert fresh.fake_read(device, 16) == bytes(16)  # queued, not done
    assert fresh.rt.synchronize_stream_with_timeout(stream, 1000) == 0
    assert fresh.fake_read(device, 16) == view.tobytes()
    with pytest.warns(Warning):
        unpinned = fresh.util.numpy_to_ptr(np.zeros(4, np.int32))
    assert fresh.rt.memcpy_async(device, 16, unpinned, 16, 1, stream) == fresh.ACL_ERROR_INVALID_PARAM
    assert fresh.rt.free_host(pinned) == fresh.rt.free(device) == fresh.rt.destroy_stream(stream) == 0


def test_fake_hung_call_blocks_only_its_caller_until_released(fresh):
    fresh.init()
    fresh.rt.set_device(0), fresh.rt.set_device(1)
    fresh.fake_hang("acl.rt.create_context", device=0)
    results, done = [], threading.Event()
    worker = threading.Thread(target=lambda: (results.append(fresh.rt.create_context(0)), done.set()))
    worker.start()
    assert not done.wait(0.2)  # still hung
    assert fresh.rt.create_context(1)[1] == fresh.ACL_SUCCESS  # device 1 goes on meanwhile
    fresh.fake_release()
    worker.join(10)
    assert results and results[0][1] == fresh.ACL_SUCCESS


def test_fake_is_importable_as_acl_from_its_directory():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "fake_acl")}
    probe = "import acl; assert acl.FAKE and acl.rt.malloc_host and acl.mdl.execute_async; print(acl.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip().endswith(os.path.join("fake_acl", "acl.py"))


def test_a_load_measures_the_device_memory_it_took(fresh, tmp_path):
    """Issue 30: the device's free memory before and after the load (acl.rt.get_mem_info): the model's work and
    weight memory and the runtime's own input and output buffers."""
    model = fresh.fake_write_om(tmp_path / "m.om", [("x", fresh.ACL_FLOAT, [2, 3])], work_size=1 << 20, weight_size=5 << 20)
    runtime = load(model, acl=fresh)
    buffers = 2 * 2 * 3 * 4  # one input and one output of FP32[2, 3] on the device
    assert runtime.memory_bytes == (6 << 20) + buffers

"""AclRuntime against the recording fake of pyACL (tests/fake_acl/acl.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from conftest import load_fake_acl
from kserve_ascend.core.errors import DeviceError, InvalidInput, ModelLoadError, ModelNotReady
from kserve_ascend.core.runtimes.acl import AclRuntime


fake = load_fake_acl()
GEARS = [1, 2, 4, 8]


_loaded: list[AclRuntime] = []


@pytest.fixture(autouse=True)
def clean_fake():
    fake.fake_reset()
    yield
    # A failed test must not leave the process-wide acl.init reference of its runtimes behind.
    while _loaded:
        try:
            _loaded.pop().close()
        except DeviceError:
            pass
    fake.fake_reset()


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


def load(path, device_id=0) -> AclRuntime:
    runtime = AclRuntime(path, device_id, mc.ModelConfig(), acl=fake)
    _loaded.append(runtime)
    return runtime


def batch(rows: int) -> dict[str, np.ndarray]:
    return {
        "x": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 0.5,
        "ids": np.arange(rows * 2, dtype=np.int64).reshape(rows, 2) - 7,
    }


def names(calls) -> list[str]:
    return [c.name for c in calls]


def calls_since(mark: int):
    return fake.fake_calls()[mark:]


def is_subsequence(wanted: list[str], actual: list[str]) -> bool:
    remaining = iter(actual)
    return all(name in remaining for name in wanted)


# ---- lifecycle -------------------------------------------------------------------------------


def test_load_follows_the_pyacl_lifecycle_order(dynamic_om):
    runtime = load(dynamic_om)
    loaded = fake.fake_call_names()
    assert loaded[:7] == [
        "acl.init",
        "acl.rt.set_device",
        "acl.rt.create_context",
        "acl.rt.create_stream",
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
            "acl.util.numpy_to_ptr",
            "acl.mdl.create_dataset",
            "acl.create_data_buffer",
            "acl.mdl.add_dataset_buffer",
        ],
        loaded,
    )
    runtime.close()


def test_run_and_close_call_sequences(dynamic_om):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    runtime.run(batch(2), [])
    assert names(calls_since(mark)) == [
        "acl.rt.set_context",
        "acl.rt.memcpy",
        "acl.rt.memcpy",  # H2D, one per input
        "acl.mdl.set_dynamic_batch_size",
        "acl.mdl.execute",
        "acl.rt.memcpy",
        "acl.rt.memcpy",  # D2H, one per output
    ]
    mark = len(fake.fake_calls())
    runtime.close()
    assert names(calls_since(mark)) == [
        "acl.rt.set_context",
        *["acl.destroy_data_buffer"] * 5,  # x, ids, the gear input, x_out, ids_out
        "acl.mdl.destroy_dataset",
        "acl.mdl.destroy_dataset",
        *["acl.rt.free"] * 5,
        "acl.mdl.unload",
        "acl.mdl.destroy_desc",
        "acl.rt.destroy_stream",
        "acl.rt.destroy_context",
        "acl.rt.reset_device",
        "acl.finalize",
    ]
    assert fake.fake_leaks() == {}


def test_close_is_idempotent(dynamic_om):
    runtime = load(dynamic_om)
    runtime.close()
    mark = len(fake.fake_calls())
    runtime.close()
    assert calls_since(mark) == []
    with pytest.raises(ModelNotReady):
        runtime.run(batch(1), [])


def test_two_runtimes_share_one_init_and_finalize_once(dynamic_om, static_om):
    first, second = load(dynamic_om), load(static_om, device_id=1)
    first.close()
    assert "acl.finalize" not in fake.fake_call_names()
    np.testing.assert_array_equal(second.run({"x": np.ones((4, 3), np.float32)}, [])["x_out"], 1)
    second.close()
    assert fake.fake_call_names().count("acl.init") == 1
    assert fake.fake_call_names().count("acl.finalize") == 1
    assert fake.fake_leaks() == {}


def test_acl_initialised_elsewhere_is_used_and_not_finalized(static_om):
    assert fake.init() == fake.ACL_SUCCESS  # another framework in the process got there first
    runtime = load(static_om)
    runtime.close()
    assert fake.fake_call_names().count("acl.finalize") == 0
    assert fake.fake_leaks() == {"initialized": True}
    assert fake.finalize() == fake.ACL_SUCCESS


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


# ---- data --------------------------------------------------------------------------------------


def test_values_round_trip(dynamic_om):
    runtime = load(dynamic_om)
    for rows in (1, 2, 3, 8):
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
    sent = (np.arange(15).reshape(3, 5) % 2).astype(dtype)
    got = runtime.run({"t": sent}, [])["t_out"]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, sent)
    runtime.close()


def test_only_requested_outputs_are_copied_back(dynamic_om):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    assert list(runtime.run(batch(1), ["ids_out"])) == ["ids_out"]
    assert names(calls_since(mark)).count("acl.rt.memcpy") == 3  # two H2D, one D2H
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
    assert runtime.max_batch_size == 8
    assert runtime.info == {
        "runtime": "acl",
        "device_id": "0",
        "gears": "1,2,4,8",
        "max_batch_size": "8",
    }
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
    runtime.close()


def test_no_allocation_after_load(dynamic_om):
    runtime = load(dynamic_om)
    allocations = (
        "acl.rt.malloc",
        "acl.mdl.create_dataset",
        "acl.create_data_buffer",
        "acl.util.numpy_to_ptr",
    )
    before = [n for n in fake.fake_call_names() if n in allocations]
    for i in range(100):
        runtime.run(batch(i % 8 + 1), [])
    assert [n for n in fake.fake_call_names() if n in allocations] == before
    assert fake.fake_call_names().count("acl.mdl.execute") == 100
    runtime.close()
    assert fake.fake_leaks() == {}


# ---- dynamic batch gears -----------------------------------------------------------------------


def test_batch_of_three_runs_at_gear_four(dynamic_om):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    sent = batch(3)
    got = runtime.run(sent, [])
    calls = calls_since(mark)
    (gear_call,) = [c for c in calls if c.name == "acl.mdl.set_dynamic_batch_size"]
    model_id, dataset, index, gear = gear_call.args
    assert gear == 4
    assert index == 2  # the index get_input_index_by_name gave for ascend_mbatch_shape_data
    (execute_call,) = [c for c in calls if c.name == "acl.mdl.execute"]
    assert execute_call.args[:2] == (model_id, dataset)  # the gear is set on the input dataset
    h2d = [
        c.args
        for c in calls
        if c.name == "acl.rt.memcpy" and c.args[4] == fake.ACL_MEMCPY_HOST_TO_DEVICE
    ]
    assert [count for _, _, _, count, _ in h2d] == [4 * 3 * 4, 4 * 2 * 8]  # padded to 4 rows
    assert got["x_out"].shape == (3, 3) and got["ids_out"].shape == (3, 2)
    np.testing.assert_array_equal(got["x_out"], sent["x"])
    runtime.close()


@pytest.mark.parametrize("rows, gear", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_smallest_gear_that_fits(dynamic_om, rows, gear):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    assert runtime.run(batch(rows), [])["x_out"].shape[0] == rows
    (call,) = [c for c in calls_since(mark) if c.name == "acl.mdl.set_dynamic_batch_size"]
    assert call.args[3] == gear
    runtime.close()


def test_batch_over_the_largest_gear_is_invalid_input(dynamic_om):
    runtime = load(dynamic_om)
    mark = len(fake.fake_calls())
    with pytest.raises(InvalidInput, match="9"):
        runtime.run(batch(9), [])
    assert calls_since(mark) == []  # refused before touching the device
    runtime.close()


def test_static_model_pads_to_its_batch_without_gears(static_om):
    runtime = load(static_om)
    assert runtime.max_batch_size == 4 and runtime.info["gears"] == "static"
    sent = np.arange(6, dtype=np.float32).reshape(2, 3)
    mark = len(fake.fake_calls())
    np.testing.assert_array_equal(runtime.run({"x": sent}, [])["x_out"], sent)
    assert "acl.mdl.set_dynamic_batch_size" not in names(calls_since(mark))
    runtime.close()


def test_unbatched_model_takes_exact_shapes(tmp_path):
    om = fake.fake_write_om(
        tmp_path / "u.om", [("a", fake.ACL_FLOAT, [2, 3]), ("b", fake.ACL_INT32, [5])]
    )
    runtime = load(om)
    assert runtime.max_batch_size == 0 and runtime.inputs[0].shape == (2, 3)
    sent = {"a": np.ones((2, 3), np.float32), "b": np.arange(5, dtype=np.int32)}
    got = runtime.run(sent, [])
    np.testing.assert_array_equal(got["b_out"], sent["b"])
    with pytest.raises(InvalidInput, match="shape"):
        runtime.run({"a": np.ones((1, 3), np.float32), "b": sent["b"]}, [])
    runtime.close()


# ---- input checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"x": np.ones((2, 3), np.float64), "ids": np.ones((2, 2), np.int64)}, "datatype FP64"),
        ({"x": np.ones((2, 3), np.float32), "ids": np.ones((2, 2), np.int32)}, "datatype INT32"),
        ({"x": np.ones((2, 4), np.float32), "ids": np.ones((2, 2), np.int64)}, "shape"),
        ({"x": np.ones((2, 3), np.float32), "ids": np.ones((3, 2), np.int64)}, "different batch"),
        ({"x": np.ones((2, 3), np.float32)}, "missing ids"),
        ({"x": np.ones((0, 3), np.float32), "ids": np.ones((0, 2), np.int64)}, "outside"),
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
        "acl.mdl.add_dataset_buffer",
    ],
)
def test_load_failure_names_the_call_and_leaks_nothing(dynamic_om, call):
    fake.fake_inject(call, ret=507011)
    with pytest.raises(DeviceError) as caught:
        load(dynamic_om)
    assert (caught.value.call, caught.value.ret) == (call, 507011)
    assert call in str(caught.value) and "507011" in str(caught.value)
    assert fake.fake_leaks() == {}


@pytest.mark.parametrize(
    "call", ["acl.mdl.create_desc", "acl.mdl.create_dataset", "acl.create_data_buffer"]
)
def test_null_handle_at_load_is_a_device_error(dynamic_om, call):
    fake.fake_inject(call)
    with pytest.raises(DeviceError, match=call):
        load(dynamic_om)
    assert fake.fake_leaks() == {}


@pytest.mark.parametrize(
    "call, after",
    [
        ("acl.rt.set_context", 0),
        ("acl.rt.memcpy", 0),
        ("acl.rt.memcpy", 3),
        ("acl.mdl.set_dynamic_batch_size", 0),
        ("acl.mdl.execute", 0),
    ],
)
def test_run_failure_names_the_call_and_the_runtime_recovers(dynamic_om, call, after):
    runtime = load(dynamic_om)
    fake.fake_inject(call, ret=507011, after=after)  # after=3: the second D2H copy
    with pytest.raises(DeviceError) as caught:
        runtime.run(batch(2), [])
    assert (caught.value.call, caught.value.ret) == (call, 507011)
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


def test_acl_none_imports_the_acl_module(static_om, monkeypatch):
    monkeypatch.setitem(sys.modules, "acl", fake)  # what `import acl` resolves to
    runtime = AclRuntime(static_om, 0, mc.ModelConfig())
    _loaded.append(runtime)
    assert fake.fake_call_names()[0] == "acl.init"
    runtime.close()


# ---- the fake itself ---------------------------------------------------------------------------


def test_fake_enforces_call_order(static_om):
    assert fake.mdl.load_from_file(str(static_om)) == (0, fake.ACL_ERROR_UNINITIALIZE)
    assert fake.init() == fake.ACL_SUCCESS
    assert fake.init() == fake.ACL_ERROR_REPEAT_INITIALIZE
    assert fake.mdl.load_from_file(str(static_om)) == (0, fake.ACL_ERROR_RT_CONTEXT_NULL)
    assert fake.rt.create_context(0) == (0, fake.ACL_ERROR_RT_INVALID_DEVICEID)
    assert fake.rt.set_device(0) == fake.ACL_SUCCESS
    context, ret = fake.rt.create_context(0)
    assert ret == fake.ACL_SUCCESS
    stream, _ = fake.rt.create_stream()
    assert fake.rt.destroy_context(context) == fake.ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(fake.rt.malloc(8, 0)))
    worker.start()
    worker.join()
    assert other_thread == [(0, fake.ACL_ERROR_RT_CONTEXT_NULL)]  # contexts are per thread
    assert fake.rt.destroy_stream(stream) == fake.rt.destroy_context(context) == fake.ACL_SUCCESS
    assert fake.rt.reset_device(0) == fake.finalize() == fake.ACL_SUCCESS
    assert fake.fake_leaks() == {}


def test_fake_memcpy_moves_bytes_and_checks_bounds():
    fake.init(), fake.rt.set_device(0), fake.rt.create_context(0)
    device, _ = fake.rt.malloc(16, fake.ACL_MEM_MALLOC_HUGE_FIRST)
    with pytest.warns(Warning, match="deprecated"):
        host = np.arange(4, dtype=np.int32)
        host_ptr = fake.util.numpy_to_ptr(host)
    assert fake.rt.memcpy(device, 16, host_ptr, 16, fake.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert fake.fake_read(device, 16) == host.tobytes()
    assert fake.rt.memcpy(device, 16, host_ptr, 32, 1) == fake.ACL_ERROR_INVALID_PARAM
    assert (
        fake.rt.memcpy(device, 16, host_ptr, 16, fake.ACL_MEMCPY_DEVICE_TO_HOST)
        == fake.ACL_ERROR_INVALID_PARAM
    )
    with pytest.raises(ValueError):
        fake.util.bytes_to_ptr(bytearray(4))  # like pyACL: bytes only
    assert fake.fake_leaks()["device_memory"] == {device: 16}


def test_fake_is_importable_as_acl_from_its_directory():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent / "fake_acl")}
    probe = "import acl; assert acl.FAKE and acl.rt.malloc and acl.mdl.execute; print(acl.__file__)"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip().endswith(os.path.join("fake_acl", "acl.py"))

"""The FAKE pyACL (tests/fake_acl/acl.py) held to the real one: every call to the C wrapper's
argument and result formats (its table PYACL, from hicann/runtime python/pyACL/), and the real
behaviours the runtime meets around them."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from conftest import ROOT, load_fake_acl


@pytest.fixture
def acl():
    """A FAKE pyACL of a new process, initialised, with a context on device 0 and a stream."""
    fake = load_fake_acl()
    assert fake.init() == fake.rt.set_device(0) == fake.ACL_SUCCESS
    fake.rt.create_context(0)
    fake.stream, _ = fake.rt.create_stream()
    return fake


def project_acl_calls() -> set[str]:
    """Every `acl.*` call in the project's code (direct, through a local `rt`/`mdl`/`util`, or probed
    with getattr)."""
    patterns = [
        r"(?:self\._acl|\bacl)\.((?:rt\.|mdl\.|util\.)?\w+)\s*\(",
        r"(?<![\w.])((?:rt|mdl|util)\.\w+)\s*\(",
        r"getattr\((?:self\._acl\.|acl\.)?(rt|mdl|util), \"(\w+)\"",
    ]
    found = set()
    for path in [*ROOT.glob("kserve_ascend/**/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("triton_backend/**/*.py")]:
        text = path.read_text()
        for pattern in patterns:
            for match in re.finditer(pattern, text):
                found.add("acl." + ".".join(match.groups()))
    return found


def test_every_acl_call_the_project_makes_has_its_pyacl_formats_in_the_table(acl):
    called = project_acl_calls()
    assert {"acl.rt.memcpy_async", "acl.mdl.set_dynamic_batch_size", "acl.util.ptr_to_numpy"} <= called
    assert sorted(called - set(acl.PYACL)) == []
    for name, wrapper in acl.PYACL.items():
        assert re.fullmatch(r"(rt|mdl|util)/\w+\.cpp Wrap\w+|py_init_acl\.cpp Wrap\w+", wrapper.source), name


@pytest.mark.parametrize(
    "call, args",
    [
        ("rt.malloc", (16.0, 0)),  # "k": an int, not a float
        ("rt.malloc", (np.int64(16), 0)),  # ...nor a numpy integer
        ("rt.malloc", (16,)),  # arity
        ("rt.set_device", (2**31,)),  # "i": a C int
        ("rt.synchronize_stream_with_timeout", (0x1000, 2**31)),
        ("rt.memcpy_async", (1, 2, 3, 4, 1)),  # six arguments
        ("mdl.load_from_file", (b"model.om",)),  # "s": str
        ("mdl.load_from_file", ("model\0.om",)),
        ("mdl.set_dynamic_batch_size", (1, 2, 3, 4.0)),
        ("init", (None,)),  # "|s": a str or nothing
    ],
)
def test_arguments_pyacl_cannot_parse_are_its_type_error(acl, call, args):
    function = acl
    for part in call.split("."):
        function = getattr(function, part)
    mark = len(acl.fake_calls())
    with pytest.raises(TypeError, match=rf"acl\.{re.escape(call)} args parse failed"):
        function(*args)
    assert acl.fake_calls()[mark:] == []  # the C function never ran


def test_arguments_reach_the_call_as_c_converts_them(acl):
    assert acl.rt.free(-1) == acl.ACL_ERROR_INVALID_PARAM  # "k" wraps: 2**64 - 1, no such allocation
    assert acl.fake_calls()[-1].args == (-1,)  # recorded as the caller passed it
    assert acl.rt.create_stream("ignored")[1] == acl.ACL_SUCCESS  # WrapAclRtCreateStream parses nothing
    assert acl.rt.set_device(True) == acl.ACL_SUCCESS  # a bool is an int to PyArg_ParseTuple


def test_ptr_to_numpy_wants_a_tuple_of_ints_as_its_wrapper_checks(acl):
    pinned, _ = acl.rt.malloc_host(16)
    int32 = np.dtype(np.int32).num
    with pytest.warns(Warning, match="will be deprecated"):
        with pytest.raises(ValueError, match="shape is empty"):
            acl.util.ptr_to_numpy(pinned, [4], int32)
        with pytest.raises(TypeError, match="not list of int"):
            acl.util.ptr_to_numpy(pinned, (np.int64(4),), int32)
        assert acl.util.ptr_to_numpy(pinned, (4,), int32).shape == (4,)


def test_failed_queries_return_what_the_c_wrappers_build(acl, tmp_path):
    model = acl.fake_write_om(tmp_path / "m.om", [("x", acl.ACL_FLOAT, [2, 3])])
    model_id, _ = acl.mdl.load_from_file(str(model))
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, model_id) == acl.ACL_SUCCESS
    assert acl.mdl.get_input_dims(desc, 5) == ({}, acl.ACL_ERROR_INVALID_PARAM)  # the empty dict
    assert acl.mdl.get_input_name_by_index(desc, 5) == ""
    assert acl.mdl.get_input_data_type(desc, 5) == -1  # ACL_DT_UNDEFINED
    assert acl.mdl.get_input_size_by_index(desc, 5) == 0
    acl.fake_inject("acl.rt.get_device_utilization_rate", acl.ACL_ERROR_RT_INVALID_DEVICEID)
    info, ret = acl.rt.get_device_utilization_rate(0)
    assert ret == acl.ACL_ERROR_RT_INVALID_DEVICEID and info["cube_utilization"] == 0


def test_a_result_pyacl_could_not_build_is_a_fake_bug(acl):
    broken = acl._api("acl.rt.malloc")(lambda size, policy: -size)  # an address "k" cannot hold
    with pytest.raises(AssertionError, match=r"FAKE acl\.rt\.malloc returned \(-16, 0\)"):
        broken(16, 0)


@pytest.mark.parametrize("timeout", [0, -2, -(2**31)])
def test_a_timeout_of_0_or_below_minus_1_is_refused_as_cann_refuses_it(acl, timeout):
    assert acl.rt.synchronize_stream_with_timeout(acl.stream, timeout) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.rt.synchronize_stream_with_timeout(acl.stream, -1) == acl.ACL_SUCCESS  # for ever
    assert acl.rt.synchronize_stream_with_timeout(acl.stream, 1) == acl.ACL_SUCCESS


def test_host_addresses_are_real_and_a_view_of_freed_pinned_memory_fails_on_use(acl):
    device, _ = acl.rt.malloc(16, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    pinned, _ = acl.rt.malloc_host(16)
    with pytest.warns(Warning):
        view = acl.util.ptr_to_numpy(pinned, (4,), np.dtype(np.float32).num)
    view[:] = [1, 2, 3, 4]
    assert ctypes.string_at(pinned, 16) == view.tobytes()  # the address is the memory's own
    assert device > 2**48  # device addresses are not host ones
    assert acl.rt.free_host(pinned) == acl.ACL_SUCCESS
    with pytest.raises(ValueError, match="read-only"):
        view[:] = 0  # real pyACL would write into freed memory
    assert np.isnan(view).all()  # ...or read whatever is there now: the fake's poison
    assert ctypes.string_at(pinned, 16) == bytes([acl.POISON]) * 16
    copy = acl.rt.memcpy_async(device, 16, pinned, 16, acl.ACL_MEMCPY_HOST_TO_DEVICE, acl.stream)
    assert copy == acl.ACL_ERROR_INVALID_PARAM  # no such allocation any more


def test_names_over_127_characters_are_renamed_in_the_dims_only(acl, tmp_path):
    long_in, long_out = "i" * 128, "o" * 200
    model = acl.fake_write_om(
        tmp_path / "m.om",
        [(long_in, acl.ACL_FLOAT, [2]), ("acl_modelId_1_output_1", acl.ACL_FLOAT, [3]), ("short", acl.ACL_FLOAT, [1])],
        outputs=[("x" * 127, acl.ACL_FLOAT, [2]), (long_out, acl.ACL_FLOAT, [3])],
    )
    model_id, _ = acl.mdl.load_from_file(str(model))
    assert model_id == 1
    desc = acl.mdl.create_desc()
    acl.mdl.get_desc(desc, model_id)
    assert acl.mdl.get_input_dims(desc, 0)[0]["name"] == "acl_modelId_1_input_0"
    assert acl.mdl.get_output_dims(desc, 0)[0]["name"] == "x" * 127  # 127 fit
    assert acl.mdl.get_output_dims(desc, 1)[0]["name"] == "acl_modelId_1_output_1_a"  # taken: a suffix
    assert acl.mdl.get_input_name_by_index(desc, 0) == long_in
    assert acl.mdl.get_output_name_by_index(desc, 1) == long_out
    assert acl.mdl.get_input_index_by_name(desc, long_in) == (0, acl.ACL_SUCCESS)


def test_graph_api_output_names_carry_the_network_output_index(acl, tmp_path):
    model = acl.fake_write_om(
        tmp_path / "m.om",
        [("a", acl.ACL_FLOAT, [2]), ("b", acl.ACL_INT32, [3])],
        outputs=[("y", acl.ACL_FLOAT, [2]), ("z", acl.ACL_INT32, [3])],
        graph_names=[1, 0],
    )
    model_id, _ = acl.mdl.load_from_file(str(model))
    desc = acl.mdl.create_desc()
    acl.mdl.get_desc(desc, model_id)
    names = [acl.mdl.get_output_name_by_index(desc, i) for i in range(2)]
    assert names == ["output_1_node_1_0", "output_0_node_0_0"]


# ---- device memory (issue 30) ------------------------------------------------------------------


def test_device_memory_is_what_allocations_and_loaded_models_take(acl, tmp_path):
    acl.fake_set_device_memory(0, 64 << 20)
    free, total, ret = acl.rt.get_mem_info(acl.ACL_HBM_MEM)
    assert (free, total, ret) == (64 << 20, 64 << 20, acl.ACL_SUCCESS)
    address, _ = acl.rt.malloc(1 << 20, 0)
    assert acl.rt.get_mem_info(acl.ACL_DDR_MEM)[0] == 63 << 20  # a 310P's DDR reads alike
    model = acl.fake_write_om(tmp_path / "m.om", [("x", acl.ACL_FLOAT, [2, 3])], work_size=3 << 20, weight_size=10 << 20)
    assert acl.mdl.query_size(str(model)) == (3 << 20, 10 << 20, acl.ACL_SUCCESS)
    model_id, ret = acl.mdl.load_from_file(str(model))
    assert ret == acl.ACL_SUCCESS
    assert acl.rt.get_mem_info(acl.ACL_HBM_MEM)[0] == 50 << 20
    assert acl.mdl.unload(model_id) == acl.rt.free(address) == acl.ACL_SUCCESS
    assert acl.rt.get_mem_info(acl.ACL_HBM_MEM)[:2] == (64 << 20, 64 << 20)
    assert acl.rt.get_mem_info(2)[:2] == (0, 0)  # an attribute the device does not have reads 0 and 0


def test_past_the_device_memory_malloc_and_load_fail_with_cann_codes(acl, tmp_path):
    acl.fake_set_device_memory(0, 8 << 20)
    assert acl.rt.malloc(9 << 20, 0) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    model = acl.fake_write_om(tmp_path / "m.om", [("x", acl.ACL_FLOAT, [2, 3])], weight_size=9 << 20)
    assert acl.mdl.load_from_file(str(model)) == (0, acl.ACL_ERROR_GE_MEMORY_ALLOCATION)
    assert acl.mdl.query_size(str(tmp_path / "none.om")) == (0, 0, acl.ACL_ERROR_GE_EXEC_MODEL_PATH_INVALID)


def test_get_mem_info_needs_a_device_set_in_the_thread():
    fake = load_fake_acl()
    assert fake.init() == fake.ACL_SUCCESS
    assert fake.rt.get_mem_info(fake.ACL_HBM_MEM) == (0, 0, fake.ACL_ERROR_RT_CONTEXT_NULL)
    assert fake.rt.set_device(1) == fake.ACL_SUCCESS
    assert fake.rt.get_mem_info(fake.ACL_HBM_MEM)[2] == fake.ACL_SUCCESS

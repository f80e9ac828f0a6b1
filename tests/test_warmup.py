"""Warmup: Triton's `model_warmup` and the default warmup run before a model version is READY.

The samples are built in-process as Triton defines them; then the real KServe server (with the
FAKE pyACL module standing in for CANN) is shown to run them inside the load, and real Triton
to run `model_warmup` itself on an `ascend` model while the backend runs only the default.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import requests
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import serialize_byte_tensor

from conftest import FAKE_ACL, fake_acl_env, load_fake_acl, start_server, start_triton, stop_server, wait_for, write_faults
from kserve_ascend.core.errors import ModelLoadError
from kserve_ascend.core.execution.warmup import configured_samples, default_samples

ACL_FLOAT = 0

# ---- samples, in-process -----------------------------------------------------------------------

CONFIG = """
name: "m"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "label" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def config(extra: str = "", max_batch_size: int = 8) -> mc.ModelConfig:
    return text_format.Parse(CONFIG.replace("max_batch_size: 8", f"max_batch_size: {max_batch_size}") + extra, mc.ModelConfig())


def warmup(sample: str) -> str:
    return f"model_warmup [ {{ {sample} }} ]"


def test_zero_and_random_data_make_batch_size_rows_of_the_sample_dims():
    samples = configured_samples(
        config(
            'model_warmup [ { name: "zeros" batch_size: 3 count: 2 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } },'
            ' { name: "noise" batch_size: 2 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] random_data: true } }'
            ' inputs { key: "label" value: { data_type: TYPE_STRING dims: [ 1 ] random_data: true } } },'
            ' { name: "skipped" batch_size: 0 } ]'
        ),
        Path("/nonexistent"),
    )
    zeros, noise = samples  # batch_size 0 is skipped, as Triton skips it
    assert (zeros.name, zeros.count) == ("zeros", 2)
    np.testing.assert_array_equal(zeros.inputs["x"], np.zeros((3, 2), np.float32))
    assert noise.count == 1 and noise.inputs["x"].shape == (2, 2) and noise.inputs["x"].dtype == np.float32
    # Triton: every request of a sample reads the same random bytes; strings get zero data.
    np.testing.assert_array_equal(noise.inputs["x"][0], noise.inputs["x"][1])
    assert noise.inputs["label"].tolist() == [[b""], [b""]]


def test_input_data_file_is_one_row_read_from_the_warmup_directory(tmp_path):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "x.bin").write_bytes(np.array([1.5, -2, 99], np.float32).tobytes())  # longer than a row
    (tmp_path / "warmup" / "label.bin").write_bytes(serialize_byte_tensor(np.array([b"cat"], dtype=object)).item())
    (sample,) = configured_samples(
        config(warmup(
            'name: "file" batch_size: 2 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "x.bin" } }'
            ' inputs { key: "label" value: { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "label.bin" } }'
        )),
        tmp_path,
    )
    np.testing.assert_array_equal(sample.inputs["x"], [[1.5, -2], [1.5, -2]])
    assert sample.inputs["label"].tolist() == [[b"cat"], [b"cat"]]


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ('name: "s" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "short.bin" } }',
         "model_warmup 's': warmup setting expects 8 bytes, but the data provided from short.bin only has 4 bytes"),
        ('name: "s" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "../config.pbtxt" } }',
         "outside the model's warmup/ directory"),
        ('name: "s" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "none.bin" } }',
         "No such file or directory: warmup/none.bin"),
        ('name: "s" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ -1 ] zero_data: true } }',
         "warmup setting expects all variable-size dimensions are specified for input 'x'"),
        ('name: "s" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] } }',
         "warmup setting expects input 'x' to have input_data_type set"),
        ('name: "s" batch_size: 9 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } }',
         "model_warmup 's': batch size 9 is outside 1..8"),
        ('name: "s" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } }',
         "input 'x' has datatype INT32, the model expects FP32"),
        ('name: "s" batch_size: 1 inputs { key: "x" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }',
         "input 'x' has shape [1, 3], the model expects [-1, 2]"),
        ('name: "s" batch_size: 1 inputs { key: "label" value: { data_type: TYPE_STRING dims: [ 1 ] zero_data: true } }',
         "missing input 'x'"),
    ],
)
def test_a_sample_the_model_cannot_take_is_a_load_error_saying_why(tmp_path, sample, message):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "short.bin").write_bytes(b"\0" * 4)
    with pytest.raises(ModelLoadError) as error:
        configured_samples(config(warmup(sample)), tmp_path)
    assert message in str(error.value)


def instance(batch_sizes=(), compiles_per_shape=False):
    """What default warmup reads of an Instance: the sizes it runs at, and its runtime."""
    runtime = SimpleNamespace(batch_sizes=batch_sizes, compiles_per_shape=compiles_per_shape)
    return SimpleNamespace(batch_sizes=batch_sizes, runtime=runtime)


@pytest.mark.parametrize(
    ("sizes", "compiles", "max_batch_size", "rows"),
    [
        ((1, 2, 4, 8), False, 8, [1, 2, 4, 8]),  # every OM gear
        ((1, 2, 4, 8), False, 3, [1, 2, 3]),  # the gears the batcher reaches: 3 rows run at gear 4
        ((1,), False, 8, [1]),  # a static batch: every execution is of 1 row
        ((), True, 4, [1, 2, 3, 4]),  # compiles per shape: every batch size the batcher can form
        ((), False, 8, []),  # any batch, nothing compiled per shape: nothing to warm
    ],
)
def test_default_warmup_runs_zeros_at_every_batch_size_the_runtime_will_see(sizes, compiles, max_batch_size, rows):
    samples = default_samples(config(max_batch_size=max_batch_size), instance(sizes, compiles))
    assert [s.inputs["x"].shape[0] for s in samples] == rows
    assert all(set(s.inputs) == {"x"} and not s.inputs["x"].any() for s in samples)  # the optional input is left out


def test_parameter_warmup_none_turns_the_default_off_and_other_values_are_refused():
    off = config('parameters { key: "warmup" value: { string_value: "none" } }')
    assert default_samples(off, instance((1, 2))) == []
    with pytest.raises(ModelLoadError, match="parameter warmup must be one of default, none, got 'off'"):
        default_samples(config('parameters { key: "warmup" value: { string_value: "off" } }'), instance((1, 2)))


# ---- the KServe server -------------------------------------------------------------------------

OM = 'name: "{name}"\nbackend: "ascend"\nmax_batch_size: 8\n{extra}\n'
ZERO_SAMPLE = 'model_warmup [ { name: "zeros" batch_size: 3 count: 2 inputs { key: "images" value: { data_type: TYPE_FP32 dims: [ 3, 8, 8 ] zero_data: true } } } ]'
FILE_SAMPLE = 'model_warmup [ { name: "from_file" batch_size: 1 inputs { key: "images" value: { data_type: TYPE_FP32 dims: [ 3, 8, 8 ] input_data_file: "images.bin" } } } ]'


def om_model(root: Path, name: str, extra: str = "") -> Path:
    fake_acl = load_fake_acl()
    (root / name / "1").mkdir(parents=True)
    fake_acl.fake_write_om(root / name / "1" / "model.om", [("images", ACL_FLOAT, [-1, 3, 8, 8])], dynamic_batch=[1, 2, 4, 8])
    (root / name / "config.pbtxt").write_text(OM.format(name=name, extra=extra))
    return root / name


@pytest.fixture(scope="module")
def kserve(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup_repo")
    om_model(root, "gears")
    om_model(root, "configured", ZERO_SAMPLE)
    (om_model(root, "from_file", FILE_SAMPLE) / "warmup").mkdir()
    (root / "from_file" / "warmup" / "images.bin").write_bytes(np.ones(3 * 8 * 8, np.float32).tobytes())
    om_model(root, "no_warmup", 'parameters { key: "warmup" value: { string_value: "none" } }')
    om_model(root, "late")
    om_model(root, "failing")
    faults = root.parent / "warmup_faults.json"
    write_faults(faults, [])
    env = fake_acl_env(faults)
    startup = [arg for name in ("gears", "configured", "from_file", "no_warmup") for arg in ("--load_model", name)]
    server = start_server(root, root.parent / "warmup.log", "--model_control_mode", "explicit", *startup, env=env)
    yield server, faults
    stop_server(server)


def parameters(server, model: str) -> dict:
    return requests.get(f"{server.url}/v2/models/{model}", timeout=10).json()["parameters"]


def test_warmup_time_is_in_metadata_and_logged_unless_warmup_is_off(kserve):
    server, _ = kserve
    for model in ("gears", "configured", "from_file"):
        assert float(parameters(server, model)["warmup_ms"]) >= 0
    assert "warmup_ms" not in parameters(server, "no_warmup")
    log = server.output()
    assert "model 'gears' version 1 warmed up in" in log and "4 samples on 1 instances" in log  # gears 1, 2, 4, 8
    assert "model 'configured' version 1 warmed up in" in log
    assert "model 'no_warmup' version 1 warmed up" not in log


def test_a_model_is_not_ready_while_its_warmup_runs(kserve):
    server, faults = kserve
    # acl.mdl.set_dynamic_batch_size runs only in an execution of a gear model (never while loading):
    # hung, it holds the default warmup's first execution until released.
    write_faults(faults, [{"call": "acl.mdl.set_dynamic_batch_size", "hang": True}])
    answer = {}
    loading = threading.Thread(
        target=lambda: answer.update(load=requests.post(f"{server.url}/v2/repository/models/late/load", timeout=60))
    )
    loading.start()
    late_loading = {"name": "late", "state": "LOADING", "reason": "loading"}
    try:
        index = f"{server.url}/v2/repository/index"
        wait_for(lambda: late_loading in requests.post(index, timeout=5).json(), "the late model loading", timeout=10, server=server)
        for _ in range(5):  # held in warmup: never ready, the load never answered
            assert requests.get(f"{server.url}/v2/models/late/ready", timeout=5).status_code == 400
            assert requests.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 400
            assert late_loading in requests.post(f"{server.url}/v2/repository/index", timeout=5).json()
            loading.join(0.2)
        assert loading.is_alive()
    finally:
        write_faults(faults, [{"release": True}])
        # The fake reads its control file at its next call: a scrape asks the loaded models' devices.
        requests.get(f"{server.url}/metrics", timeout=10)
        loading.join(60)
    assert answer["load"].status_code == 200
    assert requests.get(f"{server.url}/v2/models/late/ready", timeout=5).status_code == 200
    assert "warmup_ms" in parameters(server, "late")


def test_a_failing_warmup_fails_the_load_with_the_reason(kserve):
    server, faults = kserve
    write_faults(faults, [{"call": "acl.mdl.execute_async", "ret": 507015, "times": 1}])  # an AI Core exception
    answer = requests.post(f"{server.url}/v2/repository/models/failing/load", timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "warmup sample 'default batch 1' on device 0 failed" in error and "507015" in error
    ready = requests.get(f"{server.url}/v2/models/failing/ready", timeout=5)
    assert ready.status_code == 400 and "warmup sample 'default batch 1'" in ready.json()["error"]
    # The fault was one-off: loading again warms up and serves.
    assert requests.post(f"{server.url}/v2/repository/models/failing/load", timeout=60).status_code == 200


def test_models_waiting_for_their_turn_at_start_up_are_loading_not_unloaded(tmp_path):
    """The start-up load runs one model at a time; the index says LOADING for each one still to come
    (a CI run once read a model waiting behind a failed one as UNAVAILABLE "unloaded")."""
    om_model(tmp_path, "a_ready", 'parameters { key: "warmup" value: { string_value: "none" } }')
    om_model(tmp_path, "b_held")  # its default warmup's first execution hangs until released
    om_model(tmp_path, "c_next")
    faults = tmp_path / "faults.json"
    write_faults(faults, [{"call": "acl.mdl.set_dynamic_batch_size", "hang": True}])
    env = fake_acl_env(faults)
    server = start_server(tmp_path, tmp_path / "server.log", env=env, wait="live")

    def states() -> dict:
        return {e["name"]: (e["state"], e["reason"]) for e in requests.post(f"{server.url}/v2/repository/index", timeout=5).json()}

    try:
        wait_for(lambda: states()["a_ready"][0] == "READY", "a_ready loaded", server=server)
        assert states() == {"a_ready": ("READY", ""), "b_held": ("LOADING", "loading"), "c_next": ("LOADING", "loading")}
        assert requests.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 400
        write_faults(faults, [{"release": True}])
        # The fake reads its control file at its next call: a scrape asks the loaded model's device.
        requests.get(f"{server.url}/metrics", timeout=10)
        wait_for(lambda: requests.get(f"{server.url}/v2/health/ready", timeout=1).status_code == 200, "the server ready", server=server)
        assert {state for state, _ in states().values()} == {"READY"}
    finally:
        stop_server(server)


# ---- real Triton -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup_triton_repo")
    om_model(root, "gears")
    om_model(root, "configured", ZERO_SAMPLE)
    # The stub imports the backend's model.py from its directory, which is on its sys.path (PYTHONPATH
    # does not reach it): the FAKE pyACL module beside it is what `import acl` finds.
    workdir = tmp_path_factory.mktemp("warmup_triton")
    (workdir / "backends" / "ascend").mkdir(parents=True)
    shutil.copy(FAKE_ACL / "acl.py", workdir / "backends" / "ascend" / "acl.py")
    server = start_triton(root, workdir, "--log-verbose=1")
    yield server
    stop_server(server)


def test_triton_runs_model_warmup_itself_and_the_backend_only_the_default(triton):
    index = requests.post(f"{triton.url}/v2/repository/index", timeout=10).json()
    assert {(m["name"], m["state"]) for m in index} == {("gears", "READY"), ("configured", "READY")}
    log = triton.output()
    assert "model 'configured' instance configured_0 is running warmup sample 'zeros'" in log  # Triton's own
    assert "gears_0: warmed up in" in log  # the backend's default, where the config has no model_warmup
    assert "configured_0: warmed up" not in log

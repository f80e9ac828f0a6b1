"""`--config config.yaml`, the CANN inference server's front door, serving what config.pbtxt serves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from conftest import REPOSITORY, ROOT, Server, free_port, infer, start, stop_server, tensors
from kserve_ascend import cann_config
from kserve_ascend.core.config import apply_input_shape, read_config
from kserve_ascend.core.errors import ModelLoadError

YOLO = REPOSITORY / "yolov8n" / "1" / "model.onnx"
SIMPLE = REPOSITORY / "simple" / "1" / "model.onnx"


def start_with_config(config: Path, log: Path, grpc_port: int | None = None, env: dict | None = None) -> Server:
    """`python -m kserve_ascend --config <file>`, reached on the file's ports (gRPC's: the flag's, if given)."""
    ports = cann_config.load(config).server
    flags = ["--grpc_port", str(grpc_port)] if grpc_port else []

    def loaded(server: Server) -> bool:  # a model meant to fail keeps the server unready: wait until each has been tried
        index = requests.post(f"{server.url}/v2/repository/index", timeout=1).json()
        return bool(index) and all(e["state"] == "READY" or e["reason"] not in ("unloaded", "loading") for e in index)

    command = [sys.executable, "-m", "kserve_ascend", "--config", str(config), *flags]
    return start(command, log, ports.http_port, grpc_port or ports.grpc_port, ports.metrics_port,
                 name="kserve-ascend", ready=loaded, timeout=90, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def yaml_server(tmp_path_factory):
    """The CANN design's yolov8 entry (and the same without dynamic_batching), `simple` as two versions and a
    misdeclared model, on the file's ports.

    gRPC's port is given as a flag, which wins over the file's.
    """
    folder = tmp_path_factory.mktemp("cann")
    http_port, grpc_port, metrics_port, grpc_flag = free_port(), free_port(), free_port(), free_port()
    config = folder / "config.yaml"
    config.write_text(f"""\
server:
  http_port: {http_port}
  grpc_port: {grpc_port}
  metrics_port: {metrics_port}
models:
  - name: yolov8n
    version: 1
    model_path: {os.path.relpath(YOLO, folder)}   # relative to this file's folder
    input_shape: [1, 3, 640, 640]
    device_id: 0
    dynamic_batching:
      max_batch_size: 8
      max_delay_ms: 5
  - name: yolov8n_unbatched
    model_path: {YOLO}
    input_shape: [1, 3, 640, 640]
  - name: simple
    version: 1
    model_path: {SIMPLE}
  - name: simple
    version: 2
    model_path: {SIMPLE}
  - name: misdeclared
    model_path: {SIMPLE}
    input_shape: [1, 8]
""")
    tmp = folder / "tmp"  # where the server makes its repository
    tmp.mkdir()
    server = start_with_config(config, folder / "server.log", grpc_port=grpc_flag, env={"TMPDIR": str(tmp)})
    yield server, tmp
    stop_server(server)


def test_yaml_model_has_the_metadata_and_config_of_its_config_pbtxt(yaml_server, server):
    served, _ = yaml_server
    for name in ("yolov8n", "simple"):
        ours = requests.get(f"{served.url}/v2/models/{name}").json()
        reference = requests.get(f"{server.url}/v2/models/{name}").json()
        assert (ours["inputs"], ours["outputs"]) == (reference["inputs"], reference["outputs"])
    # yolov8n/config.pbtxt is the CANN design's entry written as Triton config.
    ours = requests.get(f"{served.url}/v2/models/yolov8n/config").json()
    reference = requests.get(f"{server.url}/v2/models/yolov8n/config").json()
    for key in ("max_batch_size", "input", "output", "dynamic_batching"):
        assert ours[key] == reference[key], key
    assert ours["parameters"]["device_ids"] == reference["parameters"]["device_ids"]


def test_yaml_model_answers_as_its_config_pbtxt_over_http_and_grpc(yaml_server, server):
    served, _ = yaml_server
    image = np.random.default_rng(7).random((1, 3, 640, 640), dtype=np.float32)
    for protocol in ("http", "grpc"):
        outputs = [infer(target, "yolov8n", {"images": image}, protocol)["output0"] for target in (served, server)]
        assert outputs[0].shape == (1, 84, 8400)
        np.testing.assert_array_equal(outputs[0], outputs[1])


def test_input_shape_is_batch_first_and_exact_without_dynamic_batching(yaml_server):
    """The first dimension of input_shape is the batch: with dynamic_batching a request carries 1..max_batch_size
    rows of the other dimensions, as declared; without it the whole shape is exact, even for a file whose first
    dimension is variable (which a config without input_shape would batch)."""
    served, _ = yaml_server

    def output_shape(model: str, shape: tuple) -> tuple:
        return infer(served, model, {"images": np.zeros(shape, np.float32)})["output0"].shape

    assert output_shape("yolov8n", (2, 3, 640, 640)) == (2, 84, 8400)
    assert output_shape("yolov8n_unbatched", (1, 3, 640, 640)) == (1, 84, 8400)
    assert requests.get(f"{served.url}/v2/models/yolov8n_unbatched").json()["inputs"][0]["shape"] == [1, 3, 640, 640]
    refused = [
        ("yolov8n", (2, 3, 320, 320), "input 'images' has shape [2, 3, 320, 320], the model expects [-1, 3, 640, 640]"),
        ("yolov8n_unbatched", (2, 3, 640, 640), "input 'images' has shape [2, 3, 640, 640], the model expects [1, 3, 640, 640]"),
    ]
    for model, shape, message in refused:
        with pytest.raises(InferenceServerException) as raised:
            output_shape(model, shape)
        assert raised.value.status() == "400" and message in raised.value.message()


def test_entries_of_one_name_are_its_versions(yaml_server):
    served, _ = yaml_server
    client = grpcclient.InferenceServerClient(served.grpc)
    assert client.get_model_metadata("simple").versions == ["1", "2"]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    for version in ("1", "2"):
        result = client.infer("simple", tensors(grpcclient, {"INPUT0": a, "INPUT1": a}), model_version=version)
        assert result.get_response().model_version == version
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)


def test_input_shape_the_file_does_not_have_fails_the_model_with_the_reason(yaml_server):
    served, _ = yaml_server
    index = {e["name"]: e for e in requests.post(f"{served.url}/v2/repository/index").json()}
    assert index["misdeclared"]["state"] == "UNAVAILABLE"
    assert "input_shape [1, 8] does not fit input 'INPUT0' of shape [-1, 16]" in index["misdeclared"]["reason"]
    assert index["simple"]["state"] == "READY"


def test_generated_repository_is_removed_at_exit_and_the_models_stay(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"server: {{http_port: {free_port()}, grpc_port: {free_port()}, metrics_port: {free_port()}}}\n"
                      f"models: [{{name: simple, model_path: {SIMPLE}}}]\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = start_with_config(config, tmp_path / "server.log", env={"TMPDIR": str(tmp)})
    (repository,) = tmp.glob("kserve-ascend-config-*")
    assert (repository / "simple" / "config.pbtxt").is_file()
    stop_server(server)
    assert server.process.returncode == 0
    assert not repository.exists()
    assert SIMPLE.is_file()


def test_bad_config_exits_with_the_place_and_no_traceback(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(f"models:\n  - name: simple\n    modle_path: {SIMPLE}\n")
    result = subprocess.run(
        [sys.executable, "-m", "kserve_ascend", "--config", str(config)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode != 0
    assert f"kserve-ascend: {config}: models[0]: missing key 'model_path'; models[0]: unknown key 'modle_path'" in result.stderr
    assert "Traceback" not in result.stderr


# --- the file's checks, one bad place at a time -------------------------------------------------

GOOD_MODEL = "{name: m, model_path: m.onnx}"
BAD = [
    ("models: [{name: m, modle_path: m.onnx}]",
     "models[0]: unknown key 'modle_path' (expected: name, version, model_path, input_shape, device_id, dynamic_batching)"),
    (f"servers: {{http_port: 80}}\nmodels: [{GOOD_MODEL}]", "top level: unknown key 'servers' (expected: server, models)"),
    ("models: [{name: m, model_path: m.onnx, dynamic_batching: {max_batch_size: 8, max_delay_us: 5}}]",
     "models[0].dynamic_batching: unknown key 'max_delay_us' (expected: max_batch_size, max_delay_ms)"),
    (f"models: [{GOOD_MODEL}, {{name: n, model_path: m.onnx, dynamic_batching: {{max_batch_size: 8, max_delay_ms: soon}}}}]",
     "models[1].dynamic_batching.max_delay_ms: input should be a valid number, got 'soon'"),
    ("models: [{name: m, model_path: m.onnx, dynamic_batching: {max_batch_size: 8, max_delay_ms: -1}}]",
     "models[0].dynamic_batching.max_delay_ms: input should be greater than or equal to 0, got -1"),
    ("models: [{name: m, model_path: m.onnx, dynamic_batching: {max_batch_size: '8'}}]",
     "models[0].dynamic_batching.max_batch_size: input should be a valid integer, got '8'"),
    ("models: [{name: m, model_path: m.onnx, dynamic_batching: {max_delay_ms: 5}}]",
     "models[0].dynamic_batching: missing key 'max_batch_size'"),
    ("models: [{name: m, model_path: m.onnx, dynamic_batching: [8, 5]}]",
     "models[0].dynamic_batching: must be a mapping with keys max_batch_size, max_delay_ms, got [8, 5]"),
    (f"server: {{http_port: 70000}}\nmodels: [{GOOD_MODEL}]", "server.http_port: input should be less than or equal to 65535, got 70000"),
    (f"server: {{grpc_port: 0}}\nmodels: [{GOOD_MODEL}]", "server.grpc_port: input should be greater than or equal to 1, got 0"),
    (f"server: {{metrics_port: '9090'}}\nmodels: [{GOOD_MODEL}]", "server.metrics_port: input should be a valid integer, got '9090'"),
    ("models: [{name: m, model_path: m.onnx, version: 0}]", "models[0].version: input should be greater than or equal to 1, got 0"),
    ("models: [{name: m, model_path: m.onnx, device_id: yes}]", "models[0].device_id: input should be a valid integer, got True"),
    ("models: [{name: m, model_path: m.onnx, input_shape: '1,3,640,640'}]",
     "models[0].input_shape: input should be a valid list, got '1,3,640,640'"),
    ("models: [{name: m, model_path: m.onnx, input_shape: [1, 0, 640]}]",
     "models[0].input_shape[1]: input should be greater than or equal to 1, got 0"),
    ("models: [{name: m, model_path: missing.onnx}]", "models[0].model_path: no such file {folder}/missing.onnx"),
    ("models: [{name: m, model_path: m.pt}]", "models[0].model_path: must be an .onnx or .om file, got 'm.pt'"),
    ("models: [{model_path: m.onnx}]", "models[0]: missing key 'name'"),
    ("models: [{name: a/b, model_path: m.onnx}]",
     "models[0].name: must be letters, digits, '_', '-' or '.', not starting with '.', got 'a/b'"),
    (f"models: [{GOOD_MODEL}, {GOOD_MODEL}]", "models[1]: duplicates models[0] (name 'm', version 1)"),
    (f"models: [{GOOD_MODEL}, {{name: m, version: 2, model_path: m.onnx, device_id: 1}}]",
     "models[1].device_id: differs from models[0], another version of 'm'"),
    (f"models: [{GOOD_MODEL}, {{name: m, version: 2, model_path: other/m2.onnx}}]",
     "models[1].model_path: file name 'm2.onnx' differs from 'm.onnx' of models[0], another version of 'm'"),
    ("models: []", "models: list should have at least 1 item"),
    ("server: {http_port: 80}", "top level: missing key 'models'"),
    ("", "top level: must be a mapping with keys server, models, got None"),
    ("models: [", "not valid YAML: line 1, column 10"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[message.split(":")[0] + f"-{i}" for i, (_, message) in enumerate(BAD)])
def test_bad_config_names_the_place(tmp_path, text, message):
    (tmp_path / "m.onnx").touch()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "m2.onnx").touch()
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(cann_config.ConfigError) as raised:
        cann_config.load(config)
    assert message.format(folder=tmp_path) in str(raised.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(cann_config.ConfigError, match="cannot read it: No such file or directory"):
        cann_config.load(tmp_path / "absent.yaml")


def test_entries_map_onto_a_triton_layout_repository(tmp_path, monkeypatch):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "model.om").touch()
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "model.om").touch()
    config = tmp_path / "config.yaml"
    config.write_text("""\
server: {http_port: 8000, grpc_port: 8001}
models:
  - {name: yolov8, version: 2, model_path: v2/model.om, input_shape: [1, 3, 640, 640], device_id: 3,
     dynamic_batching: {max_batch_size: 8, max_delay_ms: 2.5}}
  - {name: yolov8, version: 1, model_path: v1/model.om, input_shape: [1, 3, 640, 640], device_id: 3,
     dynamic_batching: {max_batch_size: 8, max_delay_ms: 2.5}}
""")
    monkeypatch.chdir("/")  # model_path is relative to the file, not to the working directory
    loaded = cann_config.load(config)
    root = tmp_path / "repository"
    root.mkdir()
    cann_config.write_repository(loaded, root)

    expected = mc.ModelConfig(name="yolov8", backend="ascend", max_batch_size=8, default_model_filename="model.om")
    expected.version_policy.specific.versions.extend([1, 2])
    expected.dynamic_batching.max_queue_delay_microseconds = 2500
    expected.parameters["device_ids"].string_value = "3"
    expected.parameters["input_shape"].string_value = "1,3,640,640"
    assert read_config(root / "yolov8") == expected
    assert (root / "yolov8" / "1" / "model.om").resolve() == (tmp_path / "v1" / "model.om").resolve()
    assert (root / "yolov8" / "2" / "model.om").resolve() == (tmp_path / "v2" / "model.om").resolve()
    assert loaded.server.model_dump(exclude_none=True) == {"http_port": 8000, "grpc_port": 8001}


def test_without_dynamic_batching_the_model_file_decides_batching(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"models: [{{name: simple, model_path: {SIMPLE}}}]\n")
    generated = cann_config.model_config(cann_config.load(config).models)
    assert generated.max_batch_size == 0 and not generated.HasField("dynamic_batching")


def declared(max_batch_size: int, dims: list[int], input_shape: str) -> mc.ModelConfig:
    config = mc.ModelConfig(name="m", max_batch_size=max_batch_size)
    config.input.add(name="images", data_type=mc.TYPE_FP32, dims=dims)
    config.parameters["input_shape"].string_value = input_shape
    return config


def test_input_shape_holds_variable_dims_to_the_declared_size():
    config = declared(8, [3, -1, -1], "1,3,640,640")
    apply_input_shape(config)
    assert list(config.input[0].dims) == [3, 640, 640]


def test_input_shape_without_batching_is_the_whole_shape():
    config = declared(0, [1, 3, 640, 640], "1,3,640,640")
    apply_input_shape(config)
    assert list(config.input[0].dims) == [1, 3, 640, 640]
    with pytest.raises(ModelLoadError, match=r"input_shape \[3, 640, 640\] does not fit input 'images' of shape \[1, 3, 640, 640\]"):
        apply_input_shape(declared(0, [1, 3, 640, 640], "3,640,640"))


def test_input_shape_must_be_integers():
    with pytest.raises(ModelLoadError, match="parameter input_shape must be comma-separated integers, got '1,x'"):
        apply_input_shape(declared(8, [3], "1,x"))

"""config.pbtxt handling in the core: parsing, version policy, placement, runtime choice, auto-complete."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import REPOSITORY, copy_model
from kserve_ascend.core import config as cfg
from kserve_ascend.core.contracts import RequestOptions
from kserve_ascend.core.errors import ModelLoadError
from kserve_ascend.core.models.model import Model
from kserve_ascend.core.execution.runtimes import runtime_name
from kserve_ascend.core.stats import RequestTiming


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("", [7]),
        ("version_policy { latest { num_versions: 2 } }", [3, 7]),
        ("version_policy { all {} }", [1, 3, 7]),
        ("version_policy { specific { versions: [3, 1] } }", [1, 3]),
    ],
)
def test_version_policy(policy, expected):
    assert cfg.select_versions(parse(policy), [1, 3, 7]) == expected


def test_specific_version_that_does_not_exist_is_a_load_error():
    with pytest.raises(ModelLoadError, match=r"versions \[4\]"):
        cfg.select_versions(parse("version_policy { specific { versions: [4] } }"), [1, 3])


@pytest.mark.parametrize(
    "text, placement",
    [
        ("", [0]),
        ('instance_group [{ count: 3 }] parameters { key: "device_ids" value { string_value: "4,5" } }', [4, 5, 4]),
        ("instance_group [{ count: 2 gpus: [1, 6] }]", [1, 1, 6, 6]),
        ('instance_group [{ count: 1 }, { count: 2 }] parameters { key: "device_ids" value { string_value: "0,1" } }', [0, 1, 0]),
    ],
)
def test_device_placement(text, placement):
    assert cfg.device_placement(parse(text)) == placement


def test_bad_device_ids_are_a_load_error():
    with pytest.raises(ModelLoadError, match="device_ids"):
        cfg.device_placement(parse('parameters { key: "device_ids" value { string_value: "npu0" } }'))


def test_config_name_must_match_directory(tmp_path):
    model = copy_model("simple", tmp_path, "renamed")
    (model / "config.pbtxt").write_text('name: "other"')
    with pytest.raises(ModelLoadError, match="directory is 'renamed'"):
        cfg.read_config(model)


@pytest.mark.parametrize(
    "file, text, runtime",
    [("model.onnx", "", "onnx"), ("model.om", "", "acl"), ("model.sim", "", "sim"),
     ("weights.bin", 'parameters { key: "runtime" value { string_value: "onnx" } }', "onnx")],
)
def test_runtime_by_extension_or_parameter(file, text, runtime):
    assert runtime_name(parse(text), Path(file)) == runtime


def test_unknown_runtime_is_a_load_error():
    with pytest.raises(ModelLoadError, match="no runtime for weights.bin"):
        runtime_name(parse(""), Path("weights.bin"))


def test_default_model_filename(tmp_path):
    model = copy_model("simple", tmp_path)
    (model / "1" / "model.onnx").rename(model / "1" / "sum.onnx")
    assert cfg.model_file(parse('default_model_filename: "sum.onnx"'), model / "1").name == "sum.onnx"
    with pytest.raises(ModelLoadError, match="has no model file"):
        cfg.model_file(parse(""), model / "1")


def test_missing_config_is_auto_completed_from_the_onnx_file(tmp_path):
    """As Triton's ONNX backend does: inputs, outputs and a batch dimension come from the file."""
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.onnx").write_bytes((REPOSITORY / "simple" / "1" / "model.onnx").read_bytes())
    model = Model(tmp_path.name, tmp_path)
    model.load()
    config = model.config
    assert config.max_batch_size == 4
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("INPUT0", mc.TYPE_INT32, [16]),
        ("INPUT1", mc.TYPE_INT32, [16]),
    ]
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"]
    model.close()


def test_reshape_presents_other_dims_to_clients(tmp_path):
    """config.pbtxt `reshape`: clients send [4, 4], the model file sees [16]."""
    model = copy_model("simple", tmp_path)
    text = (model / "config.pbtxt").read_text()
    for name in ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"):
        text = text.replace(f'name: "{name}" data_type: TYPE_INT32 dims: [ 16 ]', f'name: "{name}" data_type: TYPE_INT32 dims: [ 4, 4 ] reshape: {{ shape: [ 16 ] }}')
    (model / "config.pbtxt").write_text(text)
    loaded = Model("simple", model)
    loaded.load()
    a = np.arange(32, dtype=np.int32).reshape(2, 4, 4)
    outputs = asyncio.run(loaded.version().infer({"INPUT0": a, "INPUT1": a}, (), RequestOptions.NONE, RequestTiming()))
    assert outputs["OUTPUT0"].shape == (2, 4, 4)
    np.testing.assert_array_equal(outputs["OUTPUT0"], 2 * a)
    loaded.close()


def test_config_json_writes_int64_as_numbers():
    config = cfg.read_config(REPOSITORY / "yolov8n")
    as_json = cfg.config_json(config)
    assert as_json["input"][0]["dims"] == [3, 640, 640]
    assert as_json["dynamic_batching"]["max_queue_delay_microseconds"] == 5000

"""The model configuration extension written as Triton writes it, field by field against real Triton's
answer for every model of model_repository/, over REST and gRPC; each instance group with the NPUs
it runs on."""

from __future__ import annotations

import pytest
import requests
import tritonclient.grpc as grpcclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from conftest import REPOSITORY, copy_model, start_server, stop_server
from kserve_ascend.core import config as cfg

MODELS = sorted(p.name for p in REPOSITORY.iterdir() if (p / "config.pbtxt").is_file())

#: What Triton writes that this server leaves out, and why: they describe Triton's own machinery.
TRITON_ONLY = {
    # CUDA pinned host buffers and the TensorRT/ORT graph priorities, filled in by Triton's
    # NormalizeModelConfig; nothing of this server reads them.
    "optimization",
    # The backend's library: "model.py" under Triton's Python backend; this server has no backend.
    "runtime",
}


def as_dict(config: mc.ModelConfig) -> dict:
    """A ModelConfig as Triton's REST answer writes it, to compare gRPC answers with."""
    return json_format.MessageToDict(config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def differences(ours: dict, theirs: dict, path: str = "") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = []
        for key in sorted(set(ours) | set(theirs)):
            if key not in ours or key not in theirs:
                found.append(f"{path}/{key}: only in {'triton' if key in theirs else 'kserve'}")
            else:
                found += differences(ours[key], theirs[key], f"{path}/{key}")
        return found
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]


def without(config: dict, keys) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


def initial_state_dims_as_numbers(config: dict) -> dict:
    """Triton's one 64-bit field left a string: ModelConfigToJson (core's model_config_utils.cc) looks
    `initial_state` up in sequence_batching rather than in each state, so never finds it. This
    server writes every int64 as a number."""
    for state in config.get("sequence_batching", {}).get("state", []):
        for initial in state.get("initial_state", []):
            initial["dims"] = [int(d) for d in initial["dims"]]
    return config


@pytest.mark.parametrize("model", MODELS)
def test_rest_config_is_tritons_field_by_field(server, triton, model):
    ours = requests.get(f"{server.url}/v2/models/{model}/config").json()
    theirs = initial_state_dims_as_numbers(requests.get(f"{triton.url}/v2/models/{model}/config").json())
    assert differences(without(ours, TRITON_ONLY), without(theirs, TRITON_ONLY)) == []
    # Every field Triton writes is compared but those listed, and those are Triton's indeed (an ensemble
    # runs no backend: Triton writes neither for it).
    ensemble = theirs["platform"] == "ensemble"
    assert set(theirs) - set(ours) == (set() if ensemble else {"optimization"})
    assert ours["runtime"] == "" and theirs["runtime"] == ("" if ensemble else "model.py")


@pytest.mark.parametrize("model", MODELS)
def test_grpc_config_is_tritons_and_the_rest_answers(server, triton, model):
    with grpcclient.InferenceServerClient(server.grpc) as ours, grpcclient.InferenceServerClient(triton.grpc) as theirs:
        mine, tritons = ours.get_model_config(model).config, theirs.get_model_config(model).config
    assert differences(without(as_dict(mine), TRITON_ONLY), without(as_dict(tritons), TRITON_ONLY)) == []
    rest = requests.get(f"{server.url}/v2/models/{model}/config").json()
    assert json_format.ParseDict(rest, mc.ModelConfig()) == mine


def test_fields_at_their_default_read_as_image_client_reads_them(server):
    # yolov8n_detect: max_batch_size 0 and no version_policy in its config.pbtxt.
    config = requests.get(f"{server.url}/v2/models/yolov8n_detect/config").json()
    assert config["max_batch_size"] == 0
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert [i["dims"] for i in config["input"]] == [[1], [1, 3, 640, 640]]
    assert mc.ModelInput.Format.Value(config["input"][0]["format"]) == mc.ModelInput.FORMAT_NONE
    assert config["input"][0]["optional"] is True and config["output"][0]["label_filename"] == ""
    assert config["model_warmup"] == [] and config["parameters"] == {}
    # An ensemble, which has no instance: Triton lists no instance_group for it.
    assert config["platform"] == "ensemble" and config["instance_group"] == []
    assert [step["model_name"] for step in config["ensemble_scheduling"]["step"]] == ["yolov8_preprocess", "yolov8n", "yolov8_postprocess"]


def test_defaults_filled_in_where_the_config_is_silent():
    config = mc.ModelConfig(name="bare", max_batch_size=4)
    config.dynamic_batching.SetInParent()
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[2])
    written = cfg.config_json(config)
    assert written["version_policy"] == {"latest": {"num_versions": 1}}
    assert written["dynamic_batching"]["preferred_batch_size"] == [4]
    assert [(g["name"], g["count"], g["kind"], g["gpus"]) for g in written["instance_group"]] == [("bare", 1, "KIND_CPU", [])]
    assert written["input"][0]["dims"] == [2] and written["output"] == []
    # What the config says stays as it says it.
    config.version_policy.all.SetInParent()
    config.dynamic_batching.preferred_batch_size.append(2)
    config.instance_group.add(count=0)
    config.instance_group.add(name="second", count=3)
    written = cfg.config_json(config)
    assert written["version_policy"] == {"all": {}}
    assert written["dynamic_batching"]["preferred_batch_size"] == [2]
    assert [(g["name"], g["count"]) for g in written["instance_group"]] == [("bare_0", 1), ("second", 3)]
    assert not config.instance_group[0].name  # the served config itself is left as it is


#: instance_group of each model (a `sim` on device_ids "0,1") -> (kind, gpus) in its configuration, and the
#: devices its instances run on, in order (the model metadata's `device_ids`).
GROUPS = {
    # Triton's KIND_GPU: `count` on each of `gpus`, by default every GPU (here: every NPU of device_ids).
    "npus": ("{ kind: KIND_GPU count: 2 }", ("KIND_GPU", [0, 1]), "0,0,1,1"),
    "listed": ("{ kind: KIND_GPU count: 1 gpus: [ 1 ] }", ("KIND_GPU", [1]), "1"),
    # Placed by the server, round-robin over device_ids: no gpus, as Triton writes for these kinds.
    "placed": ("{ kind: KIND_MODEL count: 3 }", ("KIND_MODEL", []), "0,1,0"),
    "cpu": ("{ kind: KIND_CPU count: 2 }", ("KIND_CPU", []), "0,1"),
    # No kind (KIND_AUTO): resolved as Triton resolves it where it finds no GPU (every Ascend host), placed as KIND_MODEL.
    "unkind": ("{ count: 2 }", ("KIND_CPU", []), "0,1"),
    "unkind_listed": ("{ count: 1 gpus: [ 0, 1 ] }", ("KIND_GPU", [0, 1]), "0,1"),
}


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    for name, (group, _, _) in GROUPS.items():
        config = copy_model("sim", repository, name) / "config.pbtxt"
        text = config.read_text().replace("instance_group [ { kind: KIND_MODEL count: 1 } ]", f"instance_group [ {group} ]")
        config.write_text(text + 'parameters { key: "device_ids" value: { string_value: "0,1" } }\n')
    server = start_server(repository, tmp_path_factory.mktemp("logs") / "server.log")
    yield server
    stop_server(server)


@pytest.mark.parametrize("model", GROUPS)
def test_instance_groups_list_the_npus_they_run_on(placed, model):
    _, (kind, gpus), instances = GROUPS[model]
    rest = requests.get(f"{placed.url}/v2/models/{model}/config").json()
    with grpcclient.InferenceServerClient(placed.grpc) as client:
        grpc = client.get_model_config(model).config
    assert [(group["kind"], group["gpus"]) for group in rest["instance_group"]] == [(kind, gpus)]
    assert [(mc.ModelInstanceGroup.Kind.Name(group.kind), list(group.gpus)) for group in grpc.instance_group] == [(kind, gpus)]
    # What the configuration says is where the instances are.
    assert requests.get(f"{placed.url}/v2/models/{model}").json()["parameters"]["device_ids"] == instances

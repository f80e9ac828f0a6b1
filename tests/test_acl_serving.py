"""`.om` models served end to end by the real server, with the FAKE pyACL module on PYTHONPATH.

CANN cannot be installed here, so `tests/fake_acl/acl.py` (a recording fake, not Huawei's
module) stands in for the `acl` module; everything above it — repository, batching with
dynamic batch gears, the protocol edges — is the production path.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper

from conftest import fake_acl_env, load_fake_acl, start_server, stop_server

fake_acl = load_fake_acl()  # only to write .om descriptors; the servers import their own as `acl`
ENV = fake_acl_env()

#: One config.pbtxt, written for the ONNX model, served over the ONNX file and over its ATC `.om`.
IDENTITY_CONFIG = """name: "identity"
backend: "ascend"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
"""


def write_identity_onnx(path) -> None:
    """OUTPUT0 = INPUT0, OUTPUT1 = INPUT1: what the FAKE `.om` computes, as a real ONNX model."""
    def tensor(name, kind, width):
        return helper.make_tensor_value_info(name, kind, ["batch", width])

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"], name="identity_0"),
         helper.make_node("Identity", ["INPUT1"], ["OUTPUT1"], name="identity_1")],
        "identity",
        [tensor("INPUT0", TensorProto.FLOAT, 4), tensor("INPUT1", TensorProto.INT32, 3)],
        [tensor("OUTPUT0", TensorProto.FLOAT, 4), tensor("OUTPUT1", TensorProto.INT32, 3)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)


def write_model(repository, name: str, config: str):
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config)
    return repository / name / "1"


@pytest.fixture(scope="module")
def om_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("om_repo")
    detector = write_model(
        repository, "detector",
        'name: "detector"\nbackend: "ascend"\nmax_batch_size: 8\n'
        "dynamic_batching { max_queue_delay_microseconds: 20000 }\n"
        'parameters { key: "device_ids" value: { string_value: "1" } }\n',
    )
    fake_acl.fake_write_om(
        detector / "model.om", [("images", fake_acl.ACL_FLOAT, [-1, 3, 8, 8])], dynamic_batch=[1, 2, 4, 8]
    )
    identity = write_model(repository, "identity", IDENTITY_CONFIG)
    fake_acl.fake_write_om(
        identity / "model.om",
        [("INPUT0", fake_acl.ACL_FLOAT, [-1, 4]), ("INPUT1", fake_acl.ACL_INT32, [-1, 3])],
        outputs=[("OUTPUT0", fake_acl.ACL_FLOAT, [-1, 4]), ("OUTPUT1", fake_acl.ACL_INT32, [-1, 3])],
        dynamic_batch=[1, 2, 4, 8],
        atc_names=True,  # served as node_0:0:OUTPUT0, node_1:0:OUTPUT1
    )
    server = start_server(repository, repository.parent / "om.log", env=ENV)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def onnx_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("onnx_repo")
    write_identity_onnx(write_model(repository, "identity", IDENTITY_CONFIG) / "model.onnx")
    server = start_server(repository, repository.parent / "onnx.log")
    yield server
    stop_server(server)


#: Names too long for aclmdlIODims.name (char[128]): aclmdlGetInputDims/OutputDims rename them.
LONG_INPUT, LONG_OUTPUT = "images_" + "i" * 130, "detections_" + "o" * 130


@pytest.fixture(scope="module")
def variant_server(tmp_path_factory):
    """A pyACL without acl.util.ptr_to_numpy (documented as "will be deprecated"), serving an `.om`
    built with the Ascend Graph API whose outputs are not in the network's order, and one whose
    tensor names are longer than 127 characters."""
    repository = tmp_path_factory.mktemp("variant_repo")
    graph = write_model(repository, "graph", IDENTITY_CONFIG.replace('name: "identity"', 'name: "graph"'))
    fake_acl.fake_write_om(
        graph / "model.om",
        [("INPUT1", fake_acl.ACL_INT32, [-1, 3]), ("INPUT0", fake_acl.ACL_FLOAT, [-1, 4])],
        outputs=[("OUTPUT1", fake_acl.ACL_INT32, [-1, 3]), ("OUTPUT0", fake_acl.ACL_FLOAT, [-1, 4])],
        dynamic_batch=[1, 2, 4, 8],
        graph_names=[1, 0],  # served as output_1_node_1_0, output_0_node_0_0
    )
    long = write_model(
        repository, "long",
        f'name: "long"\nbackend: "ascend"\nmax_batch_size: 4\n'
        f'input [ {{ name: "{LONG_INPUT}" data_type: TYPE_FP32 dims: [ 2 ] }} ]\n'
        f'output [ {{ name: "{LONG_OUTPUT}" data_type: TYPE_FP32 dims: [ 2 ] }} ]\n',
    )
    fake_acl.fake_write_om(
        long / "model.om", [(LONG_INPUT, fake_acl.ACL_FLOAT, [-1, 2])],
        outputs=[(LONG_OUTPUT, fake_acl.ACL_FLOAT, [-1, 2])], dynamic_batch=[1, 2, 4], atc_names=True,
    )
    env = {**ENV, "FAKE_ACL_WITHOUT": "acl.util.ptr_to_numpy"}
    server = start_server(repository, repository.parent / "variant.log", env=env)
    yield server
    stop_server(server)


def metadata(server, model: str) -> dict:
    with grpcclient.InferenceServerClient(server.grpc) as client:
        return client.get_model_metadata(model, as_json=True)


def infer(server, model: str, inputs: dict[str, np.ndarray], outputs=None) -> dict[str, np.ndarray]:
    with grpcclient.InferenceServerClient(server.grpc) as client:
        tensors = []
        for name, data in inputs.items():
            tensor = grpcclient.InferInput(name, list(data.shape), "FP32" if data.dtype == np.float32 else "INT32")
            tensor.set_data_from_numpy(data)
            tensors.append(tensor)
        wanted = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
        result = client.infer(model, tensors, outputs=wanted)
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def test_om_model_metadata_is_auto_completed_from_the_model_description(om_server):
    with grpcclient.InferenceServerClient(om_server.grpc) as client:
        metadata = client.get_model_metadata("detector", as_json=True)
        config = client.get_model_config("detector").config
    assert metadata["inputs"] == [{"name": "images", "datatype": "FP32", "shape": ["-1", "3", "8", "8"]}]
    assert metadata["outputs"][0]["name"] == "images_out"
    assert config.max_batch_size == 8


def test_one_config_serves_the_onnx_model_and_its_atc_om_alike(om_server, onnx_server):
    om_metadata, onnx_metadata = (metadata(server, "identity") for server in (om_server, onnx_server))
    assert om_metadata["inputs"] == onnx_metadata["inputs"]
    assert om_metadata["outputs"] == onnx_metadata["outputs"]
    assert [o["name"] for o in om_metadata["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    rng = np.random.default_rng(7)
    for rows in (1, 3, 8):  # 3: padded by the core to the .om's gear 4
        sent = {
            "INPUT0": rng.random((rows, 4), dtype=np.float32),
            "INPUT1": rng.integers(-9, 9, (rows, 3), dtype=np.int32),
        }
        from_om, from_onnx = infer(om_server, "identity", sent), infer(onnx_server, "identity", sent)
        assert sorted(from_om) == sorted(from_onnx) == ["OUTPUT0", "OUTPUT1"]
        for name, source in (("OUTPUT0", "INPUT0"), ("OUTPUT1", "INPUT1")):
            np.testing.assert_array_equal(from_om[name], sent[source])
            np.testing.assert_array_equal(from_om[name], from_onnx[name])
    only = infer(om_server, "identity", sent, outputs=["OUTPUT1"])
    assert list(only) == ["OUTPUT1"]


# Batches that are not a gear of the `.om`: the core's Instance pads them to the next gear.


def test_om_model_round_trips_concurrent_mixed_batches_through_the_gears(om_server):
    def call(rows):
        data = np.random.default_rng(rows).random((rows, 3, 8, 8), dtype=np.float32)
        return data, infer(om_server, "detector", {"images": data})["images_out"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, [1, 3, 2, 1, 5, 1, 2, 3]))
    for sent, received in results:
        np.testing.assert_array_equal(received, sent)


# A pyACL without ptr_to_numpy: the runtime stages through ctypes views of its pinned buffers.


def test_graph_api_outputs_are_served_by_the_network_index_in_their_names(variant_server):
    assert [o["name"] for o in metadata(variant_server, "graph")["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    rng = np.random.default_rng(3)
    for rows in (1, 3, 8):
        sent = {"INPUT0": rng.random((rows, 4), dtype=np.float32), "INPUT1": rng.integers(-9, 9, (rows, 3), dtype=np.int32)}
        got = infer(variant_server, "graph", sent)
        np.testing.assert_array_equal(got["OUTPUT0"], sent["INPUT0"])
        np.testing.assert_array_equal(got["OUTPUT1"], sent["INPUT1"])


def test_tensor_names_over_127_characters_are_served_whole(variant_server):
    described = metadata(variant_server, "long")
    assert [t["name"] for t in described["inputs"]] == [LONG_INPUT]
    assert [t["name"] for t in described["outputs"]] == [LONG_OUTPUT]
    sent = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.testing.assert_array_equal(infer(variant_server, "long", {LONG_INPUT: sent})[LONG_OUTPUT], sent)

"""The `ascend` backend as Triton drives it: `reshape` tensors and the order of outputs, beside the KServe server."""

from __future__ import annotations

import grpc as grpclib
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from conftest import both_servers, copy_model

#: Triton hands the backend INPUT0 as [batch, 2, 2] and INPUT1 as [batch], and takes the outputs back so.
RESHAPED = """name: "reshaped"
backend: "ascend"
max_batch_size: 4
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } }
]
"""
#: Six outputs: a set of their names comes out in the config's order once in 720 hash seeds.
SIX = [f"OUTPUT{i}" for i in range(6)]


def reshaped_model() -> onnx.ModelProto:
    """OUTPUT0 = 2 * INPUT0 on [batch, 2, 2]; OUTPUT1 = INPUT1 on [batch]."""
    def tensor(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", *shape])

    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT0"], ["OUTPUT0"]), helper.make_node("Identity", ["INPUT1"], ["OUTPUT1"])],
        "reshaped",
        [tensor("INPUT0", [2, 2]), tensor("INPUT1", [])],
        [tensor("OUTPUT0", [2, 2]), tensor("OUTPUT1", [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repository = tmp_path_factory.mktemp("backend_models")
    copy_model("simple", repository)
    (repository / "reshaped" / "1").mkdir(parents=True)
    onnx.save(reshaped_model(), repository / "reshaped" / "1" / "model.onnx")
    (repository / "reshaped" / "config.pbtxt").write_text(RESHAPED)
    (repository / "six" / "1").mkdir(parents=True)
    (repository / "six" / "1" / "model.sim").write_bytes(b"")
    (repository / "six" / "config.pbtxt").write_text(
        'name: "six"\nbackend: "ascend"\nmax_batch_size: 4\n'
        'parameters { key: "runtime" value: { string_value: "sim" } }\n'
        + "".join(f'input {{ name: "INPUT{i}" data_type: TYPE_INT32 dims: [ 1 ] }}\n' for i in range(6))
        + "".join(f'output {{ name: "OUTPUT{i}" data_type: TYPE_INT32 dims: [ 1 ] }}\n' for i in range(6))
    )
    yield from both_servers(repository, tmp_path_factory)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_reshaped_tensors_are_served_as_the_config_declares_them(servers, protocol):
    module = httpclient if protocol == "http" else grpcclient
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    scalars = np.array([[1.5], [-2.0], [7.0]], np.float32)
    for name, target in servers.items():
        with module.InferenceServerClient(target.http if protocol == "http" else target.grpc) as client:
            tensors = [module.InferInput("INPUT0", [3, 4], "FP32"), module.InferInput("INPUT1", [3, 1], "FP32")]
            tensors[0].set_data_from_numpy(values)
            tensors[1].set_data_from_numpy(scalars)
            result = client.infer("reshaped", tensors)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values * 2)  # [3, 4], the config's dims
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), scalars)  # [3, 1]


def output_names(target, protocol: str, requested: list[str] | None) -> list[str]:
    module = httpclient if protocol == "http" else grpcclient
    with module.InferenceServerClient(target.http if protocol == "http" else target.grpc) as client:
        tensors = []
        for i in range(6):
            tensors.append(module.InferInput(f"INPUT{i}", [1, 1], "INT32"))
            tensors[-1].set_data_from_numpy(np.array([[i]], np.int32))
        outputs = None if requested is None else [module.InferRequestedOutput(n) for n in requested]
        result = client.infer("six", tensors, outputs=outputs)
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if protocol == "http" else [o.name for o in response.outputs]
        assert all(result.as_numpy(n).item() == int(n[-1]) for n in names)
        return names


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_outputs_come_in_the_configs_order(servers, protocol):
    for target in servers.values():
        assert output_names(target, protocol, None) == SIX
        assert output_names(target, protocol, SIX) == SIX
    # Asked in another order: the KServe server keeps it; inside Triton the backend is only told a set of names.
    assert output_names(servers["kserve-ascend"], protocol, ["OUTPUT4", "OUTPUT1"]) == ["OUTPUT4", "OUTPUT1"]
    assert output_names(servers["triton"], protocol, ["OUTPUT4", "OUTPUT1"]) == ["OUTPUT1", "OUTPUT4"]


def test_explicit_int_contents_read_by_position(servers):
    """What Triton's grpc_explicit_int_content_client.py does: typed int contents in, outputs read by position."""
    for target in servers.values():
        with grpclib.insecure_channel(target.grpc) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = pb.ModelInferRequest(model_name="simple")
            request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16]).contents.int_contents[:] = range(16)
            request.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16]).contents.int_contents[:] = [1] * 16
            request.outputs.add(name="OUTPUT0")
            request.outputs.add(name="OUTPUT1")
            response = stub.ModelInfer(request)
            by_position = [np.frombuffer(raw, np.int32) for raw in response.raw_output_contents]
            np.testing.assert_array_equal(by_position[0], np.arange(16) + 1)
            np.testing.assert_array_equal(by_position[1], np.arange(16) - 1)
            # Raw contents beside typed ones: refused in Triton's words, which the example looks for.
            request.raw_input_contents.append(np.arange(8, dtype=np.int32).tobytes())
            with pytest.raises(grpclib.RpcError) as error:
                stub.ModelInfer(request)
            assert error.value.code() == grpclib.StatusCode.INVALID_ARGUMENT
            assert "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'" in error.value.details()

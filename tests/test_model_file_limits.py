"""What the model file fixes, met at the runtime boundary: its batch sizes and its float precision.

One rule for every runtime, in the core's `Instance` (shared by both servers): a batch runs at
the smallest batch size the file takes, padded with zero rows, or as several executions when it
is larger than the largest; FP16 tensors of a file under an FP32 config are converted. Checked
in-process on the core with a recording runtime, then through the real KServe server (ONNX,
and `.om` files on the FAKE pyACL module) and real Triton (ONNX).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
import requests
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc
from google.protobuf import text_format

from conftest import fake_acl_env, infer, load_fake_acl, start_server, start_triton, statistics, stop_server
from kserve_ascend.core.errors import ModelLoadError
from kserve_ascend.core.execution.instance import Instance
from kserve_ascend.core.execution.runtimes import Runtime, TensorSpec
from kserve_ascend.core.signature import Signature

ACL_FLOAT, ACL_FLOAT16 = 0, 1


# ---- the core, in-process ----------------------------------------------------------------------


class FileRuntime(Runtime):
    """A model file of fixed batch sizes and datatypes: output `y` is input `x` times 2, in the file's
    output type. Records every batch it is handed and refuses sizes the file does not take."""

    name = "recording"

    def __init__(self, batch_sizes=(), x="FP32", y="FP32", first=-1):
        super().__init__(Path("model.file"), 0, mc.ModelConfig())
        self._sizes, self._x, self._y, self._first = tuple(batch_sizes), x, y, first
        self.batches: list[np.ndarray] = []

    inputs = property(lambda self: [TensorSpec("x", self._x, (self._first, 2))])
    outputs = property(lambda self: [TensorSpec("y", self._y, (self._first, 2))])
    batch_sizes = property(lambda self: self._sizes)

    def run(self, inputs, output_names):
        x = inputs["x"]
        assert not self._sizes or len(x) in self._sizes, f"handed a batch of {len(x)}"
        self.batches.append(x.copy())
        return {"y": (x * 2).astype({"FP16": np.float16, "FP32": np.float32}[self._y])}


def signature(max_batch_size: int, datatype: str = "TYPE_FP32") -> Signature:
    return Signature(text_format.Parse(
        f'max_batch_size: {max_batch_size} input {{ name: "x" data_type: {datatype} dims: [2] }}'
        f' output {{ name: "y" data_type: {datatype} dims: [2] }}',
        mc.ModelConfig(),
    ))


def requests_of(*rows: int) -> list[dict[str, np.ndarray]]:
    start, batch = 1, []
    for count in rows:
        batch.append({"x": np.arange(start, start + 2 * count, dtype=np.float32).reshape(count, 2)})
        start += 2 * count
    return batch


def check_answers(instance: Instance, batch: list[dict]) -> None:
    for request, answer in zip(batch, instance.run_batch(batch), strict=True):
        assert answer["y"].dtype == np.float32
        np.testing.assert_array_equal(answer["y"], request["x"] * 2)


def test_a_batch_runs_at_the_smallest_gear_that_holds_it_padded_with_zero_rows():
    runtime = FileRuntime(batch_sizes=(1, 2, 4, 8))
    instance = Instance(runtime, signature(8))
    check_answers(instance, requests_of(1, 2))
    check_answers(instance, requests_of(2))
    assert [len(b) for b in runtime.batches] == [4, 2]
    assert not runtime.batches[0][3:].any()  # the padding row is zeros
    assert instance.padding_rows == 1
    assert instance.parameters["batch_sizes"] == "1,2,4,8" and "batch_split" not in instance.parameters


@pytest.mark.parametrize(("size", "rows", "executions", "padding"), [(1, [3, 1, 4], [1] * 8, 0), (4, [3, 3], [4, 4], 2)])
def test_a_batch_above_a_static_batch_runs_as_several_executions(size, rows, executions, padding):
    runtime = FileRuntime(batch_sizes=(size,))
    instance = Instance(runtime, signature(8))
    check_answers(instance, requests_of(*rows))
    assert [len(b) for b in runtime.batches] == executions
    assert instance.padding_rows == padding
    assert instance.parameters["batch_split"] == f"batches of up to 8 rows run as executions of {size}"


class StringFileRuntime(FileRuntime):
    """A file of static batch 4 that parses its text, as a Cast string->int32 does: "" fails the batch."""

    inputs = property(lambda self: [TensorSpec("x", "BYTES", (4, 2))])
    outputs = property(lambda self: [TensorSpec("y", "BYTES", (4, 2))])

    def run(self, inputs, output_names):
        self.batches.append(inputs["x"].copy())
        return {"y": np.vectorize(lambda text: str(int(text) * 2).encode(), otypes=[object])(inputs["x"])}


def test_string_batches_are_padded_with_a_real_row_not_empty_strings():
    runtime = StringFileRuntime(batch_sizes=(4,))
    instance = Instance(runtime, signature(8, "TYPE_STRING"))
    rows = np.array([[b"1", b"2"], [b"3", b"4"]], dtype=object)
    (answer,) = instance.run_batch([{"x": rows}])
    assert answer["y"].tolist() == [[b"2", b"4"], [b"6", b"8"]]
    assert runtime.batches[0][2:].tolist() == [[b"3", b"4"]] * 2


def test_a_file_that_takes_any_batch_gets_the_batch_as_it_is():
    runtime = FileRuntime()
    instance = Instance(runtime, signature(8))
    check_answers(instance, requests_of(3, 2))
    assert [len(b) for b in runtime.batches] == [5] and instance.padding_rows == 0
    assert instance.parameters == {}


def test_max_batch_size_above_the_largest_gear_is_a_load_error_naming_the_gears():
    with pytest.raises(ModelLoadError, match=r"max_batch_size 16 is above the largest batch gear of model.file \(gears 1,2,4,8\)"):
        Instance(FileRuntime(batch_sizes=(1, 2, 4, 8)), signature(16))


def test_batching_a_file_that_does_not_batch_is_a_load_error_with_both_numbers():
    with pytest.raises(ModelLoadError, match=r"max_batch_size 8 .* model.file does not batch: 'x' has first dimension 3"):
        Instance(FileRuntime(first=3), signature(8))


def test_fp16_tensors_of_the_file_are_converted_at_the_boundary():
    runtime = FileRuntime(batch_sizes=(1, 2), x="FP16", y="FP16")
    instance = Instance(runtime, signature(2))
    check_answers(instance, requests_of(1))
    assert runtime.batches[0].dtype == np.float16
    assert instance.parameters["converted"] == "x:FP32->FP16,y:FP16->FP32"


def test_a_mismatch_other_than_float_precision_is_a_load_error_naming_both_types():
    with pytest.raises(ModelLoadError, match="'x' is INT32 in config.pbtxt but FP16 in the model file"):
        Instance(FileRuntime(x="FP16", y="FP16"), signature(2, "TYPE_INT32"))


# ---- model files made by the tests ---------------------------------------------------------------


def onnx_simple(path: Path, batch: int | str) -> None:
    """Triton's `simple` (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, INT32 [16]) with a
    first dimension of `batch`: a number is a file exported with a fixed batch."""
    tensor = lambda name: helper.make_tensor_value_info(name, TensorProto.INT32, [batch, 16])  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]), helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "simple", [tensor("INPUT0"), tensor("INPUT1")], [tensor("OUTPUT0"), tensor("OUTPUT1")],
    )
    save(graph, path)


def onnx_fp16_doubler(path: Path) -> None:
    """y = x * 2 in FP16 throughout, as a model converted to half precision is."""
    tensor = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT16, ["batch", 4])  # noqa: E731
    two = helper.make_tensor("two", TensorProto.FLOAT16, [], [2.0])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "fp16", [tensor("x")], [tensor("y")], [two])
    save(graph, path)


def save(graph, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)


SIMPLE_CONFIG = """name: "{name}"
backend: "ascend"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }}, {{ name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }}, {{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
"""
FP16_CONFIG = """name: "{name}"
backend: "ascend"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def onnx_repository(root: Path) -> Path:
    """`simple_b1` and `simple_b4`: simple exported with a fixed batch of 1 and of 4 under max_batch_size 8;
    `half`: an FP16 model under an FP32 config."""
    for batch in (1, 4):
        onnx_simple(root / f"simple_b{batch}" / "1" / "model.onnx", batch)
        (root / f"simple_b{batch}" / "config.pbtxt").write_text(SIMPLE_CONFIG.format(name=f"simple_b{batch}"))
    onnx_fp16_doubler(root / "half" / "1" / "model.onnx")
    (root / "half" / "config.pbtxt").write_text(FP16_CONFIG.replace("{name}", "half"))
    return root


OM_CONFIG = 'name: "{name}"\nbackend: "ascend"\nmax_batch_size: {max_batch_size}\ndynamic_batching {{ max_queue_delay_microseconds: 20000 }}\n'


@pytest.fixture(scope="module")
def kserve(tmp_path_factory):
    """The KServe server with the FAKE pyACL module: the ONNX models, and `.om` files of
    static batch 1, of gears 1,2,4,8, with an FP16 output, and gears under a too large max_batch_size."""
    fake_acl = load_fake_acl()
    root = onnx_repository(tmp_path_factory.mktemp("limits_repo"))
    oms = {
        # ATC --input_shape=images:1,3,8,8: a static batch of 1, as ATC converts by default.
        "om_b1": ([("images", ACL_FLOAT, [1, 3, 8, 8])], None, None, 8),
        "om_gears": ([("images", ACL_FLOAT, [-1, 3, 8, 8])], None, [1, 2, 4, 8], 8),
        # ATC --output_type FP16: the output is FP16 where the ONNX model (and the config) say FP32.
        "om_fp16_out": ([("images", ACL_FLOAT, [-1, 4])], [("scores", ACL_FLOAT16, [-1, 4])], [1, 2, 4], 4),
        "om_gears_too_small": ([("images", ACL_FLOAT, [-1, 4])], None, [1, 2, 4], 8),
    }
    for name, (inputs, outputs, gears, max_batch_size) in oms.items():
        (root / name / "1").mkdir(parents=True)
        fake_acl.fake_write_om(root / name / "1" / "model.om", inputs, outputs, dynamic_batch=gears)
        config = OM_CONFIG.format(name=name, max_batch_size=max_batch_size)
        if outputs:  # the config written for the ONNX model, FP32
            config += 'input [ { name: "images" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            config += 'output [ { name: "scores" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        (root / name / "config.pbtxt").write_text(config)
    env = fake_acl_env()
    server = start_server(root, root.parent / "limits.log", env=env, wait="loaded")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    root = onnx_repository(tmp_path_factory.mktemp("limits_triton_repo"))
    server = start_triton(root, tmp_path_factory.mktemp("limits_triton"))
    yield server
    stop_server(server)


def burst(server, model: str, make_inputs, check, calls: int = 32) -> None:
    """`calls` concurrent requests; every one must be answered correctly."""
    def call(index):
        inputs = make_inputs(np.random.default_rng(index))
        check(inputs, infer(server, model, inputs, "grpc"))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(call, range(calls)))


def simple_inputs(rng):
    rows = int(rng.integers(1, 3))
    return {name: rng.integers(-1000, 1000, (rows, 16), dtype=np.int32) for name in ("INPUT0", "INPUT1")}


def simple_answers(inputs, outputs):
    np.testing.assert_array_equal(outputs["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])
    np.testing.assert_array_equal(outputs["OUTPUT1"], inputs["INPUT0"] - inputs["INPUT1"])


def metadata(server, model: str) -> dict:
    return requests.get(f"{server.url}/v2/models/{model}", timeout=10).json()


# ---- the KServe server -------------------------------------------------------------------------


def test_static_batch_1_om_under_max_batch_size_8_answers_a_concurrent_burst(kserve):
    def images(rng):
        return {"images": rng.random((int(rng.integers(1, 4)), 3, 8, 8), dtype=np.float32)}

    burst(kserve, "om_b1", images, lambda sent, got: np.testing.assert_array_equal(got["images_out"], sent["images"]))
    parameters = metadata(kserve, "om_b1")["parameters"]
    assert parameters["batch_sizes"] == "1"
    assert parameters["batch_split"] == "batches of up to 8 rows run as executions of 1"
    served = statistics(kserve, "om_b1")
    assert served["execution_count"] < served["inference_count"]  # batches formed, then split


def test_onnx_exported_with_batch_1_under_max_batch_size_8_answers_a_concurrent_burst(kserve):
    burst(kserve, "simple_b1", simple_inputs, simple_answers)
    assert metadata(kserve, "simple_b1")["parameters"]["batch_split"] == "batches of up to 8 rows run as executions of 1"


def test_padding_rows_of_a_gear_om_are_counted_in_statistics_and_metrics(kserve):
    images = np.random.default_rng(3).random((3, 3, 8, 8), dtype=np.float32)
    np.testing.assert_array_equal(infer(kserve, "om_gears", {"images": images}, "grpc")["images_out"], images)
    assert statistics(kserve, "om_gears")["batch_padding_rows"] == 1  # 3 rows ran at gear 4
    metrics = requests.get(f"{kserve.url}/metrics", timeout=10).text
    assert 'ascend_batch_padding_rows{model="om_gears",version="1"} 1.0' in metrics
    with grpcclient.InferenceServerClient(kserve.grpc) as client:  # Triton's message has no such field: left out
        assert client.get_inference_statistics("om_gears").model_stats[0].inference_count == 3


def test_max_batch_size_above_the_largest_gear_fails_the_load_naming_the_gears(kserve):
    answer = requests.get(f"{kserve.url}/v2/models/om_gears_too_small/ready", timeout=10)
    assert answer.status_code == 400
    assert "max_batch_size 8 is above the largest batch gear of model.om (gears 1,2,4)" in answer.json()["error"]


def test_fp16_onnx_under_an_fp32_config_converts_at_the_boundary(kserve):
    x = np.random.default_rng(5).random((3, 4), dtype=np.float32)
    y = infer(kserve, "half", {"x": x}, "grpc")["y"]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x * 2, rtol=1e-3)
    assert metadata(kserve, "half")["parameters"]["converted"] == "x:FP32->FP16,y:FP16->FP32"
    assert metadata(kserve, "half")["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]


def test_om_with_fp16_output_under_the_onnx_config_converts_the_output(kserve):
    images = np.random.default_rng(7).random((2, 4), dtype=np.float32)
    scores = infer(kserve, "om_fp16_out", {"images": images}, "grpc")["scores"]
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, images.astype(np.float16).astype(np.float32))
    assert metadata(kserve, "om_fp16_out")["parameters"]["converted"] == "scores:FP16->FP32"


# ---- real Triton -------------------------------------------------------------------------------


def test_triton_serves_onnx_exported_with_batch_1_under_max_batch_size_8(triton):
    burst(triton, "simple_b1", simple_inputs, simple_answers)


@pytest.mark.parametrize("target", ["kserve", "triton"])
def test_both_servers_pad_one_row_to_a_static_batch_of_4_and_count_the_padding(target, request):
    server = request.getfixturevalue(target)
    inputs = {name: array[:1] for name, array in simple_inputs(np.random.default_rng(1)).items()}
    simple_answers(inputs, infer(server, "simple_b4", inputs, "grpc"))
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    assert 'ascend_batch_padding_rows{model="simple_b4",version="1"} 3' in metrics


def test_triton_serves_an_fp16_onnx_under_an_fp32_config(triton):
    x = np.random.default_rng(5).random((3, 4), dtype=np.float32)
    y = infer(triton, "half", {"x": x}, "grpc")["y"]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x * 2, rtol=1e-3)

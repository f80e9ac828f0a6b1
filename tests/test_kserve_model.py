"""Each repository model is a `kserve.Model` whose predict serves KServe's own InferRequest."""

import asyncio

import numpy as np

from conftest import REPOSITORY
from kserve_ascend.core.models.model import Model
from kserve_ascend.server.edges.kserve_model import AscendModel
from kserve.protocol.infer_type import InferInput, InferRequest


def test_predict_with_kserve_infer_request():
    model = AscendModel(Model("simple", REPOSITORY / "simple"))
    assert model.load() and model.ready
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = InferInput(name, [2, 16], "INT32")
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    response = asyncio.run(model.predict(InferRequest("simple", inputs, request_id="k1")))
    outputs = {o.name: o.as_numpy() for o in response.outputs}
    np.testing.assert_array_equal(outputs["OUTPUT0"], 2 * a)
    assert response.id == "k1" and response.model_version == "1"
    model.stop()
    assert not model.ready

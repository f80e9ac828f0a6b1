"""KServe's `Model` and model registry over the data plane: what KServe's own routes and tooling see of the repository."""

import asyncio

import numpy as np
from prometheus_client import CollectorRegistry

from conftest import copy_model
from kserve_ascend.core.models.repository import Repository
from kserve_ascend.server.dataplane.local import LocalDataPlane
from kserve_ascend.server.edges.kserve_model import ModelRegistry
from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput  # after kserve_ascend.server: see its seam

A = np.arange(32, dtype=np.int32).reshape(2, 16)
COMPUTE = ("compute_input", "compute_infer", "compute_output")


def kserve_request(**kwargs) -> InferRequest:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = InferInput(name, [2, 16], "INT32")
        tensor.set_data_from_numpy(A)
        inputs.append(tensor)
    return InferRequest("simple", inputs, request_id="k1", **kwargs)


def test_predict_goes_through_the_data_plane(tmp_path):
    """`AscendModel.predict` with KServe's own InferRequest answers as the OIP routes do: the outputs asked for, the
    request counted once with its answer's making; the registry lists the repository's models and their readiness."""
    copy_model("simple", tmp_path)

    async def scenario():
        repository = Repository(tmp_path)
        dataplane = LocalDataPlane(repository, False, CollectorRegistry())
        registry = ModelRegistry(dataplane)
        model = registry.get_model("simple")
        try:
            readiness = [await registry.is_model_ready("simple")]
            await repository.load("simple")
            readiness.append(await registry.is_model_ready("simple"))
            everything = await model.predict(kserve_request())
            one = await model.predict(kserve_request(request_outputs=[RequestedOutput("OUTPUT1")]))
            stats = (await dataplane.statistics("simple"))["model_stats"][0]["inference_stats"]
        finally:
            repository.models["simple"].close()
        return registry, readiness, everything, one, stats

    registry, readiness, everything, one, stats = asyncio.run(scenario())
    assert list(registry.get_models()) == ["simple"] and registry.get_model("absent") is None
    assert readiness == [False, True]
    outputs = {o.name: o.as_numpy() for o in everything.outputs}
    np.testing.assert_array_equal(outputs["OUTPUT0"], 2 * A)
    np.testing.assert_array_equal(outputs["OUTPUT1"], 0 * A)
    assert everything.id == "k1" and everything.model_version == "1"
    assert [output.name for output in one.outputs] == ["OUTPUT1"]  # the outputs asked for, as over OIP
    assert all(stats[field]["count"] == 2 for field in ("success", *COMPUTE))

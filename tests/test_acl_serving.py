"""An `.om` model served end to end by the real server, with the FAKE pyACL module on PYTHONPATH.

CANN cannot be installed here, so `tests/fake_acl/acl.py` (a recording fake, not Huawei's
module) stands in for the `acl` module; everything above it — repository, batching with
dynamic batch gears, the protocol edges — is the production path.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import FAKE_ACL, load_fake_acl, start_server, stop_server

ACL_FLOAT = 0


@pytest.fixture(scope="module")
def om_server(tmp_path_factory):
    # The FAKE module, loaded here only to write its .om descriptor; the server imports it as `acl`.
    fake_acl = load_fake_acl()
    repository = tmp_path_factory.mktemp("om_repo")
    model = repository / "detector"
    (model / "1").mkdir(parents=True)
    fake_acl.fake_write_om(model / "1" / "model.om", [("images", ACL_FLOAT, [-1, 3, 8, 8])], dynamic_batch=[1, 2, 4, 8])
    (model / "config.pbtxt").write_text(
        'name: "detector"\nbackend: "ascend"\nmax_batch_size: 8\n'
        "dynamic_batching { max_queue_delay_microseconds: 20000 }\n"
        'parameters { key: "device_ids" value: { string_value: "1" } }\n'
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_ACL), os.environ.get("PYTHONPATH")]))}
    server = start_server(repository, repository.parent / "om.log", env=env)
    yield server
    stop_server(server)


def test_om_model_metadata_is_auto_completed_from_the_model_description(om_server):
    with grpcclient.InferenceServerClient(om_server.grpc) as client:
        metadata = client.get_model_metadata("detector", as_json=True)
        config = client.get_model_config("detector").config
    assert metadata["inputs"] == [{"name": "images", "datatype": "FP32", "shape": ["-1", "3", "8", "8"]}]
    assert metadata["outputs"][0]["name"] == "images_out"
    assert config.max_batch_size == 8


def test_om_model_round_trips_concurrent_mixed_batches_through_the_gears(om_server):
    def call(rows):
        data = np.random.default_rng(rows).random((rows, 3, 8, 8), dtype=np.float32)
        with grpcclient.InferenceServerClient(om_server.grpc) as client:
            tensor = grpcclient.InferInput("images", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            return data, client.infer("detector", [tensor]).as_numpy("images_out")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, [1, 3, 2, 1, 5, 1, 2, 3]))
    for sent, received in results:
        np.testing.assert_array_equal(received, sent)

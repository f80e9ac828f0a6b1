"""Many clients at once, mixed batch sizes: every response carries its own request's results."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


@pytest.mark.spec("OIP v2 required_api.md §Inference (a response answers its own request)")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_concurrent_clients_get_their_own_results(target, protocol):
    module, address = (httpclient, target.http) if protocol == "http" else (grpcclient, target.grpc)
    rows = [1, 3, 2, 1, 4, 2, 1, 3] * 4

    def call(index):
        data = np.arange(rows[index] * 5, dtype=np.int32).reshape(rows[index], 5) + 1000 * index
        with module.InferenceServerClient(address) as client:
            tensor = module.InferInput("INPUT0", list(data.shape), "INT32")
            tensor.set_data_from_numpy(data)
            result = client.infer("identity_int32", [tensor], request_id=str(index))
            return index, data, result

    with ThreadPoolExecutor(16) as pool:
        for index, data, result in pool.map(call, range(len(rows))):
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)

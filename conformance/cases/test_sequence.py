"""sequence: Triton's sequence extension, the "sequence_id", "sequence_start" and "sequence_end"
request parameters (extension_sequence.md), on conformance/models/sequence_accumulator, which
answers the running sum of its sequence's INPUT values (implicit state kept by the server).
"""

import itertools
import os

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

MODEL = "sequence_accumulator"
#: Ids no other run against the same server uses (two runs may share one server).
_ids = itertools.count(os.getpid() * 1000 + 1)


def _http(url: str, value: int, **parameters) -> tuple[int, dict]:
    """The answer's status and JSON body."""
    body = {"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}], "parameters": parameters}
    with requests.post(f"{url}/v2/models/{MODEL}/infer", json=body) as response:
        return response.status_code, response.json()


def _grpc(client, value: int, **options) -> int:
    tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return int(client.infer(MODEL, [tensor], **options).as_numpy("OUTPUT")[0, 0])


@pytest.mark.spec("Triton extension_sequence.md: sequence_id, sequence_start, sequence_end over HTTP")
@pytest.mark.parametrize("kind", ["numeric_id", "string_id"])
def test_interleaved_sequences_over_http(url, kind, requires):
    requires("sequence")
    ids = [next(_ids), next(_ids)]
    if kind == "string_id":
        ids = [f"conformance-{i}" for i in ids]
    values = {ids[0]: [4, 2, 1], ids[1]: [10, 20, 30]}
    sums = {i: 0 for i in ids}
    for step in range(3):
        for sequence_id in ids:  # the two sequences' requests alternate
            value = values[sequence_id][step]
            status, answer = _http(url, value, sequence_id=sequence_id, sequence_start=step == 0, sequence_end=step == 2)
            assert status == 200, answer
            sums[sequence_id] += value
            assert answer["outputs"][0]["data"] == [sums[sequence_id]]


@pytest.mark.spec("Triton extension_sequence.md: the same parameters over gRPC (tritonclient's sequence_id=...)")
def test_sequence_over_grpc(grpc, requires):
    requires("sequence")
    sequence_id = next(_ids)
    answers = [
        _grpc(grpc, 5, sequence_id=sequence_id, sequence_start=True),
        _grpc(grpc, 6, sequence_id=sequence_id),
        _grpc(grpc, 7, sequence_id=sequence_id, sequence_end=True),
    ]
    assert answers == [5, 11, 18]
    # Ended: the same id starts afresh.
    assert _grpc(grpc, 1, sequence_id=sequence_id, sequence_start=True, sequence_end=True) == 1


#: Requests a sequence model refuses, as client mistakes.
REFUSED = {
    "no_sequence_id": {},
    "continues_an_unknown_sequence": {"sequence_id": -1, "sequence_start": False},
    "sequence_start_not_a_bool": {"sequence_id": -2, "sequence_start": "yes"},
}


@pytest.mark.spec("Triton extension_sequence.md; OIP: a client error is 4xx with an error object")
@pytest.mark.parametrize("case", list(REFUSED))
def test_sequence_mistakes_are_4xx(url, case, requires):
    requires("sequence")
    parameters = dict(REFUSED[case])
    if parameters.get("sequence_id", 0) < 0:
        parameters["sequence_id"] = next(_ids)
    status, answer = _http(url, 1, **parameters)
    assert 400 <= status < 500, f"{status}: {answer}"
    assert list(answer) == ["error"]

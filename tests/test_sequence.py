"""Sequence batching as Triton defines it, on the KServe server and on real Triton 2.51 with the
`ascend` backend serving the same repository (model_repository/'s sequence models and variants).

What Triton's sequence client examples do (interleaved sequences with numeric and string ids,
sync HTTP and gRPC, gRPC streaming, start/end flags), implicit state (running sums), the
backlog, idle release, Triton's refusals with its codes and words, and the load-time refusal
of what is not built. In-process: Triton's config checks, the direct strategy's null
requests, the backend's state store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from conftest import REPOSITORY, ROOT, copy_model, start_server, start_triton, stop_server
from kserve_ascend.core.scheduling import sequences as sequence
from kserve_ascend.core.errors import InvalidInput, ModelLoadError
from kserve_ascend.core.scheduling.sequencer import SequenceScheduler
from kserve_ascend.core.contracts import Request, RequestOptions
from kserve_ascend.core.stats import RequestTiming, VersionStats

sys.path.insert(0, str(ROOT / "tools"))

from make_sequence_models import BUILDERS  # noqa: E402

#: The values of Triton's sequence examples; each sequence starts with one more value of its own.
VALUES = [11, 7, 5, 3, 2, 0, 1]

#: model_repository's sequence models with other settings: (source, config text replaced -> by).
VARIANTS = {
    "accumulator_idle": ("sequence_accumulator", {"max_sequence_idle_microseconds: 5000000": "max_sequence_idle_microseconds: 200000"}),
    "accumulator_one_slot": ("sequence_accumulator", {"max_batch_size: 8": "max_batch_size: 1"}),
    "accumulator_oldest": (
        "sequence_accumulator",
        {"direct { }": "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 2000 }", "count: 1": "count: 2"},
    ),
}
STRING_CORRID = "simple_string_dyna_sequence"
TRITON_STRING_CORRID_BUG = (
    "Triton 2.51 refuses the TYPE_STRING CORRID tensor its own sequence batcher builds"
    " ('unexpected number of string elements'); fixed in 2.54 (triton-inference-server/core#425)"
)

_numbers = itertools.count(1000)


def numeric_id() -> int:
    return next(_numbers)


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sequence_repository")
    for name in ("simple_sequence", "simple_dyna_sequence", STRING_CORRID, "sequence_accumulator"):
        copy_model(name, root)
    for name, (source, replacements) in VARIANTS.items():
        config = copy_model(source, root, name) / "config.pbtxt"
        text = config.read_text()
        for old, new in replacements.items():
            assert old in text, (name, old)
            text = text.replace(old, new)
        config.write_text(text)
    return root


@pytest.fixture(scope="module", params=["kserve", "triton"])
def target(request, repository, tmp_path_factory):
    """Each server on the same repository, in explicit model control so a test can load refused configs."""
    workdir = tmp_path_factory.mktemp(request.param)
    if request.param == "kserve":
        server = start_server(repository, workdir / "server.log", "--model_control_mode", "explicit", "--load_model", "*")
    else:
        server = start_triton(repository, workdir, "--model-control-mode=explicit", "--load-model=*")
    server.kind = request.param
    yield server
    stop_server(server)


def call(protocol: str, target, model: str, value: int, sequence_id=0, start=False, end=False, rows=1, **options) -> int:
    """One request of a sequence; the OUTPUT it answers."""
    module = httpclient if protocol == "http" else grpcclient
    data = np.full((rows, 1), value, np.int32)
    tensor = module.InferInput("INPUT", list(data.shape), "INT32")
    tensor.set_data_from_numpy(data)
    address = target.http if protocol == "http" else target.grpc
    with module.InferenceServerClient(address) as client:
        answer = client.infer(model, [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end, **options)
    return int(answer.as_numpy("OUTPUT")[0, 0])


def expected(model: str, sequence_id, values: list[int]) -> list[int]:
    """What Triton's examples expect of each model (see tools/make_sequence_models.py)."""
    last = len(values) - 1
    if model == "simple_sequence":
        return [v + (i == 0) for i, v in enumerate(values)]
    if model == "simple_dyna_sequence":
        return [v + (i == 0) + (sequence_id if i == last else 0) for i, v in enumerate(values)]
    sums = list(itertools.accumulate(values))
    if model == STRING_CORRID:
        sums[last] += int(sequence_id)
    return sums


def example_sequences(model: str) -> dict:
    """Three sequences as in Triton's examples: numeric ids and a string one, as each model takes them."""
    if model == STRING_CORRID:
        ids = [str(numeric_id()) for _ in range(3)]  # its CORRID is a string, which it adds as a number
    elif model == "simple_dyna_sequence":
        ids = [numeric_id() for _ in range(3)]  # its CORRID is a UINT64: no string ids
    else:
        ids = [numeric_id(), numeric_id(), str(uuid.uuid4())]
    return dict(zip(ids, ([0] + VALUES, [100] + [-v for v in VALUES], [20] + [-v for v in VALUES])))


def interleaved(sequences: dict):
    """(id, step, value, start, end) taking one request of each sequence in turn."""
    for step in range(max(len(v) for v in sequences.values())):
        for sequence_id, values in sequences.items():
            if step < len(values):
                yield sequence_id, step, values[step], step == 0, step == len(values) - 1


def skip_triton_string_corrid(target, model: str) -> None:
    if target.kind == "triton" and model == STRING_CORRID:
        pytest.skip(TRITON_STRING_CORRID_BUG + ": test_triton_2_51_cannot_serve_a_string_corrid")


EXAMPLE_MODELS = ["simple_sequence", "simple_dyna_sequence", STRING_CORRID, "sequence_accumulator"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", EXAMPLE_MODELS)
def test_interleaved_sequences_answer_as_triton_examples_expect(target, model, protocol):
    skip_triton_string_corrid(target, model)
    sequences = example_sequences(model)
    answers = {sequence_id: [] for sequence_id in sequences}
    for sequence_id, _, value, start, end in interleaved(sequences):
        answers[sequence_id].append(call(protocol, target, model, value, sequence_id, start, end))
    assert answers == {sid: expected(model, sid, values) for sid, values in sequences.items()}


@pytest.mark.parametrize("model", EXAMPLE_MODELS)
def test_sequences_over_one_grpc_stream(target, model):
    skip_triton_string_corrid(target, model)
    sequences = example_sequences(model)
    answers: queue.Queue = queue.Queue()
    sent = {}
    with grpcclient.InferenceServerClient(target.grpc) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for number, (sequence_id, step, value, start, end) in enumerate(interleaved(sequences)):
            tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.full((1, 1), value, np.int32))
            sent[str(number)] = (sequence_id, step)
            client.async_stream_infer(
                model, [tensor], request_id=str(number), sequence_id=sequence_id, sequence_start=start, sequence_end=end
            )
        got = {sequence_id: [None] * len(values) for sequence_id, values in sequences.items()}
        for _ in sent:
            result, error = answers.get(timeout=30)
            assert error is None, error
            sequence_id, step = sent[result.get_response().id]
            got[sequence_id][step] = int(result.as_numpy("OUTPUT")[0, 0])
        client.stop_stream()
    assert got == {sid: expected(model, sid, values) for sid, values in sequences.items()}


def test_concurrent_sequences_keep_their_state_across_instances(target):
    """Oldest strategy, two instances: sequences batched together, each on one instance, its sum its own."""
    sequences = {numeric_id() if i % 2 else str(uuid.uuid4()): [i * 10 + v for v in VALUES] for i in range(6)}

    def run(sequence_id):
        values = sequences[sequence_id]
        return [call("grpc", target, "accumulator_oldest", v, sequence_id, i == 0, i == len(values) - 1) for i, v in enumerate(values)]

    with concurrent.futures.ThreadPoolExecutor(len(sequences)) as pool:
        answers = dict(zip(sequences, pool.map(run, sequences)))
    assert answers == {sid: list(itertools.accumulate(values)) for sid, values in sequences.items()}


def test_a_start_on_a_running_sequence_starts_it_again(target):
    sequence_id = numeric_id()
    assert call("http", target, "sequence_accumulator", 5, sequence_id, start=True) == 5
    assert call("http", target, "sequence_accumulator", 3, sequence_id) == 8
    assert call("http", target, "sequence_accumulator", 7, sequence_id, start=True) == 7
    assert call("http", target, "sequence_accumulator", 1, sequence_id, end=True) == 8


# ---- Triton's refusals ----------------------------------------------------------------------------

def refusal(protocol: str, target, *args, **kwargs) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as raised:
        call(protocol, target, *args, **kwargs)
    return raised.value.status(), raised.value.message()


CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


def no_start(sequence_id, model: str) -> str:
    return (
        f"inference request for sequence {sequence_id} to model '{model}' must specify the START flag on the first"
        " request of the sequence"
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_requests_without_a_sequence_id_are_refused(target, protocol):
    text = "inference request to model 'simple_sequence' must specify a non-zero or non-empty correlation ID"
    assert refusal(protocol, target, "simple_sequence", 1) == (CLIENT_ERROR[protocol], text)
    # tritonclient leaves the flags out without an id; a plain request may send them anyway.
    body = {"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [1]}], "parameters": {"sequence_start": True}}
    answer = requests.post(f"{target.url}/v2/models/simple_sequence/infer", json=body)
    assert (answer.status_code, answer.json()) == (400, {"error": text})


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_requests_of_an_unknown_or_ended_sequence_are_refused(target, protocol):
    unknown, ended = numeric_id(), str(uuid.uuid4())
    assert refusal(protocol, target, "simple_sequence", 1, unknown) == (CLIENT_ERROR[protocol], no_start(unknown, "simple_sequence"))
    assert call(protocol, target, "simple_sequence", 4, ended, start=True, end=True) == 5
    assert refusal(protocol, target, "simple_sequence", 1, ended) == (CLIENT_ERROR[protocol], no_start(ended, "simple_sequence"))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_batches_and_ids_the_model_cannot_take_are_refused(target, protocol):
    assert refusal(protocol, target, "simple_sequence", 1, numeric_id(), start=True, rows=2) == (
        CLIENT_ERROR[protocol],
        "inference request to model 'simple_sequence' must specify batch-size 1 due to requirements of sequence batcher",
    )
    # Triton since 2.54 in these words; 2.51 itself passed the string's bytes as the number, the backend refuses.
    assert refusal(protocol, target, "simple_dyna_sequence", 1, "text", start=True) == (
        CLIENT_ERROR[protocol],
        "sequence batching control 'CORRID' data-type is 'BYTES', but model 'simple_dyna_sequence' expects 'UINT64'",
    )


def test_triton_2_51_cannot_serve_a_string_corrid(target):
    """What keeps the string-id model of Triton's examples from real Triton 2.51, whatever the backend."""
    if target.kind != "triton":
        pytest.skip("Triton's own defect")
    status, message = refusal("http", target, STRING_CORRID, 20, str(numeric_id()), start=True)
    assert (status, message) == ("400", "unexpected number of string elements 2 for inference input 'CORRID', expecting 1")


def test_an_idle_sequence_is_released(target):
    """max_sequence_idle_microseconds (200 ms here) without a request: the sequence is gone; a new START begins afresh."""
    sequence_id = numeric_id()
    assert call("http", target, "accumulator_idle", 5, sequence_id, start=True) == 5
    time.sleep(1.0)
    assert refusal("http", target, "accumulator_idle", 1, sequence_id) == ("400", no_start(sequence_id, "accumulator_idle"))
    assert call("http", target, "accumulator_idle", 2, sequence_id, start=True) == 2
    assert call("http", target, "accumulator_idle", 3, sequence_id, end=True) == 5


def test_a_sequence_waits_in_the_backlog_for_a_free_slot(target):
    """One instance, max_batch_size 1: one slot. A second sequence waits until the first ends."""
    first, second = numeric_id(), numeric_id()
    model = "accumulator_one_slot"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert call("http", target, model, 1, first, start=True) == 1
        waiting = pool.submit(call, "http", target, model, 10, second, start=True)
        assert call("http", target, model, 2, first) == 3
        assert not waiting.done()  # the only slot is the first sequence's until it ends
        assert call("http", target, model, 3, first, end=True) == 6
        assert waiting.result(timeout=30) == 10
    assert call("http", target, model, 5, second, end=True) == 15


def test_a_request_waiting_in_the_backlog_past_its_timeout_is_rejected(target):
    holder, late = numeric_id(), numeric_id()
    model = "accumulator_one_slot"
    assert call("grpc", target, model, 1, holder, start=True) == 1
    status, message = refusal("grpc", target, model, 1, late, start=True, timeout=100_000)
    assert (status, message) == ("StatusCode.UNAVAILABLE", "timeout of the corresponding sequence has been expired")
    assert call("grpc", target, model, 1, holder, end=True) == 2
    assert refusal("grpc", target, model, 1, late)[1] == no_start(late, model)


# ---- load-time refusals ----------------------------------------------------------------------------

#: Configs of sequence_accumulator changed to ask what this server refuses, and the words saying why.
REFUSED = {
    "iterative": ("direct { }", "direct { } iterative_sequence: true", "sequence_batching.iterative_sequence is not supported"),
    "growable_state": (
        "dims: [ 1 ] } ]\n}", "dims: [ 1 ] use_growable_memory: true } ]\n}",
        "sequence_batching.state 'INPUT_STATE': use_growable_memory is not supported",
    ),
    "control_declared_as_input": (
        'input [ { name: "INPUT"', 'input [ { name: "START" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "INPUT"',
        "input 'START' is a sequence_batching control or state input",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_is_not_built_is_refused_at_load_naming_the_field(target, repository, case):
    old, new, reason = REFUSED[case]
    name = f"refused_{case}"
    config = copy_model("sequence_accumulator", repository, name) / "config.pbtxt"
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new))
    try:
        with httpclient.InferenceServerClient(target.http) as client:
            with pytest.raises(InferenceServerException) as raised:
                client.load_model(name)
            assert reason in raised.value.message()
            assert not client.is_model_ready(name)
    finally:
        shutil.rmtree(config.parent)  # the next server loads the whole repository at start


# ---- in-process: the config checks, the direct strategy's null requests, the backend's state store ----

def sequence_config(text: str, max_batch_size: int = 8) -> mc.ModelConfig:
    """A config of model "m" with one INT32 [1] input and `text` as its sequence_batching."""
    config = mc.ModelConfig()
    inputs = 'input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]'
    text_format.Parse(f'name: "m" max_batch_size: {max_batch_size} {inputs} sequence_batching {{ {text} }}', config)
    return config


START = 'control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]'
READY = 'control_input [ { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] } ]'
CORRID = 'control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] } ]'
STATE = 'state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_INT32 dims: [ 2 ] } ]'

#: Config fragments Triton refuses, and its words (model_config_utils.cc, sequence_batch_scheduler.cc).
INVALID = {
    "two_values_kinds": (
        'control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ] } ] } ]',
        (
            "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and 'bool_false_true'"
            " for CONTROL_SEQUENCE_START for m"
        ),
    ),
    "three_values": (
        'control_input [ { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1, 2 ] } ] } ]',
        "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_END for m",
    ),
    "no_values": (
        'control_input [ { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY } ] } ]',
        (
            "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for"
            " CONTROL_SEQUENCE_READY for m"
        ),
    ),
    "corrid_float": (
        'control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]',
        (
            "unexpected data type for control CONTROL_SEQUENCE_CORRID for m. Allowed data types are TYPE_UINT64,"
            " TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
        ),
    ),
    "same_tensor_twice": (
        START + " " + START.replace("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END"),
        "sequence batching control tensor 'START' is specified for multiple control kinds for m",
    ),
    "preferred_too_large": (
        "oldest { preferred_batch_size: [ 16 ] }", "sequence batching preferred batch size must be <= max batch size for m"
    ),
    "utilization": (
        "direct { minimum_slot_utilization: 1.5 }",
        "sequence batching minimum slot utilization must be in range (0.0, 1.0] for m",
    ),
    "initial_state_type": (
        STATE.replace("dims: [ 2 ] }", 'dims: [ 2 ] initial_state { name: "z" data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } }'),
        "The data type used for 'initial_state' field of state 'S_IN' does not match the state data type.",
    ),
    "initial_state_dims": (
        STATE.replace("dims: [ 2 ] }", 'dims: [ 2 ] initial_state { name: "z" data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } }'),
        "'initial_state' dim for input name 'S_IN' doesn't match 'state' dim description. 3 != 2",
    ),
    "string_state": (
        STATE.replace("TYPE_INT32", "TYPE_STRING"),
        "sequence_batching.state 'S_IN': data_type TYPE_STRING is not supported as implicit state",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_configs_triton_refuses_are_refused_in_its_words(tmp_path, case):
    text, words = INVALID[case]
    with pytest.raises(ModelLoadError) as raised:
        sequence.SequenceBatching(sequence_config(text), tmp_path)
    assert str(raised.value) == words


def test_defaults_and_the_model_side_config(tmp_path):
    config = sequence_config(f"oldest {{ }} {START} {CORRID} {STATE}")
    sequence.apply_defaults(config)
    assert config.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert list(config.sequence_batching.oldest.preferred_batch_size) == [8]
    batching = sequence.SequenceBatching(config, tmp_path)
    model = batching.model_config(config)
    assert [(t.name, mc.DataType.Name(t.data_type), list(t.dims)) for t in model.input] == [
        ("INPUT", "TYPE_INT32", [1]), ("START", "TYPE_INT32", [1]), ("CORRID", "TYPE_UINT64", [1]), ("S_IN", "TYPE_INT32", [2]),
    ]
    assert [t.name for t in model.output] == ["S_OUT"]
    assert [t.name for t in config.input] == ["INPUT"]  # what clients see is untouched
    controls = batching.control_tensors(2**64 - 1, start=True, end=False)
    assert controls["START"].tolist() == [[1]] and controls["CORRID"].dtype == np.uint64
    assert controls["CORRID"].tolist() == [[2**64 - 1]]
    np.testing.assert_array_equal(batching.initial_states()["S_IN"], np.zeros((1, 2), np.int32))


def test_initial_state_from_a_data_file(tmp_path):
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "seed").write_bytes(np.array([7, -7], np.int32).tobytes())
    state = STATE.replace("dims: [ 2 ] }", 'dims: [ 2 ] initial_state { name: "seed" data_type: TYPE_INT32 dims: [ 2 ] data_file: "seed" } }')
    batching = sequence.SequenceBatching(sequence_config(state, max_batch_size=0), tmp_path)
    assert batching.initial_states()["S_IN"].tolist() == [7, -7]


def test_direct_batches_put_each_sequence_in_its_slot_with_null_requests_between(tmp_path):
    """Triton's direct strategy: slot 0 holds a sequence with no request waiting, so a batch of the slot-1
    sequence alone is two rows, row 0 a null request (READY false, zeros)."""
    batching = sequence.SequenceBatching(sequence_config(f"direct {{ }} {START} {READY} {CORRID} {STATE}"), tmp_path)
    batches = []

    def runner(requests, execution=None):
        batches.append([{name: array.tolist() for name, array in r.items()} for r in requests])
        return [{"OUTPUT": r["INPUT"], "S_OUT": r["S_IN"] + r["INPUT"]} for r in requests]

    requests = [
        (1, {"sequence_id": 5, "sequence_start": True}),  # slot 0
        (2, {"sequence_id": 6, "sequence_start": True}),  # slot 1
        (3, {"sequence_id": 6}),
    ]

    async def scenario():
        scheduler = SequenceScheduler(batching, ["OUTPUT"], [runner], [pool], VersionStats(), [{}])
        for value, parameters in requests:
            options = RequestOptions.parse(parameters)
            await scheduler.submit(Request({"INPUT": np.full((1, 1), value, np.int32)}, 1, (), options, RequestTiming()))
        scheduler.close(RuntimeError("done"))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asyncio.run(scenario())
    *_, last = batches
    assert len(last) == 2
    null, request = last
    assert (null["READY"], null["START"], null["CORRID"], null["INPUT"], null["S_IN"]) == ([[False]], [[0]], [[0]], [[0]], [[0, 0]])
    assert (request["READY"], request["START"], request["CORRID"], request["INPUT"]) == ([[True]], [[0]], [[6]], [[3]])
    assert request["S_IN"] == [[2, 2]]  # the state its START request left


def test_the_backend_state_store(tmp_path):
    batching = sequence.SequenceBatching(sequence_config(f"direct {{ }} {STATE}", max_batch_size=2), tmp_path)
    store = sequence.StateStore(batching)
    assert store.inputs(0, 0)["S_IN"].tolist() == [[0, 0]]  # a null request: the initial state
    for sequence_id in (1, 2, 3):  # three sequences on two slots: the least recently used one is gone
        store.inputs(sequence_id, sequence.FLAG_START)
        store.keep(sequence_id, sequence.FLAG_START, {"S_OUT": np.full((1, 2), sequence_id, np.int32)})
    assert store.inputs(3, 0)["S_IN"].tolist() == [[3, 3]]
    with pytest.raises(InvalidInput, match="must specify the START flag"):
        store.inputs(1, 0)
    store.keep(3, sequence.FLAG_END, {"S_OUT": np.zeros((1, 2), np.int32)})
    with pytest.raises(InvalidInput, match="must specify the START flag"):
        store.inputs(3, 0)


@pytest.mark.parametrize("parameters, words", [
    ({"sequence_id": -1}, "'sequence_id' must be a uint64 or a string"),
    ({"sequence_id": 1.5}, "'sequence_id' must be a uint64 or a string"),
    ({"sequence_id": 1, "sequence_end": "yes"}, "'sequence_end' must be a boolean"),
])
def test_malformed_sequence_parameters_are_client_errors(parameters, words):
    with pytest.raises(InvalidInput, match=words):
        sequence.SequenceRequest.from_parameters(parameters)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_sequence_models_are_reproducible(name):
    assert BUILDERS[name]().SerializeToString() == (REPOSITORY / name / "1" / "model.onnx").read_bytes()
    if name == "sequence_accumulator":  # the conformance suite's sequence model too
        assert (ROOT / "conformance" / "models" / name / "1" / "model.onnx").read_bytes() == (REPOSITORY / name / "1" / "model.onnx").read_bytes()

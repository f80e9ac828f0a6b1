"""Sequence batching as Triton defines it (`sequence_batching` in config.pbtxt): what both servers share.

A stateful model receives the requests of a sequence in order, on one instance, with
control inputs telling it where each request stands (START, END, READY and the
correlation id CORRID), and, with implicit state (`state`), the state tensors its
previous request output. Clients name the sequence with the request parameters of
Triton's sequence extension (`sequence_id`: a uint64 or a string; `sequence_start`,
`sequence_end`).

Here: the `sequence_batching` config, checked at load with Triton's rules and words
(anything this server does not do is refused, naming the field); the control tensors;
the initial state; the request parameters; and `StateStore`, the implicit state the
`ascend` backend keeps inside Triton (Triton's python backend cannot hand a model's
output state back to Triton: it has no TRITONBACKEND_StateUpdate). The KServe server's
scheduler is `sequencer.SequenceScheduler`.

References: Triton's docs/user_guide/model_execution.md ("Stateful Models"),
implicit_state_management.md, protocol/extension_sequence.md, and the core's
src/sequence_batch_scheduler/ and model_config_utils.cc (validation, defaults).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from .. import datatypes
from ..errors import InvalidInput, ModelLoadError

CorrelationId = int | str

#: Triton's request flags (tritonserver.h TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END).
FLAG_START, FLAG_END = 1, 2
#: max_sequence_idle_microseconds when the config leaves it 0 (Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS).
DEFAULT_IDLE_US = 1_000_000
#: Datatypes a CORRID control may take (model_config_utils.cc ValidateModelConfig).
CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")
#: The fields giving a boolean control's false and true values, and the datatype each makes the tensor.
_VALUE_FIELDS = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}

_Kind = mc.ModelSequenceBatching.Control
_BOOLEAN_KINDS = {
    _Kind.CONTROL_SEQUENCE_START: "start",
    _Kind.CONTROL_SEQUENCE_END: "end",
    _Kind.CONTROL_SEQUENCE_READY: "ready",
}


def apply_defaults(config: mc.ModelConfig) -> None:
    """Fills the `sequence_batching` fields Triton fills when the config leaves them out
    (NormalizeModelConfig), so the config this server reports is the one Triton reports."""
    if not config.HasField("sequence_batching"):
        return
    batching = config.sequence_batching
    if not batching.max_sequence_idle_microseconds:
        batching.max_sequence_idle_microseconds = DEFAULT_IDLE_US
    if batching.HasField("oldest") and not batching.oldest.preferred_batch_size and config.max_batch_size > 0:
        batching.oldest.preferred_batch_size.append(config.max_batch_size)


@dataclass(frozen=True)
class Control:
    """One control input: the tensor the sequence batcher sets, [1] per request."""

    name: str
    datatype: str
    #: What a boolean control says for false and true; empty for CORRID.
    false_true: tuple = ()

    def tensor(self, value, batching: bool) -> np.ndarray:
        shape = (1, 1) if batching else (1,)
        if self.false_true:
            return np.full(shape, self.false_true[bool(value)], datatypes.to_numpy(self.datatype))
        if self.datatype == "BYTES":
            return np.full(shape, str(value).encode() if value else b"", dtype=object)  # an empty slot's: "", as Triton
        # A number reaches a narrower CORRID as Triton copies it: its low bytes.
        return np.full(shape, np.uint64(value or 0)).astype(datatypes.to_numpy(self.datatype))


@dataclass(frozen=True)
class ImplicitState:
    """One `state` entry: the input fed from the sequence's last `output_name` (`initial` at its start)."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    #: The state of a starting sequence, without the batch dimension.
    initial: np.ndarray


@dataclass(frozen=True)
class SequenceRequest:
    """A request's place in a sequence: Triton's sequence extension parameters."""

    #: 0 or "": the request names no sequence.
    id: CorrelationId = 0
    start: bool = False
    end: bool = False

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, object]) -> "SequenceRequest":
        sequence_id = parameters.get("sequence_id", 0)
        if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)) or (
            isinstance(sequence_id, int) and not 0 <= sequence_id < 2**64
        ):
            raise InvalidInput(f"request parameter 'sequence_id' must be a uint64 or a string, got {sequence_id!r}")
        flags = []
        for key in ("sequence_start", "sequence_end"):
            value = parameters.get(key, False)
            if not isinstance(value, bool):
                raise InvalidInput(f"request parameter '{key}' must be a boolean, got {value!r}")
            flags.append(value)
        return cls(sequence_id, *flags)


class SequenceBatching:
    """A model's `sequence_batching`, checked: its strategy, controls and implicit state.

    Raises ModelLoadError for a config Triton refuses (in Triton's words) and for what this
    server does not do: `iterative_sequence`, a control input holding several controls,
    `state` of TYPE_STRING, `use_same_buffer_for_input_output` and `use_growable_memory`
    (GPU buffer choices). Everything else is honoured.
    """

    def __init__(self, config: mc.ModelConfig, model_dir: Path):
        batching = config.sequence_batching
        self.model_name = config.name
        self.batching = config.max_batch_size > 0
        self.max_batch_size = config.max_batch_size
        #: The strategy: `oldest` or (the default) `direct`; the other is None.
        self.oldest = batching.oldest if batching.HasField("oldest") else None
        self.direct = None if self.oldest is not None else batching.direct
        self.idle_s = (batching.max_sequence_idle_microseconds or DEFAULT_IDLE_US) / 1e6
        if batching.iterative_sequence:
            raise ModelLoadError(
                "sequence_batching.iterative_sequence is not supported: it needs a backend that reschedules"
                " its requests, and the ascend backend completes every request in one execution"
            )
        self.controls = self._controls(batching)
        self.states = tuple(self._state(state, model_dir) for state in batching.state)
        self._check_names(config)
        if self.oldest is not None:
            for size in self.oldest.preferred_batch_size:
                if size <= 0:
                    raise ModelLoadError(f"sequence batching preferred batch size must be positive for {self.model_name}")
                if size > config.max_batch_size:
                    raise ModelLoadError(
                        f"sequence batching preferred batch size must be <= max batch size for {self.model_name}"
                    )
            #: Sequences one instance batches from (Triton's candidate sequences, at least one).
            self.slots = self.oldest.max_candidate_sequences or max(1, config.max_batch_size)
        else:
            if not 0.0 <= self.direct.minimum_slot_utilization <= 1.0:
                raise ModelLoadError(
                    f"sequence batching minimum slot utilization must be in range (0.0, 1.0] for {self.model_name}"
                )
            #: Batch slots of one instance: each holds one sequence (its row in every batch).
            self.slots = max(1, config.max_batch_size)

    def _controls(self, batching: mc.ModelSequenceBatching) -> dict[str, Control]:
        """The controls by kind ("start", "end", "ready", "corrid"), as Triton validates them."""
        controls: dict[str, Control] = {}
        for control_input in batching.control_input:
            name = control_input.name
            if not name:
                raise ModelLoadError(f"sequence batching control tensor must have a name for {self.model_name}")
            if any(c.name == name for c in controls.values()):
                raise ModelLoadError(
                    f"sequence batching control tensor '{name}' is specified for multiple control kinds for {self.model_name}"
                )
            if len(control_input.control) != 1:
                raise ModelLoadError(
                    f"sequence batching control tensor '{name}' must hold exactly one control,"
                    f" it holds {len(control_input.control)}"
                )
            control = control_input.control[0]
            kind = "corrid" if control.kind == _Kind.CONTROL_SEQUENCE_CORRID else _BOOLEAN_KINDS[control.kind]
            kind_name = _Kind.Kind.Name(control.kind)
            where = f"{kind_name} for {self.model_name}"
            if kind in controls:
                raise ModelLoadError(f"sequence batching specifies multiple {kind_name} tensors for {self.model_name}")
            given = {field: tuple(getattr(control, field)) for field in _VALUE_FIELDS if getattr(control, field)}
            if kind == "corrid":
                if given:
                    raise ModelLoadError(
                        "sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or"
                        f" 'bool_false_true' for {where}"
                    )
                if mc.DataType.Name(control.data_type) not in CORRID_TYPES:
                    raise ModelLoadError(
                        f"unexpected data type for control {where}."
                        " Allowed data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
                    )
                controls[kind] = Control(name, datatypes.from_config(control.data_type))
            elif not given:
                raise ModelLoadError(
                    "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or"
                    f" 'bool_false_true' for {where}"
                )
            elif len(given) > 1:
                raise ModelLoadError(
                    "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and"
                    f" 'bool_false_true' for {where}"
                )
            else:
                (field, false_true), = given.items()
                if len(false_true) != 2:
                    raise ModelLoadError(f"sequence batching control '{field}' must have exactly 2 entries for {where}")
                controls[kind] = Control(name, _VALUE_FIELDS[field], false_true)
        return controls

    def _state(self, state: mc.ModelSequenceBatching.State, model_dir: Path) -> ImplicitState:
        """One `state` entry with its initial value, checked as Triton checks it (SequenceBatchScheduler::Create)."""
        where = f"sequence_batching.state '{state.input_name}'"
        if not state.input_name or not state.output_name:
            raise ModelLoadError(f"{where} needs both input_name and output_name")
        if state.data_type in (mc.TYPE_STRING, mc.TYPE_INVALID, mc.TYPE_BF16):
            raise ModelLoadError(f"{where}: data_type {mc.DataType.Name(state.data_type)} is not supported as implicit state")
        for field in ("use_same_buffer_for_input_output", "use_growable_memory"):
            if getattr(state, field):
                raise ModelLoadError(f"{where}: {field} is not supported (it chooses GPU buffers)")
        datatype, dims = datatypes.from_config(state.data_type), tuple(state.dims)
        dtype = datatypes.to_numpy(datatype)
        if len(state.initial_state) > 1:
            raise ModelLoadError(
                f"initial_state field for state input '{state.input_name}' must contain exactly one or zero element."
                f" Found '{len(state.initial_state)}' elements."
            )
        if not state.initial_state:
            # Triton hands a starting sequence uninitialized memory, a variable dimension taken as 1.
            return ImplicitState(state.input_name, state.output_name, datatype, dims, np.zeros([max(d, 1) for d in dims], dtype))
        initial = state.initial_state[0]
        if initial.data_type != state.data_type:
            raise ModelLoadError(
                f"The data type used for 'initial_state' field of state '{state.input_name}' does not match the state data type."
            )
        if not initial.name:
            raise ModelLoadError(f"Field 'name' must be set when using initial_state for state input '{state.input_name}'.")
        if len(initial.dims) != len(dims):
            raise ModelLoadError(
                "Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions for state input"
                f" '{state.input_name}'. {len(initial.dims)} != {len(dims)}"
            )
        for got, want in zip(initial.dims, dims):
            if got == -1:
                raise ModelLoadError(
                    f"'initial_state' field for state input name '{state.input_name}' contains variable dimensions."
                )
            if want != -1 and got != want:
                raise ModelLoadError(
                    f"'initial_state' dim for input name '{state.input_name}' doesn't match 'state' dim description."
                    f" {got} != {want}"
                )
        shape = tuple(initial.dims)
        if initial.HasField("data_file"):
            path = model_dir / "initial_state" / initial.data_file
            try:
                data = path.read_bytes()
            except OSError as error:
                raise ModelLoadError(f"{where}: initial_state data_file {path}: {error.strerror}") from None
            need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if len(data) < need:
                raise ModelLoadError(
                    f"initial_state setting expects {need} bytes, but the data provided from {initial.data_file}"
                    f" only has {len(data)} bytes."
                )
            values = np.frombuffer(data, dtype, count=need // dtype.itemsize).reshape(shape).copy()
        elif initial.zero_data:
            values = np.zeros(shape, dtype)
        else:
            raise ModelLoadError(f"initial_state setting expects state'{state.input_name}' to have state_data set")
        return ImplicitState(state.input_name, state.output_name, datatype, dims, values)

    def _check_names(self, config: mc.ModelConfig) -> None:
        """The sequence batcher supplies control and state inputs: a client cannot, so the config must not declare them."""
        declared = {tensor.name for tensor in config.input}
        supplied = [c.name for c in self.controls.values()] + [s.input_name for s in self.states]
        for name in supplied:
            if name in declared:
                raise ModelLoadError(
                    f"input '{name}' is a sequence_batching control or state input: the sequence batcher supplies it,"
                    " so it cannot be in `input` (a config without `input` takes every input of the model file)"
                )
        if len(set(supplied)) != len(supplied):
            raise ModelLoadError(f"sequence_batching names an input twice among its controls and states: {sorted(supplied)}")

    def model_config(self, config: mc.ModelConfig) -> mc.ModelConfig:
        """The config as the model file sees it: with the control and state tensors the batcher feeds
        it and the state outputs it takes back (a state output the config lists stays as it is)."""
        model = mc.ModelConfig()
        model.CopyFrom(config)
        for control in self.controls.values():
            model.input.add(name=control.name, data_type=datatypes.to_config(control.datatype), dims=[1])
        outputs = {tensor.name for tensor in config.output}
        for state in self.states:
            data_type = datatypes.to_config(state.datatype)
            model.input.add(name=state.input_name, data_type=data_type, dims=state.dims)
            if state.output_name not in outputs:
                model.output.add(name=state.output_name, data_type=data_type, dims=state.dims)
        return model

    def check_correlation_id(self, correlation_id: CorrelationId) -> None:
        """Refuses an id of the other type than the CORRID control's, in the words of Triton since 2.54
        (InferenceRequest::ValidateCorrelationId; 2.51 passed a string id's bytes as the number)."""
        control = self.controls.get("corrid")
        if control is None:
            return
        text = isinstance(correlation_id, str)
        if text != (control.datatype == "BYTES"):
            raise InvalidInput(
                f"sequence batching control '{control.name}' data-type is '{'BYTES' if text else 'UINT64'}',"
                f" but model '{self.model_name}' expects '{control.datatype}'"
            )

    def control_tensors(self, correlation_id: CorrelationId, start: bool, end: bool, ready: bool = True) -> dict[str, np.ndarray]:
        """The control inputs of one request (or, not ready, of an empty batch slot)."""
        values = {"start": start and ready, "end": end and ready, "ready": ready, "corrid": correlation_id if ready else 0}
        return {control.name: control.tensor(values[kind], self.batching) for kind, control in self.controls.items()}

    def initial_states(self) -> dict[str, np.ndarray]:
        """The state inputs of a starting sequence."""
        lead = (1,) if self.batching else ()
        return {s.input_name: s.initial.reshape(lead + s.initial.shape) for s in self.states}

    def output_states(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A request's output states as the state inputs of the sequence's next request."""
        return {s.input_name: outputs[s.output_name].copy() for s in self.states}  # not a view of the whole batch


def missing_start(correlation_id: CorrelationId, model_name: str) -> InvalidInput:
    """Triton's refusal of a request continuing a sequence it does not know (never started, ended or idle)."""
    return InvalidInput(
        f"inference request for sequence {correlation_id} to model '{model_name}' must specify the START flag"
        " on the first request of the sequence"
    )


class StateStore:
    """The implicit state of the sequences one Triton model instance serves, for the `ascend` backend.

    Triton feeds a python-backend model the state input, but the python backend never
    stores the model's output state (no TRITONBACKEND_StateNew/StateUpdate in
    python_backend src/python_be.cc), so Triton would hand every request the initial
    state: the backend keeps it instead. Triton hands the backend each request's
    correlation id and START/END flags; its direct strategy fills empty batch slots with
    null requests, whose correlation id is 0 (core src/infer_request.cc CopyAsNull).
    Triton keeps a sequence on one instance and at most `slots` sequences per instance:
    beyond that, the least recently used state is of a sequence Triton released (idle
    past max_sequence_idle_microseconds), and is dropped.
    """

    def __init__(self, sequences: SequenceBatching):
        self.sequences = sequences
        self._states: collections.OrderedDict[CorrelationId, dict[str, np.ndarray]] = collections.OrderedDict()

    def inputs(self, correlation_id: CorrelationId, flags: int) -> dict[str, np.ndarray]:
        """The state inputs of a request (of a null request: the initial state, which it cannot change)."""
        if correlation_id:
            self.sequences.check_correlation_id(correlation_id)
        if not self.sequences.states:
            return {}
        if not correlation_id or flags & FLAG_START:
            return self.sequences.initial_states()
        if correlation_id not in self._states:  # Triton let it through but its state is gone: say what Triton would
            raise missing_start(correlation_id, self.sequences.model_name)
        self._states.move_to_end(correlation_id)
        return self._states[correlation_id]

    def keep(self, correlation_id: CorrelationId, flags: int, outputs: Mapping[str, np.ndarray]) -> None:
        """Stores a request's output states for its sequence's next request; forgets an ended sequence."""
        if not self.sequences.states or not correlation_id:
            return
        if flags & FLAG_END:
            self._states.pop(correlation_id, None)
            return
        self._states[correlation_id] = self.sequences.output_states(outputs)
        self._states.move_to_end(correlation_id)
        while len(self._states) > self.sequences.slots:
            self._states.popitem(last=False)

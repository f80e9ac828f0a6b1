"""Ensembles as Triton defines them: `platform: "ensemble"`, whose `ensemble_scheduling` steps run
other models of the repository on tensors named in `input_map` / `output_map`.

A request's steps run as soon as their inputs exist, independent ones at the same time, each
as an ordinary request of its model: through that model's scheduler (so a batching model
batches the steps of concurrent ensemble requests), counted in its statistics. What Triton's
ensemble scheduler does, this does too (core src/ensemble_scheduler/ensemble_scheduler.cc):
only the steps that lead to a requested output run; every step gets the request's parameters
(`priority`, `timeout`, and those a model reads, such as detection thresholds); an optional
ensemble input the request leaves out is left out of the steps it feeds; a tensor passes
between a batching and a non-batching model when its full shape fits (a batch of one gains or
loses its batch dimension); a failing step fails the request with "in ensemble '<name>', ...",
here naming the step. The ensemble's statistics count its requests, each charged with the
compute of its steps, and one execution per request of its batch size, as Triton's do.

Checked at load against the step models' configs (core src/ensemble_scheduler/ensemble_utils.cc):
every step input mapped (unless optional) from an ensemble input or an earlier step's output,
every ensemble output produced, each tensor of one datatype and of compatible shapes
wherever it appears, no cycle, no step model batching less than the ensemble.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..contracts import (
    Request,
    RequestOptions,
    RequestScheduler,
    ServedVersion,
    VersionHealth,
)
from ..errors import AscendError, ModelLoadError
from ..signature import Signature, TensorDecl
from ..stats import Execution, RequestTiming, VersionStats
from . import classification

log = logging.getLogger(__name__)

PLATFORM = "ensemble"


def is_ensemble(config: mc.ModelConfig) -> bool:
    return config.platform == PLATFORM


def step_models(config: mc.ModelConfig) -> list[str]:
    """The models an ensemble's steps run, in order, each once (none for another model)."""
    if not is_ensemble(config):
        return []
    return list(dict.fromkeys(step.model_name for step in config.ensemble_scheduling.step))


@dataclass(frozen=True, eq=False)
class Step:
    """One `ensemble_scheduling.step`: `inputs` and `outputs` map the model's tensor names to the ensemble's."""

    number: int  # 1-based, in config order: how errors name it
    model_name: str
    version: str | None  # None: model_version -1, the model's own choice
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]

    def __str__(self) -> str:
        return f"step {self.number} (model '{self.model_name}')"


class Graph:
    """An ensemble's steps and how tensors flow between them, checked for what the config alone can tell."""

    def __init__(self, config: mc.ModelConfig):
        if not config.HasField("ensemble_scheduling") or not config.ensemble_scheduling.step:
            raise ModelLoadError("an ensemble needs ensemble_scheduling with at least one step")
        self.steps = [
            Step(
                number,
                step.model_name,
                None if step.model_version < 0 else str(step.model_version),
                dict(step.input_map),
                dict(step.output_map),
            )
            for number, step in enumerate(config.ensemble_scheduling.step, 1)
        ]
        inputs = {t.name for t in config.input}
        #: ensemble tensor -> the step producing it
        self.producer: dict[str, Step] = {}
        for step in self.steps:
            if not step.model_name:
                raise ModelLoadError(f"{step} names no model")
            if not step.outputs:
                raise ModelLoadError(f"{step} has no output_map")
            for tensor in step.outputs.values():
                if tensor in inputs:
                    raise ModelLoadError(f"{step} writes ensemble tensor '{tensor}', an input of the ensemble")
                if tensor in self.producer:
                    raise ModelLoadError(f"ensemble tensor '{tensor}' is written by {self.producer[tensor]} and by {step}")
                self.producer[tensor] = step
        for step in self.steps:
            for tensor in step.inputs.values():
                if tensor not in inputs and tensor not in self.producer:
                    raise ModelLoadError(f"{step} reads ensemble tensor '{tensor}', which no step writes and is no ensemble input")
        for output in config.output:
            if output.name not in self.producer:
                raise ModelLoadError(f"ensemble output '{output.name}' is written by no step")
        read = {tensor for step in self.steps for tensor in step.inputs.values()}
        for name in sorted(inputs - read):
            raise ModelLoadError(f"ensemble input '{name}' is read by no step")
        self._check_acyclic(inputs)

    def _check_acyclic(self, inputs: set[str]) -> None:
        available, left = set(inputs), list(self.steps)
        while left:
            ready = [s for s in left if set(s.inputs.values()) <= available]
            if not ready:
                raise ModelLoadError(f"the steps {', '.join(map(str, left))} wait on each other's outputs (a cycle)")
            for step in ready:
                available.update(step.outputs.values())
                left.remove(step)

    def needed(self, outputs: Collection[str]) -> list[Step]:
        """The steps that lead to `outputs`, in config order (Triton prunes the others)."""
        wanted, needed = list(outputs), set()
        while wanted:
            step = self.producer.get(wanted.pop())
            if step is not None and step.number not in needed:
                needed.add(step.number)
                wanted.extend(step.inputs.values())
        return [s for s in self.steps if s.number in needed]


@dataclass(frozen=True)
class _Tensor:
    """Where a tensor's type and shape are declared, for the load-time checks."""

    where: str
    datatype: str
    dims: tuple[int, ...]
    batching: bool

    @property
    def full_dims(self) -> tuple[int, ...]:
        return (-1, *self.dims) if self.batching else self.dims


def _fits(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def _dims(decl: TensorDecl) -> tuple[int, ...]:
    return decl.reshape if decl.reshape is not None else decl.dims


def check_steps(name: str, signature: Signature, graph: Graph, models: Mapping[Step, ServedVersion]) -> None:
    """Refuses an ensemble whose steps do not fit the step models' configs (ModelLoadError)."""
    tensors: dict[str, _Tensor] = {}

    def meet(tensor: str, seen: _Tensor) -> None:
        known = tensors.setdefault(tensor, seen)
        if known.datatype != seen.datatype:
            raise ModelLoadError(
                f"ensemble tensor '{tensor}' is {known.datatype} in {known.where} but {seen.datatype} in {seen.where}"
            )
        if not _fits(known.dims, seen.dims) and not _fits(known.full_dims, seen.full_dims):
            raise ModelLoadError(
                f"ensemble tensor '{tensor}' has shape {list(known.full_dims)} in {known.where}"
                f" but {list(seen.full_dims)} in {seen.where}"
            )

    for decl in (*signature.inputs.values(), *signature.outputs.values()):
        meet(decl.name, _Tensor(f"ensemble '{name}'", decl.datatype, _dims(decl), signature.batching))
    for step, served in models.items():
        model = served.signature
        if model.batching and model.max_batch_size < signature.max_batch_size:
            raise ModelLoadError(
                f"the ensemble allows batches of {signature.max_batch_size}, but {step}"
                f" takes at most {model.max_batch_size} (max_batch_size)"
            )
        for own, tensor in step.inputs.items():
            if own not in model.inputs:
                raise ModelLoadError(f"{step} maps ensemble tensor '{tensor}' to '{own}', not an input of the model {sorted(model.inputs)}")
        for decl in model.inputs.values():
            if decl.name not in step.inputs and not decl.optional:
                raise ModelLoadError(f"{step} leaves the model's input '{decl.name}' unmapped (input_map)")
        for own, tensor in step.outputs.items():
            if own not in model.outputs:
                raise ModelLoadError(f"{step} maps '{own}' to ensemble tensor '{tensor}', not an output of the model {sorted(model.outputs)}")
        # In the model's order: the first tensor that does not fit is the one named.
        for decls, mapping in ((model.inputs, step.inputs), (model.outputs, step.outputs)):
            for decl in decls.values():
                if decl.name in mapping:
                    meet(mapping[decl.name], _Tensor(str(step), decl.datatype, decl.dims, model.batching))


#: An optional tensor a request (or a step) left out: the steps it feeds go without it.
ABSENT = None


def _fit_batch(array: np.ndarray, dims: tuple[int, ...], step_batches: bool, batch: int) -> np.ndarray:
    """The tensor as a step's model (or the ensemble's answer) takes it, Triton's
    EnsembleContext::ReshapeTensorDims: between a batching and a non-batching side, a tensor that is the
    model's dims gains a batch of 1, and a batch of 1 that is not the model's dims loses its batch
    dimension; anything else passes as it is."""
    if step_batches and not batch and _fits(dims, array.shape):
        return array[np.newaxis]
    if not step_batches and batch == 1 and not _fits(dims, array.shape):
        return array[0]
    return array


def _prefixed(error: AscendError, prefix: str) -> AscendError:
    """The error (its class, so its status, and attributes) with `prefix` before its message: a copy, as a
    batch's requests may share one exception."""
    copy = type(error).__new__(type(error))
    copy.__dict__.update(error.__dict__)
    copy.args = (f"{prefix}{error}",)
    return copy.with_traceback(error.__traceback__)


#: The version of a model that a step runs now: (model name, version or None) -> the version.
Resolve = Callable[[str, "str | None"], ServedVersion]


class EnsembleSteps(RequestScheduler):
    """An ensemble version's scheduler: runs each request's steps as requests of their models.

    Nothing queues here and no instance is its own: the steps' models queue and execute, and
    each of their schedulers fails what it holds when closed. What this holds is the requests
    in flight, which retiring the ensemble and a shutdown wait for.
    """

    def __init__(self, name: str, signature: Signature, graph: Graph, resolve: Resolve, stats: VersionStats):
        super().__init__()
        self.name = name
        self.signature = signature
        self.graph = graph
        self.resolve = resolve
        self.stats = stats

    @property
    def health(self) -> list[str]:
        return []

    @property
    def queued(self) -> int:
        return 0

    def close(self, reason: Exception) -> None:
        """Nothing waits here: each step's own scheduler fails what it holds."""

    def abandon(self, reason: Exception) -> list[int]:
        return []

    def step_version(self, step: Step) -> ServedVersion:
        """The version of the step's model a request runs now (raises ModelNotFound / ModelNotReady)."""
        try:
            return self.resolve(step.model_name, step.version)
        except AscendError as error:
            raise _prefixed(error, f"{step}: ") from None

    async def submit(self, request: Request) -> dict[str, np.ndarray]:
        """Runs the request through the steps its outputs need; returns those outputs."""
        wanted = [n for n in self.signature.outputs if n in request.outputs] if request.outputs else list(self.signature.outputs)
        steps = self.graph.needed(wanted)
        try:
            served = {step: self.step_version(step) for step in steps}
        except AscendError as error:
            raise _prefixed(error, f"in ensemble '{self.name}', ") from None
        timing = request.timing
        timing.queued(self.stats)
        self._entered()
        try:
            tensors, batches, phases = await self._run(steps, served, request.inputs, request.rows, request.options)
        except BaseException as error:
            timing.failed("CANCELED" if isinstance(error, asyncio.CancelledError) else "OTHER")  # Triton's reasons
            if isinstance(error, AscendError):
                raise _prefixed(error, f"in ensemble '{self.name}', ") from None
            raise
        finally:
            self._left()
        execution = Execution(timing.enqueued, *phases)
        self.stats.record_execution(max(request.rows, 1), execution)
        timing.executed(execution)
        # In the ensemble's own shapes, as Triton answers them; an output a step left out is left out.
        decls = self.signature.outputs
        return {
            name: _fit_batch(tensors[name], _dims(decls[name]), self.signature.batching, batches[name])
            for name in wanted
            if tensors[name] is not ABSENT
        }

    async def _run(
        self,
        steps: list[Step],
        served: Mapping[Step, ServedVersion],
        inputs: Mapping[str, np.ndarray],
        rows: int,
        options: RequestOptions,
    ) -> tuple[dict[str, np.ndarray | None], dict[str, int], tuple[int, int, int]]:
        """Runs every step once its inputs exist; the tensors, their batch sizes (0: no batch dimension)
        and the steps' compute (input, infer, output ns)."""
        batch = rows if self.signature.batching else 0
        tensors: dict[str, np.ndarray | None] = {d.name: inputs.get(d.name, ABSENT) for d in self.signature.inputs.values()}
        batches = dict.fromkeys(tensors, batch)
        waiting, running = list(steps), {}
        phases = [0, 0, 0]
        failure: tuple[Step, BaseException] | None = None
        try:
            while True:
                if failure is None:
                    for step in [s for s in waiting if all(t in tensors for t in s.inputs.values())]:
                        waiting.remove(step)
                        task = asyncio.ensure_future(self._step(step, served[step], tensors, batches, options))
                        running[task] = step
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    if task.exception() is not None:
                        failure = failure or (step, task.exception())
                        continue
                    outputs, step_batch, execution = task.result()
                    for own, tensor in step.outputs.items():
                        tensors[tensor] = outputs.get(own, ABSENT)
                        batches[tensor] = step_batch
                    phases[0] += execution.input_ns
                    phases[1] += execution.infer_ns
                    phases[2] += execution.output_ns
        finally:
            for task in running:  # the caller went away: the steps finish on their own, their errors unraised
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        if failure is not None:
            step, error = failure
            if isinstance(error, AscendError):
                raise _prefixed(error, f"{step}: ")
            raise error
        return tensors, batches, (phases[0], phases[1], phases[2])

    @staticmethod
    async def _step(
        step: Step,
        served: ServedVersion,
        tensors: Mapping[str, np.ndarray | None],
        batches: Mapping[str, int],
        options: RequestOptions,
    ) -> tuple[dict[str, np.ndarray], int, Execution]:
        """One step as a request of its model; its outputs, their batch size, and its execution's phases."""
        signature = served.signature
        inputs = {
            own: _fit_batch(tensors[tensor], signature.inputs[own].dims, signature.batching, batches[tensor])
            for own, tensor in step.inputs.items()
            if tensors[tensor] is not ABSENT
        }
        timing = RequestTiming()
        outputs = await served.infer(inputs, list(step.outputs), options, timing)
        timing.answering()
        timing.answered()  # the step's request, in its model's statistics
        step_batch = next(iter(inputs.values())).shape[0] if signature.batching and inputs else 0
        return outputs, step_batch, timing.execution


class EnsembleVersion(ServedVersion):
    """One version of an ensemble: its steps run other versions of the repository, it has no instance of its own."""

    def __init__(self, config: mc.ModelConfig, model_dir: Path, version: int, resolve: Resolve):
        self.name = config.name
        self.version = version
        self.path = model_dir / str(version)
        self.config = config
        self.signature = Signature(config)
        self.graph = Graph(config)
        self.labels = classification.read_labels(config, model_dir)
        self.source = config.SerializeToString(deterministic=True)
        self.stats = VersionStats()
        self.scheduler: EnsembleSteps = EnsembleSteps(self.name, self.signature, self.graph, resolve, self.stats)

    @classmethod
    def load(cls, config: mc.ModelConfig, model_dir: Path, version: int, resolve: Resolve) -> EnsembleVersion:
        """Checks the ensemble against the step models serving now; ModelLoadError names what does not fit."""
        if not (model_dir / str(version)).is_dir():
            raise ModelLoadError(f"version {version} has no directory")
        loaded = cls(config, model_dir, version, resolve)
        try:
            steps = {step: loaded.scheduler.step_version(step) for step in loaded.graph.steps}
        except AscendError as error:
            raise ModelLoadError(str(error)) from None
        check_steps(config.name, loaded.signature, loaded.graph, steps)
        return loaded

    @property
    def waiting_for(self) -> str:
        """Why the ensemble cannot serve now: a step model that is not ready ("" when every one is)."""
        for step in self.graph.steps:
            try:
                self.scheduler.step_version(step)
            except AscendError as error:
                return str(error)
        return ""

    def unchanged(self, source: bytes, model_dir: Path) -> bool:
        """Never: an ensemble is checked again against its step models on every load (it costs nothing)."""
        return False

    def health_snapshot(self) -> VersionHealth:
        return VersionHealth(queued=0, padding_rows=0)

"""One model file on one device, running whole batches: the part both servers share.

`Instance` adapts a batch to what the model file takes (precision, padding, splitting). The
checks here decide, at load, whether a config and a model file agree.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..datatypes import to_config, to_numpy
from ..errors import InternalError, ModelLoadError
from ..signature import Signature
from ..stats import Execution, now_ns
from .runtimes import Runtime, TensorSpec

#: Triton's default max_batch_size when it auto-completes a model that can batch.
AUTO_COMPLETE_MAX_BATCH_SIZE = 4


def complete_config(config: mc.ModelConfig, runtime: Runtime) -> None:
    """Fills inputs, outputs and max_batch_size from the model file where config.pbtxt leaves them out.

    As Triton's ONNX backend does: a model whose every tensor has a variable first
    dimension is taken to batch along it, unless `parameters input_shape` declares the
    whole shape (max_batch_size 0: a config.yaml model without dynamic_batching).
    """
    if config.input and config.output:
        return
    specs = [*runtime.inputs, *runtime.outputs]
    whole_shape = "input_shape" in config.parameters
    batches = config.max_batch_size > 0 or (not whole_shape and specs and all(s.shape[:1] == (-1,) for s in specs))
    if batches and config.max_batch_size == 0:
        config.max_batch_size = runtime.max_batch_size or AUTO_COMPLETE_MAX_BATCH_SIZE
    def declare(target, spec: TensorSpec):
        target.add(name=spec.name, data_type=to_config(spec.datatype), dims=spec.shape[1:] if batches else spec.shape)

    if not config.input:
        for spec in runtime.inputs:
            declare(config.input, spec)
    if not config.output:
        for spec in runtime.outputs:
            declare(config.output, spec)


#: Datatypes that may differ between config.pbtxt and the model file: only float precision,
#: as ATC's `--output_type FP16` and `--input_fp16_nodes` make FP16 tensors of an FP32 model.
_FLOATS = frozenset({"FP16", "FP32", "FP64"})


def check_against_file(signature: Signature, runtime: Runtime) -> dict[str, tuple[str, str]]:
    """Refuses a config whose tensors the model file does not have.

    Returns the tensors whose datatype differs only by float precision, converted at the
    runtime boundary: name -> (datatype in config.pbtxt, datatype in the model file).
    """
    batch = (-1,) if signature.batching else ()
    conversions = {}
    for declared, actual in ((signature.inputs, runtime.inputs), (signature.outputs, runtime.outputs)):
        specs = {s.name: s for s in actual}
        for decl in declared.values():
            spec = specs.get(decl.name)
            if spec is None:
                raise ModelLoadError(f"config.pbtxt declares '{decl.name}', the model file has {sorted(specs)}")
            if spec.datatype != decl.datatype:
                if not {spec.datatype, decl.datatype} <= _FLOATS:
                    raise ModelLoadError(
                        f"'{decl.name}' is {decl.datatype} in config.pbtxt but {spec.datatype} in the model file"
                    )
                conversions[decl.name] = (decl.datatype, spec.datatype)
            want = batch + (decl.reshape if decl.reshape is not None else decl.dims)
            if len(want) != len(spec.shape) or any(a not in (-1, b) and b != -1 for a, b in zip(want, spec.shape)):
                raise ModelLoadError(
                    f"'{decl.name}' has shape {list(want)} in config.pbtxt but {list(spec.shape)} in the model file"
                )
    return conversions


def check_batch_sizes(signature: Signature, runtime: Runtime) -> tuple[int, ...]:
    """The batch sizes the model file takes under the config's max_batch_size (empty: any).

    One rule for every runtime: a batch runs at the smallest size that holds it, padded
    with zero rows, and a batch above the largest size runs as several executions. Refused:
    a `max_batch_size` above the largest of several sizes (the gears of an `.om`: compile a
    larger gear instead of splitting), and batching a file that does not batch.
    """
    if not signature.batching:
        return ()
    sizes, limit, file = tuple(runtime.batch_sizes), signature.max_batch_size, runtime.path.name
    if len(sizes) > 1 and limit > sizes[-1]:
        raise ModelLoadError(
            f"max_batch_size {limit} is above the largest batch gear of {file} (gears {_listed(sizes)}):"
            " lower max_batch_size or compile a larger gear (ATC --dynamic_batch_size)"
        )
    for spec in (*runtime.inputs, *runtime.outputs):
        first = spec.shape[0] if spec.shape else None
        if first is None or (first != -1 and first not in sizes):
            has = f"first dimension {first}" if first is not None else "no dimensions"
            raise ModelLoadError(
                f"max_batch_size {limit} batches along the first dimension, but {file} does not batch:"
                f" '{spec.name}' has {has}; set max_batch_size 0 and declare the full shapes"
            )
    return sizes


def _listed(numbers) -> str:
    return ",".join(map(str, numbers))


class Instance:
    """One runtime on one device, running whole batches: the part both servers share.

    It adapts a batch to what the model file takes: rows converted to the file's float
    precision, zero rows up to the smallest of `runtime.batch_sizes` that holds the batch,
    several executions when the batch is larger than the largest; outputs come back in the
    config's datatypes with exactly the batch's rows. Raises ModelLoadError when the config
    and the file disagree beyond that.

    Not thread-safe: one thread at a time calls it (the KServe server gives each instance
    a thread of its own; Triton calls `execute` of one model instance at a time).
    """

    def __init__(self, runtime: Runtime, signature: Signature):
        self.runtime = runtime
        self._output_names = list(signature.outputs)
        self._reshape_in = {d.name: d.reshape for d in signature.inputs.values() if d.reshape is not None}
        self._reshape_out = {d.name: d.dims for d in signature.outputs.values() if d.reshape is not None}
        self._batching = signature.batching
        conversions = check_against_file(signature, runtime)
        self.batch_sizes = check_batch_sizes(signature, runtime)
        self._input_dtypes = {n: to_numpy(file) for n, (_, file) in conversions.items() if n in signature.inputs}
        self._output_dtypes = {n: to_numpy(config) for n, (config, _) in conversions.items() if n in signature.outputs}
        #: Zero rows added so far to fill batches up to a size the model file takes.
        self.padding_rows = 0
        #: What this instance does to batches, for model metadata `parameters`.
        self.parameters: dict[str, str] = {}
        if conversions:
            self.parameters["converted"] = ",".join(
                f"{name}:{config}->{file}" if name in signature.inputs else f"{name}:{file}->{config}"
                for name, (config, file) in conversions.items()
            )
        if self.batch_sizes:
            self.parameters["batch_sizes"] = _listed(self.batch_sizes)
            if signature.max_batch_size > self.batch_sizes[-1]:
                self.parameters["batch_split"] = (
                    f"batches of up to {signature.max_batch_size} rows run as executions of {self.batch_sizes[-1]}"
                )

    def run_batch(
        self, requests: Sequence[Mapping[str, np.ndarray]], execution: Execution | None = None
    ) -> list[dict[str, np.ndarray]]:
        """Runs the requests as one batch (concatenated along dimension 0); each gets its own rows back.

        Notes its input phase (gathering, converting, padding) and output phase (unpadding,
        converting, splitting) in `execution`, if given; the rest is the run.
        """
        if not self._batching:  # every request is the whole of one execution
            return self._run_each(requests, execution)
        started = now_ns()
        counts = [self._rows(r) for r in requests]
        rows = sum(counts)
        runs = self._runs(rows)
        inputs = self._assemble(requests, rows, sum(runs))
        assembled = now_ns()
        parts, start = [], 0
        for size in runs:
            chunk = inputs if len(runs) == 1 else {n: a[start : start + size] for n, a in inputs.items()}
            parts.append(self._run(chunk, size))
            start += size
        ran = now_ns()
        padding = start - rows
        self.padding_rows += padding
        outputs = self._gather(parts, padding)
        if len(requests) == 1:
            split = [outputs]
        else:
            split, start = [], 0
            for count in counts:
                split.append({name: array[start : start + count] for name, array in outputs.items()})
                start += count
        if execution is not None:
            execution.input_ns, execution.output_ns = assembled - started, now_ns() - ran
        return split

    def _run_each(
        self, requests: Sequence[Mapping[str, np.ndarray]], execution: Execution | None
    ) -> list[dict[str, np.ndarray]]:
        """Each request as an execution of its own (a model that does not batch); phases summed."""
        results, input_ns, output_ns = [], 0, 0
        for request in requests:
            started = now_ns()
            inputs = self._convert(request, self._input_dtypes)
            converted = now_ns()
            outputs = self._run(inputs, 1)
            ran = now_ns()
            results.append(self._convert(outputs, self._output_dtypes))
            input_ns += converted - started
            output_ns += now_ns() - ran
        if execution is not None:
            execution.input_ns, execution.output_ns = input_ns, output_ns
        return results

    def responses(self, inputs: Mapping[str, np.ndarray], stop: threading.Event) -> Iterator[dict[str, np.ndarray]]:
        """One request of a decoupled model as an execution of its own: each response's outputs in the config's
        datatypes and shapes, as the runtime yields them (`Runtime.responses`); `stop` ends them early."""
        rows = self._rows(inputs) if self._batching else 1
        converted = self._shaped(self._convert(inputs, self._input_dtypes), self._reshape_in, rows)
        for outputs in self.runtime.responses(converted, self._output_names, stop):
            self._check_outputs(outputs, rows)
            yield self._convert(self._shaped(outputs, self._reshape_out, rows), self._output_dtypes)

    def _run(self, inputs: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        outputs = self.runtime.run(self._shaped(inputs, self._reshape_in, rows), self._output_names)
        self._check_outputs(outputs, rows)
        return self._shaped(outputs, self._reshape_out, rows)

    def _check_outputs(self, outputs: Mapping[str, np.ndarray], rows: int) -> None:
        """Refuses (InternalError) a run that did not answer an array per output with the batch's rows.

        A model that does not keep its batch dimension (one dropping rows, or reducing over them) would
        otherwise hand some requests of a batch their neighbours' rows, or none.
        """
        for name in self._output_names:
            array = outputs.get(name) if isinstance(outputs, Mapping) else None
            if not isinstance(array, np.ndarray):
                raise InternalError(f"{self.runtime.path.name} answered {type(array).__name__} for output '{name}', not an array")
            if self._batching and (array.ndim == 0 or array.shape[0] != rows):
                answered = array.shape[0] if array.ndim else "no"
                raise InternalError(
                    f"{self.runtime.path.name} answered {answered} rows of output '{name}' for a batch of {rows}:"
                    " the model does not keep the batch dimension"
                )

    def _runs(self, rows: int) -> list[int]:
        """The executions a batch of `rows` takes: as many of the largest size as fill, then the smallest that holds the rest."""
        if not self.batch_sizes:
            return [rows]
        largest = self.batch_sizes[-1]
        full, rest = divmod(rows, largest)
        return [largest] * full + ([next(s for s in self.batch_sizes if s >= rest)] if rest else [])

    def _assemble(self, requests: Sequence[Mapping[str, np.ndarray]], rows: int, total: int) -> dict[str, np.ndarray]:
        """One array per input holding every request's rows in the file's datatype, then zero rows up to `total`.

        Concatenating, converting and padding are one copy into one array.
        """
        if len(requests) == 1 and rows == total and not self._input_dtypes:
            return dict(requests[0])
        assembled = {}
        for name, first in requests[0].items():
            dtype = self._input_dtypes[name] if name in self._input_dtypes else np.result_type(*(r[name].dtype for r in requests))
            array = np.empty((total, *first.shape[1:]), dtype)
            np.concatenate([r[name] for r in requests], out=array[:rows], casting="same_kind")
            if rows < total:
                # Zero rows; for strings, copies of the last real row: a model that parses its text
                # (Cast string->int) takes those, where it would fail the whole batch on "".
                array[rows:] = array[rows - 1] if dtype.kind == "O" else 0
            assembled[name] = array
        return assembled

    def _gather(self, parts: list[dict[str, np.ndarray]], padding: int) -> dict[str, np.ndarray]:
        """The outputs of the executions as one batch: without the padding rows, in the config's datatypes."""
        real = slice(0, -padding or None)  # the rows of the last execution that are not padding
        if len(parts) == 1:
            outputs = {n: a[real] for n, a in parts[0].items()} if padding else parts[0]
            return self._convert(outputs, self._output_dtypes)
        return {
            name: np.concatenate(
                [p[name] for p in parts[:-1]] + [parts[-1][name][real]],
                dtype=self._output_dtypes.get(name),
                casting="same_kind",
            )
            for name in parts[0]
        }

    @staticmethod
    def _convert(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
        if not dtypes:
            return dict(arrays)
        return {n: a.astype(dtypes[n]) if n in dtypes else a for n, a in arrays.items()}

    def _shaped(self, arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple], rows: int) -> dict:
        if not shapes:
            return dict(arrays)
        lead = (rows,) if self._batching else ()
        return {n: a.reshape(lead + shapes[n]) if n in shapes else a for n, a in arrays.items()}

    def _rows(self, inputs: Mapping[str, np.ndarray]) -> int:
        return next(iter(inputs.values())).shape[0]

"""What a model accepts and returns, from its config: the checks every request passes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from . import datatypes
from .errors import InvalidInput


@dataclass(frozen=True)
class TensorDecl:
    """A tensor as config.pbtxt declares it; `dims` exclude the batch dimension."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    #: The shape the model file expects instead of `dims` (config.pbtxt `reshape`), if any.
    reshape: tuple[int, ...] | None = None
    optional: bool = False

    @classmethod
    def from_config(cls, tensor: mc.ModelInput | mc.ModelOutput) -> "TensorDecl":
        reshape = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None
        return cls(
            name=tensor.name,
            datatype=datatypes.from_config(tensor.data_type),
            dims=tuple(tensor.dims),
            reshape=reshape,
            optional=getattr(tensor, "optional", False),
        )


class Signature:
    """The inputs, outputs and batching limit of one model."""

    def __init__(self, config: mc.ModelConfig):
        self.max_batch_size = config.max_batch_size
        self.inputs = {t.name: TensorDecl.from_config(t) for t in config.input}
        self.outputs = {t.name: TensorDecl.from_config(t) for t in config.output}

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    def shape(self, tensor: TensorDecl) -> list[int]:
        """The shape clients see (OIP metadata): -1 leads for the batch dimension."""
        return [-1, *tensor.dims] if self.batching else list(tensor.dims)

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> int:
        """Checks a request's inputs against the config; returns its batch size (1 when not batching)."""
        for name in inputs:
            if name not in self.inputs:
                raise InvalidInput(f"unexpected input '{name}', the model's inputs are {sorted(self.inputs)}")
        rows = None
        for decl in self.inputs.values():
            array = inputs.get(decl.name)
            if array is None:
                if decl.optional:
                    continue
                raise InvalidInput(f"missing input '{decl.name}'")
            self._check_tensor(decl, array)
            if self.batching:
                if rows is None:
                    rows = array.shape[0]
                elif array.shape[0] != rows:
                    raise InvalidInput(
                        f"input '{decl.name}' has batch size {array.shape[0]}, other inputs have {rows}"
                    )
        rows = rows if rows is not None else 1
        if self.batching and not 1 <= rows <= self.max_batch_size:
            raise InvalidInput(f"batch size {rows} is outside 1..{self.max_batch_size} (max_batch_size)")
        return rows

    def _check_tensor(self, decl: TensorDecl, array: np.ndarray) -> None:
        datatype = datatypes.from_numpy(array.dtype)
        if datatype != decl.datatype:
            raise InvalidInput(f"input '{decl.name}' has datatype {datatype}, the model expects {decl.datatype}")
        shape = array.shape[1:] if self.batching else array.shape
        if self.batching and array.ndim == 0:
            shape = None
        if shape is None or len(shape) != len(decl.dims) or any(
            want != -1 and want != got for want, got in zip(decl.dims, shape)
        ):
            raise InvalidInput(
                f"input '{decl.name}' has shape {list(array.shape)}, the model expects {self.shape(decl)}"
            )

    def raw_input(self, body: np.ndarray, model: str) -> dict[str, np.ndarray]:
        """The inputs of a raw binary request (Triton's binary data extension with
        `Inference-Header-Content-Length: 0`): `body`, its bytes (uint8), is the model's one input, shaped
        as Triton shapes it: the input's dims with their one variable dimension taking what the bytes
        hold, behind a batch of 1 when the model batches; a BYTES input of dims [1] holds the body as its
        one element. Refusals in Triton 2.51's words."""
        if len(self.inputs) != 1:
            raise InvalidInput(
                f"Raw request must only have 1 input (found 1) to be deduced but got {len(self.inputs)} inputs"
                f" in '{model}' model configuration"
            )
        decl = next(iter(self.inputs.values()))
        batch = (1,) if self.batching else ()
        if decl.datatype == "BYTES":
            if decl.dims != (1,):
                raise InvalidInput(f"For BYTE datatype raw input '{decl.name}', the model must have input shape [1]")
            element = np.empty(batch + (1,), dtype=object)
            element.flat[0] = body.tobytes()
            return {decl.name: element}
        variable = [axis for axis, size in enumerate(decl.dims) if size == -1]
        if len(variable) > 1:
            raise InvalidInput(
                f"The shape of the raw input '{decl.name}' can not be deduced because there are more than one variable-sized dimension"
            )
        dtype = datatypes.to_numpy(decl.datatype)
        dims = list(decl.dims)
        if variable:
            dims[variable[0]] = body.nbytes // (dtype.itemsize * math.prod(size for size in dims if size != -1) or 1)
        expected = math.prod(dims) * dtype.itemsize
        if expected != body.nbytes:
            raise InvalidInput(f"input byte size mismatch for input 'raw_input' for model '{model}'. Expected {expected}, got {body.nbytes}")
        return {decl.name: body.view(dtype).reshape(batch + tuple(dims))}

    def check_outputs(self, names: Sequence[str]) -> None:
        for name in names:
            if name not in self.outputs:
                raise InvalidInput(f"unknown requested output '{name}', the model's outputs are {sorted(self.outputs)}")

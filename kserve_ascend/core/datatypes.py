"""The three spellings of a tensor datatype: OIP ("FP32"), config.pbtxt (TYPE_FP32) and numpy."""

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

# OIP datatype -> numpy dtype. BYTES tensors are numpy object arrays of `bytes`.
_NUMPY = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_FROM_NUMPY = {dtype: name for name, dtype in _NUMPY.items()}
_FROM_NUMPY[np.dtype(np.bytes_)] = "BYTES"

OIP_DATATYPES = tuple(_NUMPY)


def to_numpy(datatype: str) -> np.dtype:
    """numpy dtype of an OIP datatype; KeyError for an unknown one."""
    return _NUMPY[datatype]


def from_numpy(dtype: np.dtype) -> str:
    """OIP datatype of a numpy dtype (unicode and bytes strings are BYTES)."""
    if dtype.kind in "SU":
        return "BYTES"
    return _FROM_NUMPY[np.dtype(dtype)]


def from_config(data_type: int) -> str:
    """OIP datatype of a config.pbtxt DataType enum value (TYPE_STRING is BYTES)."""
    name = mc.DataType.Name(data_type)
    if name == "TYPE_STRING":
        return "BYTES"
    if name == "TYPE_INVALID" or name == "TYPE_BF16":
        raise ValueError(f"data type {name} is not supported")
    return name.removeprefix("TYPE_")


def to_config(datatype: str) -> int:
    """config.pbtxt DataType enum value of an OIP datatype."""
    return mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")

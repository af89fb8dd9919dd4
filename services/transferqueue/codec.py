"""Columns <-> Arrow: how Python values travel through TransferQueue.

A put takes `columns`: a mapping of field name to one of
  * a torch tensor or numpy array with the row dimension first: 1-D -> SCALAR, N-D -> TENSOR of shape[1:]
  * a list of 1-D sequences (tensors, arrays or lists) -> RAGGED (e.g. token ids of varying length)
  * a list of str -> STRING; a list of Python numbers/bools -> SCALAR
Reads give back torch tensors for SCALAR/TENSOR (dense, never nested), a list of 1-D tensors for
RAGGED (or a padded tensor plus lengths on request) and a list of str for STRING.

Encoding is zero-copy where Arrow allows it (numeric buffers are wrapped, not copied). Decoding
wraps the received buffer in place: tensors share memory with the bytes that came off the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import grpc
import numpy as np
import pyarrow as pa
import torch

from services.transferqueue.errors import TQError
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.transferqueue.wire_format import DTYPE_META, WIRE_TYPES

_TORCH = {
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bool": torch.bool,
}
# dtype name -> (torch dtype, numpy dtype of the wire bits, Arrow type of the wire bits)
DTYPES: dict[str, tuple[torch.dtype, np.dtype, pa.DataType]] = {
    name: (_TORCH[name], np_dtype, arrow_type) for name, (np_dtype, arrow_type) in WIRE_TYPES.items()
}
_TORCH_NAMES = {v[0]: k for k, v in DTYPES.items()}
_NUMPY_NAMES = {v[1]: k for k, v in DTYPES.items() if k != "bfloat16"}


def _invalid(message: str) -> TQError:
    return TQError(grpc.StatusCode.INVALID_ARGUMENT, message)


# ---------------------------------------------------------------------------------------- encode


def _as_numpy(name: str, value) -> tuple[str, np.ndarray]:
    """(dtype name, numpy array holding the wire bits) for a tensor or array."""
    if isinstance(value, torch.Tensor):
        dtype = _TORCH_NAMES.get(value.dtype)
        if dtype is None:
            raise _invalid(f"field {name}: torch dtype {value.dtype} is not supported")
        t = value.detach().cpu().contiguous()
        if dtype == "bfloat16":
            return dtype, t.view(torch.int16).numpy().view(np.uint16)
        return dtype, t.numpy()
    arr = np.ascontiguousarray(value)
    dtype = _NUMPY_NAMES.get(arr.dtype)
    if dtype is None:
        raise _invalid(f"field {name}: numpy dtype {arr.dtype} is not supported")
    return dtype, arr


def _flat_array(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    return pa.array(values.reshape(-1), type=arrow_type)


def _encode_one(name: str, value) -> tuple[pb.FieldSchema, pa.Array]:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        dtype, arr = _as_numpy(name, value)
        if arr.ndim == 0:
            raise _invalid(f"field {name}: a 0-d value has no row dimension")
        wire = DTYPES[dtype][2]
        if arr.ndim == 1:
            return pb.FieldSchema(name=name, dtype=dtype, kind=pb.SCALAR), _flat_array(arr, wire)
        shape = list(arr.shape[1:])
        width = int(np.prod(shape))
        if width == 0:
            raise _invalid(f"field {name}: per-row shape {shape} is empty")
        storage = pa.FixedSizeListArray.from_arrays(_flat_array(arr, wire), width)
        tensor = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(wire, shape), storage)
        return pb.FieldSchema(name=name, dtype=dtype, kind=pb.TENSOR, shape=shape), tensor
    if isinstance(value, (list, tuple)):
        if len(value) == 0:
            raise _invalid(f"field {name}: empty list")
        first = value[0]
        if isinstance(first, str):
            if not all(isinstance(v, str) for v in value):
                raise _invalid(f"field {name}: mixes strings with other values")
            return pb.FieldSchema(name=name, dtype="string", kind=pb.STRING), pa.array(value, type=pa.large_string())
        if isinstance(first, (torch.Tensor, np.ndarray, list, tuple)):
            return _encode_ragged(name, value)
        arr = np.asarray(value)
        if arr.ndim != 1 or arr.dtype == object:
            raise _invalid(f"field {name}: a list must hold strings, numbers or 1-D sequences")
        return _encode_one(name, arr)
    raise _invalid(f"field {name}: unsupported column type {type(value).__name__}")


def _encode_ragged(name: str, seqs: Sequence) -> tuple[pb.FieldSchema, pa.Array]:
    converted = []
    for i, seq in enumerate(seqs):
        typed = isinstance(seq, (torch.Tensor, np.ndarray))
        d, arr = _as_numpy(name, seq if typed else np.asarray(seq))
        if arr.ndim != 1:
            raise _invalid(f"field {name}: ragged row {i} is {arr.ndim}-D; rows must be 1-D sequences")
        # an empty Python list has no dtype of its own: it takes the column's
        converted.append((d, arr, typed or len(arr) > 0))
    dtypes = {d for d, _, known in converted if known}
    if len(dtypes) > 1:
        raise _invalid(f"field {name}: ragged rows mix dtypes {sorted(dtypes)}")
    dtype = dtypes.pop() if dtypes else converted[0][0]
    parts = [arr if known else arr.astype(DTYPES[dtype][1]) for _, arr, known in converted]
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(parts)
    arr = pa.LargeListArray.from_arrays(pa.array(offsets), _flat_array(values, DTYPES[dtype][2]))
    return pb.FieldSchema(name=name, dtype=dtype, kind=pb.RAGGED), arr


def encode_columns(columns: Mapping[str, Any]) -> tuple[int, list[pb.FieldSchema], pa.RecordBatch]:
    """(rows, schemas, record batch) for a put; every column must have the same number of rows."""
    if not columns:
        raise _invalid("a put needs at least one column")
    schemas, arrays, fields = [], [], []
    n_rows = None
    for name, value in columns.items():
        schema, array = _encode_one(name, value)
        if n_rows is None:
            n_rows = len(array)
        elif len(array) != n_rows:
            raise _invalid(f"field {name} has {len(array)} rows; {next(iter(columns))} has {n_rows}")
        schemas.append(schema)
        arrays.append(array)
        fields.append(pa.field(name, array.type, nullable=False, metadata={DTYPE_META: schema.dtype.encode()}))
    assert n_rows is not None  # set by the first of the columns, of which there is at least one
    if n_rows == 0:
        raise _invalid("a put needs at least one row")
    return n_rows, schemas, pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


# ---------------------------------------------------------------------------------------- decode


class Backing:
    """The writable buffers received data lives in. Arrow hands out read-only views of them; knowing
    the owner lets decoding wrap the same memory as a writable tensor instead of copying it."""

    def __init__(self, buffers=()):
        self._regions = []
        for buf in buffers:
            if isinstance(buf, bytearray) and len(buf):
                self._regions.append((np.frombuffer(buf, np.uint8).ctypes.data, len(buf), buf))

    def view(self, address: int, nbytes: int, np_dtype: np.dtype, count: int) -> np.ndarray | None:
        for base, size, owner in self._regions:
            if base <= address and address + nbytes <= base + size:
                return np.frombuffer(owner, dtype=np_dtype, count=count, offset=address - base)
        return None


_NO_BACKING = Backing()


def _numeric(array: pa.Array, dtype: str, backing: Backing = _NO_BACKING) -> torch.Tensor:
    """A torch tensor over the array's values buffer, without copying (bools are unpacked)."""
    torch_dtype, np_dtype, _ = DTYPES[dtype]
    if array.null_count:
        raise TQError(grpc.StatusCode.DATA_LOSS, "stored column has nulls")
    if dtype == "bool":
        return torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())
    buf = array.buffers()[1]
    start = array.offset * np_dtype.itemsize
    values = backing.view(buf.address + start, len(array) * np_dtype.itemsize, np_dtype, len(array))
    if values is None:
        values = np.frombuffer(buf, dtype=np_dtype, count=len(array), offset=start)
        if not values.flags.writeable:  # memory we do not own: copy rather than hand out a read-only tensor
            values = values.copy()
    tensor = torch.from_numpy(values)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


@dataclass
class Batch:
    """Rows read from a partition. `columns[name]` as described in the module docstring; for ragged
    fields read padded, `lengths[name]` holds each row's length."""

    partition: str
    rows: list[int]
    columns: dict[str, Any]
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    lease_id: str = ""
    complete: bool = False  # for claims: the partition is sealed and fully consumed by the task

    def __getitem__(self, name: str):
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.rows)


def decode_column(array: pa.Array, arrow_field: pa.Field, padded: bool, pad_value=0, backing: Backing = _NO_BACKING):
    """-> (value, lengths or None)."""
    dtype = (arrow_field.metadata or {}).get(DTYPE_META, b"").decode()
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if dtype == "string":
        return array.to_pylist(), None
    if dtype not in DTYPES:
        raise TQError(grpc.StatusCode.DATA_LOSS, f"column {arrow_field.name} carries unknown dtype {dtype!r}")
    typ = array.type
    if isinstance(typ, pa.FixedShapeTensorType):
        storage = array.storage
        values = _numeric(storage.flatten(), dtype, backing)
        return values.reshape(len(array), *typ.shape), None
    if pa.types.is_large_list(typ):
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array) + 1, offset=array.offset * 8)
        base = int(offsets[0])
        values = _numeric(array.values.slice(base, int(offsets[-1]) - base), dtype, backing)
        bounds = (offsets - base).tolist()
        lengths = torch.from_numpy(np.diff(offsets))
        if not padded:
            return [values[bounds[i] : bounds[i + 1]] for i in range(len(array))], None
        width = int(lengths.max()) if len(array) else 0
        out = torch.full((len(array), width), pad_value, dtype=values.dtype)
        for i in range(len(array)):
            out[i, : bounds[i + 1] - bounds[i]] = values[bounds[i] : bounds[i + 1]]
        return out, lengths
    return _numeric(array, dtype, backing), None


def decode_table(
    table: pa.Table | pa.RecordBatch, padded: bool | Sequence[str] = False, pad_value=0, backing: Backing = _NO_BACKING
):
    """-> (columns, lengths). `padded`: True for every ragged field, or the names of those to pad.
    `backing`: the received buffers the table was read from (lets tensors share their memory)."""
    columns, lengths = {}, {}
    for i, arrow_field in enumerate(table.schema):
        pad = padded is True or (not isinstance(padded, bool) and arrow_field.name in padded)
        value, lens = decode_column(table.column(i), arrow_field, pad, pad_value, backing)
        columns[arrow_field.name] = value
        if lens is not None:
            lengths[arrow_field.name] = lens
    return columns, lengths

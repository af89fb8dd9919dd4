"""Sluice's Arrow wire format, without torch: what shards need to check and move bytes.

Each field is one Arrow column whose field metadata `sluice.dtype` names the logical dtype:
SCALAR -> the primitive type, TENSOR -> arrow.fixed_shape_tensor, RAGGED -> large_list, STRING ->
large_string; bfloat16 travels as uint16 bits. See proto/sluice/transferqueue/v1/transferqueue.proto.
"""

from __future__ import annotations

import grpc
import numpy as np
import pyarrow as pa

from services.transferqueue.errors import TQError, check_name

DTYPE_META = b"sluice.dtype"

# dtype name -> (numpy dtype of the wire bits, Arrow type of the wire bits)
WIRE_TYPES: dict[str, tuple[np.dtype, pa.DataType]] = {
    "int64": (np.dtype(np.int64), pa.int64()),
    "int32": (np.dtype(np.int32), pa.int32()),
    "int16": (np.dtype(np.int16), pa.int16()),
    "int8": (np.dtype(np.int8), pa.int8()),
    "uint8": (np.dtype(np.uint8), pa.uint8()),
    "float64": (np.dtype(np.float64), pa.float64()),
    "float32": (np.dtype(np.float32), pa.float32()),
    "float16": (np.dtype(np.float16), pa.float16()),
    "bfloat16": (np.dtype(np.uint16), pa.uint16()),  # no Arrow bf16: raw bits
    "bool": (np.dtype(np.bool_), pa.bool_()),
}


def _invalid(message: str) -> TQError:
    return TQError(grpc.StatusCode.INVALID_ARGUMENT, message)


def to_ipc(batch: pa.RecordBatch | pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write(batch)
    return sink.getvalue()


def from_ipc(data) -> pa.Table:
    """Parse one Arrow IPC stream; malformed bytes are INVALID_ARGUMENT."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, ValueError, OSError) as exc:
        raise _invalid(f"malformed Arrow IPC stream: {exc}") from None


def check_wire_schema(schema: pa.Schema) -> None:
    """Reject Arrow data that no Sluice client could decode (a shard is exposed to any client)."""
    if len(schema) == 0:
        raise _invalid("Arrow data has no columns")
    for arrow_field in schema:
        check_name("field", arrow_field.name)
        dtype = (arrow_field.metadata or {}).get(DTYPE_META, b"").decode()
        typ = arrow_field.type
        if dtype == "string":
            ok = pa.types.is_large_string(typ)
        elif dtype in WIRE_TYPES:
            wire = WIRE_TYPES[dtype][1]
            if isinstance(typ, pa.FixedShapeTensorType):
                ok = typ.value_type == wire
            elif pa.types.is_large_list(typ):
                ok = typ.value_type == wire
            else:
                ok = typ == wire
        else:
            raise _invalid(f"column {arrow_field.name}: metadata {DTYPE_META.decode()}={dtype!r} is not a known dtype")
        if not ok:
            raise _invalid(f"column {arrow_field.name}: Arrow type {typ} does not carry dtype {dtype}")

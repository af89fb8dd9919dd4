"""Sluice's Arrow wire format, without torch: what shards need to check and move bytes.

Each field is one Arrow column whose field metadata `sluice.dtype` names the logical dtype:
SCALAR -> the primitive type, TENSOR -> arrow.fixed_shape_tensor, RAGGED -> large_list, STRING ->
large_string; bfloat16 travels as uint16 bits. See proto/sluice/transferqueue/v1/transferqueue.proto.
"""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pyarrow as pa

from services.transferqueue.errors import TQError, check_name

# pyarrow imports pandas (when it is installed) the first time it converts a numpy array: ~170 ms, measured as
# a storage shard's event loop blocked for 120-140 ms at its first non-contiguous read, in the middle of a run.
# Every process that moves Sluice's Arrow data imports this module, so it is paid here, at start-up.
pa.array(np.zeros(1, dtype=np.int64))

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


def _check_buffers(array: pa.Array, low: int, high: int, column: str) -> None:
    """Every buffer must lie inside the received bytes: Arrow read from a buffer wraps it, so a buffer
    elsewhere means the sender compressed the body (decompressed sizes are the sender's word)."""
    for buf in array.buffers():
        if buf is not None and buf.size and not (low <= buf.address and buf.address + buf.size <= high):
            raise _invalid(f"column {column}: compressed or out-of-band Arrow buffers are not accepted")


def _check_no_nulls(array: pa.Array, column: str) -> None:
    while True:
        if array.null_count:
            raise _invalid(f"column {column} has nulls; Sluice columns never do")
        if isinstance(array, pa.ExtensionArray):
            array = array.storage
        elif isinstance(array, (pa.FixedSizeListArray, pa.LargeListArray)):
            array = array.values
        else:
            return


def check_tensor_type(column: str, typ: pa.DataType, max_row_elements: int, max_rank: int) -> None:
    shape = list(typ.shape)
    if not 1 <= len(shape) <= max_rank or any(d < 1 for d in shape):
        raise _invalid(f"column {column}: tensor shape {shape} needs 1-{max_rank} positive dims")
    width = int(np.prod(shape, dtype=object))
    if width > max_row_elements:
        raise _invalid(f"column {column}: tensor shape {shape} has more than {max_row_elements} elements per row")
    if typ.storage_type.list_size != width:
        raise _invalid(
            f"column {column}: tensor storage holds {typ.storage_type.list_size} values per row, "
            f"shape {shape} needs {width}"
        )
    if typ.permutation is not None and list(typ.permutation) != list(range(len(shape))):
        raise _invalid(f"column {column}: permuted tensors are not accepted")


def _flatbuffer_field(buf: bytes, table: int, index: int) -> int | None:
    """Position of field `index` of the flatbuffer table at `table`; None when the field is absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    slot = 4 + 2 * index
    if slot + 2 > struct.unpack_from("<H", buf, vtable)[0]:
        return None
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else None


def _body_compressed(metadata: bytes) -> bool:
    """Whether an IPC message (Arrow's Message.fbs) is a record/dictionary batch with a `compression`
    field: read from the metadata alone, so a compressed body is refused before it is inflated."""
    root = struct.unpack_from("<I", metadata, 0)[0]
    kind_at = _flatbuffer_field(metadata, root, 1)  # Message.header_type: 2 dictionary, 3 record batch
    kind = metadata[kind_at] if kind_at is not None else 0
    if kind not in (2, 3):
        return False
    # a missing header field (None) raises TypeError here, which the caller reports as a malformed stream
    at = _flatbuffer_field(metadata, root, 2)
    table = at + struct.unpack_from("<I", metadata, at)[0]  # type: ignore[arg-type]
    if kind == 2:  # DictionaryBatch.data is the RecordBatch
        at = _flatbuffer_field(metadata, table, 1)
        table = at + struct.unpack_from("<I", metadata, at)[0]  # type: ignore[arg-type]
    return _flatbuffer_field(metadata, table, 3) is not None  # RecordBatch.compression


def _refuse_compression(buffer: pa.Buffer) -> None:
    try:
        for message in pa.ipc.MessageReader.open_stream(buffer):
            if _body_compressed(message.metadata.to_pybytes()):
                raise _invalid(
                    "compressed Arrow IPC bodies are not accepted (their inflated size is the sender's word)"
                )
    except (pa.ArrowException, ValueError, OSError, struct.error, IndexError, TypeError) as exc:
        raise _invalid(f"malformed Arrow IPC stream: {exc}") from None


def from_untrusted_ipc(data, max_row_elements: int, max_rank: int = 8) -> pa.Table:
    """Parse and fully validate an Arrow IPC stream from outside (a shard's put) before anything keeps it:
    `validate(full=True)` on every record batch (offsets within their values, lengths consistent),
    the wire schema, tensor shapes, no nulls, no compressed bodies (refused from the message metadata,
    before anything is inflated), and every buffer inside the received bytes."""
    buffer = pa.py_buffer(data)
    low, high = buffer.address, buffer.address + buffer.size
    _refuse_compression(buffer)
    try:
        reader = pa.ipc.open_stream(buffer)
        check_wire_schema(reader.schema)
        batches = []
        for batch in reader:
            batch.validate(full=True)
            batches.append(batch)
        table = pa.Table.from_batches(batches, schema=reader.schema)
    except (pa.ArrowInvalid, pa.ArrowException, ValueError, OSError, TypeError) as exc:
        raise _invalid(f"malformed Arrow IPC stream: {exc}") from None
    if len(set(table.schema.names)) != len(table.schema.names):
        raise _invalid("Arrow data names a column twice")
    for arrow_field in table.schema:
        if isinstance(arrow_field.type, pa.FixedShapeTensorType):
            check_tensor_type(arrow_field.name, arrow_field.type, max_row_elements, max_rank)
    for batch in batches:
        for arrow_field, array in zip(batch.schema, batch.columns):
            _check_no_nulls(array, arrow_field.name)
            _check_buffers(array, low, high, arrow_field.name)
    return table


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

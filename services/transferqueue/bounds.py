"""Input bounds of the data plane, checked in Python before any Redis function runs or any byte is stored.

Every count, row index, lease length, size and schema a caller sends is checked here against the
server's limits (flags of `sluice tq-controller` / `sluice tq-shard`), so a Redis function only ever
sees numbers it can handle in bounded work, and a rejected call changes nothing. A violation is
INVALID_ARGUMENT naming the field and the limit; `RESOURCE_EXHAUSTED` is for sizes (bytes) over a cap.

    row index r valid   <=>  0 <= r < max_partition_rows
    row list valid      <=>  len(rows) <= max_rows_per_call, every index valid, no repeats
    tensor shape valid  <=>  1 <= rank <= MAX_TENSOR_RANK, every dim >= 1, prod(shape) <= max_row_elements
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from services.transferqueue.errors import TQError, check_name
from services.transferqueue.pb import transferqueue_pb2 as pb
from services.transferqueue.wire_format import WIRE_TYPES

# the dtype allow-list: what FieldSchema.dtype may name (string only with kind STRING)
DTYPE_NAMES = frozenset(WIRE_TYPES) | {"string"}
MAX_TENSOR_RANK = 8
_KINDS = frozenset({pb.SCALAR, pb.TENSOR, pb.RAGGED, pb.STRING})


@dataclass(frozen=True)
class Limits:
    """The caps one server enforces (filled from its config)."""

    max_rows_per_call: int
    max_partition_rows: int
    max_fields_per_call: int = 256
    max_row_elements: int = 1 << 24


def invalid(message: str) -> TQError:
    return TQError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_int(name: str, value: int, low: int, high: int) -> int:
    """`low <= value <= high`, else INVALID_ARGUMENT naming `name` and the range."""
    if not low <= value <= high:
        raise invalid(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_rows(name: str, rows, limits: Limits, allow_repeats: bool = False) -> list[int]:
    """A list of row indices: at most max_rows_per_call of them, each in [0, max_partition_rows)."""
    if len(rows) > limits.max_rows_per_call:
        raise invalid(
            f"{name} names {len(rows)} rows; at most {limits.max_rows_per_call} per call "
            "(--max-rows-per-call): split it"
        )
    out = list(rows)
    if out and (min(out) < 0 or max(out) >= limits.max_partition_rows):
        bad = next(r for r in out if r < 0 or r >= limits.max_partition_rows)
        raise invalid(f"{name}: row index {bad} is outside [0, {limits.max_partition_rows}) (--max-partition-rows)")
    if not allow_repeats and len(set(out)) != len(out):
        raise invalid(f"{name}: row indices repeat")
    return out


def check_field_names(name: str, fields, limits: Limits) -> list[str]:
    if len(fields) > limits.max_fields_per_call:
        raise invalid(f"{name} names {len(fields)} fields; at most {limits.max_fields_per_call}")
    out = [check_name("field", f) for f in fields]
    if len(set(out)) != len(out):
        raise invalid(f"{name}: a field appears twice")
    return out


def check_shape(field: str, shape, limits: Limits) -> None:
    if not 1 <= len(shape) <= MAX_TENSOR_RANK or any(d < 1 for d in shape):
        raise invalid(f"tensor field {field} needs a shape of 1-{MAX_TENSOR_RANK} positive dims, got {list(shape)}")
    if any(d > limits.max_row_elements for d in shape) or math.prod(shape) > limits.max_row_elements:
        raise invalid(
            f"tensor field {field}: shape {list(shape)} has more than {limits.max_row_elements} elements per row"
        )


def check_schemas(fields, limits: Limits) -> None:
    """FieldSchemas of a put or commit: names, kind, dtype from the allow-list, shape only for TENSOR."""
    if not fields:
        raise invalid("a put needs at least one field")
    check_field_names("fields", [f.name for f in fields], limits)
    for f in fields:
        if f.kind not in _KINDS:
            raise invalid(f"field {f.name} has no valid kind (got {f.kind})")
        if f.dtype not in DTYPE_NAMES:
            raise invalid(f"field {f.name}: dtype {f.dtype!r} is not one of {sorted(DTYPE_NAMES)}")
        if (f.dtype == "string") != (f.kind == pb.STRING):
            raise invalid(f"field {f.name}: dtype string goes with kind STRING only")
        if f.kind == pb.TENSOR:
            check_shape(f.name, f.shape, limits)
        elif f.shape:
            raise invalid(f"field {f.name}: only TENSOR fields have a shape")

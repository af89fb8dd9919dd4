"""Flat buckets of named tensors: how weights travel in a sync.

Tensors are laid out in order into uint8 buckets of at most `bucket_bytes` (a tensor larger than that
gets a bucket of its own), each at an 8-byte-aligned offset, or, for SGLang's flattened_bucket form, back to
back (packed). Receivers allocate the same buckets from the published metadata and view the tensors out of
them without copying."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from services.dcs.sync.messages import WeightTensor
from services.dcs.sync.precision import FLOATING

_ALIGN = 8
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
TORCH_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


@runtime_checkable
class WeightStream(Protocol):
    """Weights that exist only a few at a time: a sharded trainer gathers each tensor from its ranks (a
    collective), so the publisher takes them in order, one bucket's worth before packing it, and never holds
    the whole model. The source's other ranks produce the same sequence; `close` produces (and drops) what
    was not taken, so a publish that failed half-way leaves no peer waiting."""

    def specs(self) -> list[tuple[str, torch.Tensor]]:
        """Every (name, tensor) to come, in order, as shape-only (meta) tensors."""

    def take(self, count: int) -> list[tuple[str, torch.Tensor]]:
        """The next `count` tensors, in order."""

    def close(self) -> None: ...


def plan_buckets(
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, wire: torch.dtype | None = None, packed: bool = False
) -> tuple[list[WeightTensor], list[int]]:
    """Entries and bucket sizes for `named`; floating tensors travel as `wire` when given (precision.py).
    packed: SGLang's flattened_bucket layout (packed_entries): each bucket's tensors back to back, which SGLang
    can view out only at offsets that are multiples of the tensor's dtype size, so a tensor that would land
    anywhere else starts a new bucket (a bfloat16 tensor of odd length followed by an int64 one)."""
    entries: list[WeightTensor] = []
    sizes: list[int] = []
    used = 0
    for name, tensor in named:
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be synced")
        dtype = wire if wire is not None and tensor.dtype in FLOATING else tensor.dtype
        nbytes = tensor.numel() * dtype.itemsize
        start = used if packed else -(-used // _ALIGN) * _ALIGN
        if not sizes or start % dtype.itemsize or (start + nbytes > bucket_bytes and used > 0):
            sizes.append(0)
            start = 0
        entries.append(
            WeightTensor(
                name=name,
                dtype=_DTYPE_NAMES[dtype],
                shape=list(tensor.shape),
                bucket=len(sizes) - 1,
                offset=start,
                nbytes=nbytes,
            )
        )
        used = start + nbytes
        sizes[-1] = used
    return entries, sizes


def pack(
    bucket: int,
    entries: Sequence[WeightTensor],
    size: int,
    tensors: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One flat uint8 bucket holding copies of its tensors, each in its entry's dtype (written into `out` when
    given). The cast runs where the tensor lives (the trainer's GPU), so only the wire's bytes cross to `out`."""
    flat = out if out is not None else torch.empty(size, dtype=torch.uint8, device=device)
    for e in entries:
        if e.bucket == bucket and e.nbytes:
            src = tensors[e.name].detach().to(TORCH_DTYPES[e.dtype]).contiguous().reshape(-1).view(torch.uint8)
            flat[e.offset : e.offset + e.nbytes].copy_(src)
    return flat


def unpack(bucket: int, entries: Sequence[WeightTensor], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of the bucket's tensors (no copy)."""
    out = {}
    for e in entries:
        if e.bucket == bucket:
            dtype = TORCH_DTYPES[e.dtype]
            out[e.name] = flat[e.offset : e.offset + e.nbytes].view(dtype).reshape(e.shape)
    return out


def _described_nbytes(name: str, dtype: str, shape: Sequence[int]) -> int:
    """The bytes of a tensor a peer describes, its dtype and shape checked (ValueError naming it)."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"{name}: unknown dtype {dtype!r}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{name}: bad shape {shape!r}")
    nbytes = TORCH_DTYPES[dtype].itemsize
    for d in shape:
        nbytes *= d
    return nbytes


def bucket_entries(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], offsets: Sequence[int], size: int
) -> list[WeightTensor]:
    """The entries of one bucket described by a peer (names, dtypes, shapes, byte offsets, bucket size),
    checked: known dtypes, non-negative shapes, 8-byte-aligned offsets in order, every tensor inside the
    bucket, none overlapping the one before, and the bucket ending where its last tensor does. Raises
    ValueError naming the first bad entry."""
    if not len(names) == len(dtypes) == len(shapes) == len(offsets):
        raise ValueError("names, dtypes, shapes and offsets differ in length")
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"bucket size {size!r} is not a byte count")
    entries, used = [], 0
    for name, dtype, shape, offset in zip(names, dtypes, shapes, offsets):
        nbytes = _described_nbytes(name, dtype, shape)
        if not isinstance(offset, int) or offset % _ALIGN or offset < used or offset + nbytes > size:
            raise ValueError(f"{name}: offset {offset!r} ({nbytes} bytes) does not fit the bucket of {size}")
        entries.append(WeightTensor(name=name, dtype=dtype, shape=list(shape), bucket=0, offset=offset, nbytes=nbytes))
        used = offset + nbytes
    if size != used:  # no slack: the buffer a peer makes us allocate is exactly what it names
        raise ValueError(f"bucket size {size} differs from the {used} bytes its tensors end at")
    return entries


def packed_entries(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> tuple[list[WeightTensor], int]:
    """SGLang's `flattened_bucket` layout (its FlattenedTensorBucket): the tensors back to back in one uint8
    bucket, each at an offset that is a multiple of its dtype's size. The entries and the bucket's size;
    ValueError naming the first bad entry."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes differ in length")
    entries, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        nbytes = _described_nbytes(name, dtype, shape)
        if offset % TORCH_DTYPES[dtype].itemsize:
            raise ValueError(f"{name}: byte offset {offset} is not aligned to its {dtype}")
        entries.append(WeightTensor(name=name, dtype=dtype, shape=list(shape), bucket=0, offset=offset, nbytes=nbytes))
        offset += nbytes
    return entries, offset

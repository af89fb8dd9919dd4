"""A CUDA tensor shared with another process on the same GPU through a CUDA IPC handle, described in JSON.

SGLang's /update_weights_from_tensor carries such handles pickled (torch's MultiprocessingSerializer); Sluice never
unpickles what crosses a process boundary, so the description here is plain JSON: the storage's IPC handle (base64),
its size and offset, the reference-counter handle torch keeps the memory alive with until every receiver let go, the
event the receiver waits on (the sender's copy into the bucket is finished), and where the tensor sits in the
storage. Only flat uint8 buckets travel this way (the layout of services/dcs/sync/layout.py); the receiver copies its
tensors out before it answers, so the sender may reuse the bucket once every receiver answered.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_BYTES = 1 << 44


class SharedBucket(BaseModel):
    """A flat uint8 CUDA tensor of `numel` bytes, shared by IPC handle."""

    model_config = ConfigDict(extra="forbid")
    device: int = Field(ge=0, le=1024)
    handle: str = Field(min_length=1, max_length=4096, description="base64 cudaIpcMemHandle of the storage")
    storage_size_bytes: int = Field(ge=0, le=MAX_BYTES)
    storage_offset_bytes: int = Field(ge=0, le=MAX_BYTES)
    ref_counter_handle: str = Field(max_length=4096, description="base64 name of torch's shared reference counter")
    ref_counter_offset: int = Field(ge=0, le=MAX_BYTES)
    event_handle: str | None = Field(None, max_length=4096, description="base64 cudaIpcEventHandle, if any")
    event_sync_required: bool = False
    tensor_offset: int = Field(ge=0, le=MAX_BYTES, description="the bucket's first byte in its storage")
    numel: int = Field(ge=0, le=MAX_BYTES)

    @model_validator(mode="after")
    def _inside_storage(self) -> "SharedBucket":
        if self.tensor_offset + self.numel > self.storage_size_bytes:
            raise ValueError(
                f"{self.numel} bytes at {self.tensor_offset} overrun a storage of {self.storage_size_bytes}"
            )
        return self


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def share(flat: torch.Tensor) -> dict[str, Any]:
    """The JSON description of a flat uint8 CUDA tensor (the sender keeps `flat` alive until receivers answer)."""
    if flat.device.type != "cuda" or flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("only a contiguous 1-D uint8 CUDA tensor is shared by IPC handle")
    storage = flat.untyped_storage()
    (device, handle, size, offset, counter, counter_offset, event, event_sync) = storage._share_cuda_()
    return SharedBucket(
        device=device,
        handle=_b64(handle),
        storage_size_bytes=size,
        storage_offset_bytes=offset,
        ref_counter_handle=_b64(counter) or "",
        ref_counter_offset=counter_offset,
        event_handle=_b64(event),
        event_sync_required=bool(event_sync),
        tensor_offset=flat.storage_offset(),
        numel=flat.numel(),
    ).model_dump()


def open_shared(bucket: SharedBucket, device: torch.device) -> torch.Tensor:
    """A copy of the bucket another process shared, on `device`: this process's index of the same GPU (which may
    differ from the sender's `bucket.device` under another CUDA_VISIBLE_DEVICES; the publisher matched the two by
    UUID). The shared memory is released when this returns (torch's reference counter tells the sender)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        base64.b64decode(bucket.handle),
        bucket.storage_size_bytes,
        bucket.storage_offset_bytes,
        base64.b64decode(bucket.ref_counter_handle),
        bucket.ref_counter_offset,
        base64.b64decode(bucket.event_handle) if bucket.event_handle else None,
        bucket.event_sync_required,
    )
    shared = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    shared.set_(storage, bucket.tensor_offset, (bucket.numel,), (1,))
    copied = shared.clone()
    del shared, storage
    return copied

"""The engine's KV pool: every running sequence's keys and values in one allocation, made once.

Layout: keys and values are each `[layers, slots, kv_heads, slot_len, head_dim]`. A running sequence owns one
slot (a row of `slot_len` positions, the context length) from admission until it finishes or is retracted;
`lengths[slot]` says how many positions hold valid keys and values.

Why slots and not pages: a decode step attends every running sequence in one call per layer. With slots the
keys of a batch whose slots are consecutive are a strided *view* of the pool (no copy), and otherwise one
`index_select` over the slot dimension. A paged pool needs a gather through the block table on every layer of
every step; measured on this 2-core CPU (64 sequences, 4 KV heads x 32 dims, ~60 positions each) that gather
cost about as much as the attention itself, and without an attention kernel that reads pages in place (the
GPU kernels SGLang and vLLM use) there is nothing to win it back. The price of slots is memory: each slot
reserves the whole context length, so the pool holds `max_total_tokens // context_length` sequences at once.

The n samples of one prompt share its prefill: the prompt is computed once in the first sample's slot and
its keys and values are copied (`copy_prefix`, one copy per step, not a forward pass) into its siblings' slots.

`free_storage` gives the pool's memory back (SGLang's /release_memory_occupation, tag kv_cache) and
`restore_storage` takes it again, empty. Both resize the tensors' storages in place rather than replacing the
tensors: the decoder holds views of the pool per layer (batched_decoder.py), and a view follows its storage.
"""

from __future__ import annotations

import heapq

import torch


class PoolFull(RuntimeError):
    """No free slot: the caller keeps the request waiting."""


class KVPool:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        slots: int,
        slot_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if slots < 1 or slot_len < 2:
            raise ValueError(f"a KV pool needs at least one slot of two positions (got {slots} x {slot_len})")
        shape = (layers, slots, kv_heads, slot_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = slots
        self.slot_len = slot_len
        self.lengths = [0] * slots
        self._free = list(range(slots))  # a heap: the lowest free slot first keeps batches packed

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_tokens(self) -> int:
        return sum(self.lengths)

    def allocate(self) -> int:
        if not self._free:
            raise PoolFull("every KV slot is in use")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def release_all(self) -> None:
        self.lengths = [0] * self.slots
        self._free = list(range(self.slots))

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """The first `length` positions of slot `src` into every slot of `dst` (one copy per tensor)."""
        if not dst:
            return
        index = torch.tensor(dst, device=self.keys.device)
        for store in (self.keys, self.values):
            store[:, index, :, :length] = store[:, src : src + 1, :, :length]
        for slot in dst:
            self.lengths[slot] = length

    def move_down(self, slot: int) -> int:
        """Move a sequence into the lowest free slot if that is below `slot` (its keys and values are copied):
        keeps running sequences in consecutive slots, so a decode batch reads a view of the pool."""
        if not self._free or self._free[0] > slot:
            return slot
        target = heapq.heappop(self._free)
        length = self.lengths[slot]
        for store in (self.keys, self.values):
            store[:, target, :, :length] = store[:, slot, :, :length]
        self.lengths[target] = length
        self.release(slot)
        return target

    def nbytes(self) -> int:
        """What the pool takes when allocated (also while its storage is freed)."""
        return self.keys.numel() * self.keys.element_size() * 2

    def resident_bytes(self) -> int:
        """What the pool holds now: nbytes(), or 0 while its storage is freed."""
        return sum(store.untyped_storage().nbytes() for store in (self.keys, self.values))

    def free_storage(self) -> None:
        """Every slot freed and the keys' and values' memory given back (on CUDA to PyTorch's cache; the caller
        empties that). Nothing may read the pool until restore_storage."""
        self.release_all()
        for store in (self.keys, self.values):
            store.untyped_storage().resize_(0)

    def restore_storage(self) -> None:
        """The memory free_storage gave back, allocated again and zeroed: an empty pool, as after start."""
        for store in (self.keys, self.values):
            store.untyped_storage().resize_(store.numel() * store.element_size())
            store.zero_()

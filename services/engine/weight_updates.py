"""The built-in engine's side of SGLang's distributed weight update, without stopping generation.

    /init_weights_update_group       join the trainer's broadcast group (blocks until everyone joined)
    /begin_weight_update             (optional, SGLang 0.5.23) what follows is one version: hold it back
    /update_weights_from_distributed receive the named tensors, one broadcast each (or, with Sluice's
                                     `flat_bucket` extension, one broadcast of the whole bucket), into fresh
                                     buffers
    /end_weight_update               load everything received since begin at once

Receiving runs on a worker thread while the engine thread keeps decoding: the buffers are new memory, so no
forward pass ever reads a half-received tensor. Loading (copying the buffers into the model) runs on the
engine thread between two steps, so every step computes with exactly one version, and every token's
weight-version span is exact. When the trainer pauses the engine first (pause modes abort, in_place,
retract) the load happens while paused, as before; with no pause (the trainer's `--pause-mode none`)
requests keep running across the update and their tokens after it carry the new version, as an
in_place pause would give them, minus the stall. A received version is loaded:
  * at /end_weight_update, when the update was bracketed by begin/end (all buckets at once);
  * otherwise at the end of each /update_weights_from_distributed call, unless the engine is paused;
  * otherwise at /continue_generation.
A failed receive drops everything received for that version: the previous weights keep serving. Floating tensors
may arrive in any floating dtype and are cast on load (services/dcs/sync/precision.py); a name or shape that does
not fit the model is refused (WeightMismatch) as soon as its broadcast is received. A LoRA adapter (tensors under
peft's names, with the update's `lora_scaling`) is merged into the base weights on load, which it keeps
(services/engine/adapter_merge.py)."""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from services.dcs.sync.groups import BroadcastGroup
from services.dcs.sync.layout import TORCH_DTYPES, bucket_entries, packed_entries, unpack
from services.dcs.sync.precision import WeightMismatch, check_fits, load_into, model_tensors
from services.engine.adapter_merge import MergedAdapter, adapter_pairs, adapter_part, check_adapter
from services.dcs.sync.cuda_ipc import open_shared
from services.engine.protocol import UpdateWeightsFromDiskRequest, UpdateWeightsFromTensorRequest, UpdateWeightsRequest
from services.model.weight_files import read_weight_files
from services.runtime.spans import RECORDER


class WeightUpdates:
    def __init__(
        self,
        model: torch.nn.Module,
        scheduler,
        device: str,
        on_version: Callable[[], None] = lambda: None,
        bracket_timeout_s: float = 120.0,
    ):
        self.model = model
        # a begin whose end never came (the trainer died) stops holding versions back after this long
        self.bracket_timeout_s = bracket_timeout_s
        self._begun = 0.0
        self.on_version = on_version  # called on the engine thread after a new version went live
        self.scheduler = scheduler
        self.device = device
        self._params = model_tensors(model)  # name -> tensor, what a received tensor must fit
        self._adapter = MergedAdapter(self._params)  # a LoRA run's: the base weights it is merged into
        self._staged_scaling: float | None = None  # alpha / r of a staged adapter
        self.groups: dict[str, BroadcastGroup] = {}
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version: str | None = None
        self._bracketed = False
        self._lock = threading.Lock()

    def begin(self) -> str:
        with self._lock:
            self._staged, self._staged_version, self._bracketed = {}, None, True
            self._begun = time.monotonic()
        return "receiving a weight update"

    def receive(self, body: UpdateWeightsRequest) -> None:
        """Any thread but the engine's: the named tensors from rank 0, one broadcast each in list order or the
        whole bucket in one (flat_bucket)."""
        group = self.groups.get(body.group_name)
        if group is None:
            raise ValueError(f"no weight update group {body.group_name!r}; call /init_weights_update_group")
        if body.load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format {body.load_format!r}: only SGLang's default and flattened_bucket")
        receive = (
            self._receive_flat
            if body.flat_bucket
            else self._receive_packed
            if body.load_format == "flattened_bucket"
            else self._receive_each
        )
        self._stage(lambda: receive(group, body), body.weight_version, body.lora_scaling)

    def receive_shared(self, body: UpdateWeightsFromTensorRequest) -> None:
        """Any thread but the engine's: a bucket on this engine's GPU that the trainer shared by CUDA IPC handle
        (/update_weights_from_tensor, load_format sluice_cuda_ipc), copied out before the call answers."""
        if body.serialized_named_tensors is not None or body.bucket is None:
            raise ValueError(
                "pickled tensors (SGLang's serialized_named_tensors) are refused: this engine never "
                "unpickles request data; send `bucket` with load_format sluice_cuda_ipc"
            )
        if body.load_format != "sluice_cuda_ipc":
            raise ValueError(f"load_format {body.load_format!r}: only sluice_cuda_ipc is served")
        if not self.device.startswith("cuda"):
            raise ValueError("a CUDA IPC weight update needs an engine on a GPU; this one runs on " + self.device)
        bucket = body.bucket
        entries = bucket_entries(bucket.names, bucket.dtypes, bucket.shapes, bucket.offsets, bucket.shared.numel)
        self._stage(
            lambda: unpack(0, entries, open_shared(bucket.shared, torch.device(self.device))),
            body.weight_version,
            body.lora_scaling,
        )

    def read_files(self, body: UpdateWeightsFromDiskRequest) -> None:
        """Any thread but the engine's: the weights of a model directory (SGLang's /update_weights_from_disk),
        read and checked, staged for the next load."""
        self._stage(lambda: read_weight_files(body.model_path), body.weight_version)

    def _stage(
        self, fetch: Callable[[], dict[str, torch.Tensor]], version: str | None, scaling: float | None = None
    ) -> None:
        """Fetch a bucket's tensors and stage them for the next load; a failure drops everything staged for
        this version, so nothing of a failed update is ever loaded."""
        began = time.time()
        try:
            received = fetch()
            # checked once the transfer is drained (refusing before it would leave the sender waiting): a
            # mismatch is refused here, naming the tensor, and the load between steps never meets one
            adapter = {n: t for n, t in received.items() if adapter_part(n)}
            check_fits(self._params, {n: t for n, t in received.items() if n not in adapter})
            check_adapter(self._params, adapter)
            if adapter and not scaling:
                raise WeightMismatch(
                    f"received LoRA adapter tensors ({next(iter(adapter))}, ...) without the "
                    "update's lora_scaling (alpha / r)"
                )
        except Exception:
            with self._lock:
                self._staged, self._staged_version, self._bracketed = {}, None, False
            raise
        with self._lock:
            self._staged.update(received)
            self._staged_version = version or self._staged_version
            self._staged_scaling = scaling or self._staged_scaling
        RECORDER.record("weight_load", began, time.time(), version=self._staged_version)

    def _receive_each(self, group: BroadcastGroup, body: UpdateWeightsRequest) -> dict[str, torch.Tensor]:
        """SGLang's transfer: one broadcast per tensor, in list order."""
        received = {}
        for name, dtype, shape in zip(body.names, body.dtypes, body.shapes, strict=True):
            if dtype not in TORCH_DTYPES or any(d < 0 for d in shape):
                raise ValueError(f"{name}: bad dtype {dtype!r} or shape {shape!r}")
            tensor = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=self.device)
            group.broadcast(tensor, 0)
            received[name] = tensor
        return received

    def _receive_packed(self, group: BroadcastGroup, body: UpdateWeightsRequest) -> dict[str, torch.Tensor]:
        """SGLang's `load_format: "flattened_bucket"`: the call's tensors back to back in one uint8 broadcast
        (layout.packed_entries), viewed out without a copy."""
        return self._receive_bucket(group, *packed_entries(body.names, body.dtypes, body.shapes))

    def _receive_flat(self, group: BroadcastGroup, body: UpdateWeightsRequest) -> dict[str, torch.Tensor]:
        """Sluice's extension (`flat_bucket: {offsets, nbytes}`): the bucket's tensors in one uint8 broadcast
        at the given byte offsets (the layout of services/dcs/sync/layout.py), viewed out without a copy. One
        broadcast instead of one per tensor: a receive that competes with decoding for the GIL takes a
        fraction of the time."""
        bucket = body.flat_bucket
        if bucket is None:  # receive() chose this transfer because the request has one
            raise ValueError("a flat_bucket transfer without its flat_bucket (offsets, nbytes)")
        entries = bucket_entries(body.names, body.dtypes, body.shapes, bucket.offsets, bucket.nbytes)
        return self._receive_bucket(group, entries, bucket.nbytes)

    def _receive_bucket(self, group: BroadcastGroup, entries, size: int) -> dict[str, torch.Tensor]:
        """One uint8 broadcast of `size` bytes, its tensors viewed out at their entries without a copy."""
        flat = torch.empty(size, dtype=torch.uint8, device=self.device)
        group.broadcast(flat, 0)
        return unpack(0, entries, flat)

    def discard(self) -> None:
        """Drop everything staged and an open begin/end: the weights it was for were released."""
        with self._lock:
            self._staged, self._staged_version, self._bracketed = {}, None, False

    def load_unless_held(self) -> str:
        """Engine thread, after a receive: load now unless begin/end or a pause holds the version back."""
        if self._bracketed and time.monotonic() - self._begun < self.bracket_timeout_s:
            return "staged until /end_weight_update"
        if self.scheduler.paused:
            return "staged until /continue_generation"
        return self.load()

    def end(self) -> str:
        """Engine thread: the bracketed version goes live."""
        self._bracketed = False
        return self.load()

    def load(self) -> str:
        """Engine thread, between steps: every staged tensor into the model at once, then the version."""
        with self._lock:
            staged, version, scaling = self._staged, self._staged_version, self._staged_scaling
            self._staged, self._staged_version, self._staged_scaling = {}, None, None
        if not staged:
            return "nothing staged"
        adapter = {n: t for n, t in staged.items() if adapter_part(n)}
        full = {n: t for n, t in staged.items() if n not in adapter}
        adapter_pairs(adapter)  # a whole adapter, checked before anything changes
        if adapter and scaling is None:  # _stage refuses an adapter that comes without it
            raise WeightMismatch("a LoRA adapter is staged without its lora_scaling (alpha / r)")
        load_into(self.model, full)
        self._adapter.rebase(full)
        if adapter and scaling is not None:
            self._adapter.apply(adapter, scaling)
        if version is not None:
            self.scheduler.weight_version = str(version)
            self.on_version()
        return f"loaded {len(staged)} tensors"

"""SGLang's /release_memory_occupation and /resume_memory_occupation on the built-in engine: give the KV pool's
and the weights' memory back while a trainer on the same device needs it, and take it again after.

SGLang (0.5.23; its scheduler's weight updater handles both) names three memory regions by tag: `kv_cache`, `weights`, `cuda_graph`; no tags (null or []) means all three. Release asserts the scheduler
is idle (no running batch; a waiting queue only while generation is paused), flushes the cache and pauses
each region; resume re-maps them. Their contents after resume: the KV cache is empty, the weights are
whatever the re-mapped memory holds (SGLang keeps only the model's buffers, unless weights were backed up to
the CPU), so an RL trainer sends its weights after resuming "weights" and before resuming "kv_cache".

Here, on the engine thread between steps (scheduler.py):
  * kv_cache: every slot freed and the pool's storage resized to nothing (kv_pool.py), the n-gram index that
    speculative decoding drafts from emptied (SGLang's cache flush); on resume the pool is allocated again,
    zeroed and empty.
  * weights: every parameter's storage resized to nothing (views such as the decoder's fused weights follow
    their storage); an update staged but not loaded is dropped. Buffers (the rotary tables) are kept, as
    SGLang keeps them. On resume the storage is allocated again and zero-filled: the model generates from
    zeros until a weight update loads real weights.
  * cuda_graph: accepted and recorded; the engine captures no CUDA graphs, so there is nothing to free.
On CUDA the freed memory goes back to the device (PyTorch's cache is emptied); on a CPU it goes back to the
allocator. Where SGLang would crash (an assertion in its scheduler, a forward pass over unmapped memory, a
tag resumed that was not released) this engine answers a clear error and changes nothing: see
docs/engine.md."""

from __future__ import annotations

from functools import partial
from typing import Callable, Literal

import torch
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field

from services.engine.protocol import ServerInfo

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES, in its order
MemoryTag = Literal["kv_cache", "weights", "cuda_graph"]
WEIGHTS_RELEASED = (
    'the weights are released (/release_memory_occupation): resume them (tags ["weights"]) before sending weights'
)

RESIDENT = Gauge("sluice_engine_memory_bytes", "bytes the engine holds now, by region (0 while released)", ["region"])
RELEASED = Gauge(
    "sluice_engine_memory_released",
    "1 while the tag's memory is released (/release_memory_occupation), else 0",
    ["tag"],
)


class MemoryOccupationRequest(BaseModel):
    """SGLang's ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput: `tags`, null or [] for all.
    Its IPC fields (`rid`, `http_worker_ipc`) and unknown keys are ignored, as SGLang ignores them."""

    model_config = ConfigDict(extra="ignore")
    tags: list[MemoryTag] | None = Field(
        None, max_length=3, description="kv_cache, weights, cuda_graph; null or [] for all three"
    )

    def chosen(self) -> list[str]:
        """The tags asked for, once each, in SGLang's order."""
        return [t for t in ALL_TAGS if t in (self.tags or ALL_TAGS)]


class MemoryState(BaseModel):
    """A Sluice extension of /server_info: what is released and what the engine holds now."""

    released: list[MemoryTag] = Field(description="tags released by /release_memory_occupation, not resumed")
    weights_bytes: int = Field(description="bytes of parameter storage held now (0 while weights are released)")
    kv_cache_bytes: int = Field(description="bytes of KV pool held now (0 while kv_cache is released)")
    device_reserved_bytes: int | None = Field(
        description="PyTorch's reserved memory on the engine's GPU; null on a CPU"
    )


class ServerInfoWithMemory(ServerInfo):
    memory_occupation: MemoryState = Field(description="Sluice extension: released tags and memory held now")


class MemoryOccupationError(ValueError):
    """A release or resume the engine refuses (400 with the message); nothing was changed."""


class WeightsReleased(ValueError):
    """A weight update while the weights are released: refused (400), what it sent dropped."""


def _storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """Each parameter storage once (the fused weights' views share one; freed ones all count as one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in model.parameters():
        storage = p.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def memory_state(engine) -> MemoryState:
    device = torch.device(engine.config.device)
    return MemoryState(
        released=[t for t in ALL_TAGS if t in engine.scheduler.released],
        weights_bytes=weights_bytes(engine.model),
        kv_cache_bytes=engine.pool.resident_bytes(),
        device_reserved_bytes=torch.cuda.memory_reserved(device) if device.type == "cuda" else None,
    )


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(s.nbytes() for s in _storages(model))


def load_unless_released(engine, load: Callable[[], str]) -> str:
    """Engine thread: load a received update, or, while the weights are released, refuse it and drop it."""
    if WEIGHTS in engine.scheduler.released:
        engine.weights.discard()
        raise WeightsReleased(WEIGHTS_RELEASED + "; this update was dropped")
    return load()


def _allocate(storages: list[tuple[torch.UntypedStorage, int]]) -> None:
    """Each storage back to its size, zero-filled; all or none (on failure, e.g. out of memory, the ones
    already allocated are freed again and the error raised)."""
    try:
        for storage, nbytes in storages:
            storage.resize_(nbytes)
            storage.fill_(0)  # type: ignore[attr-defined]  # there at runtime; torch's stubs leave it out
    except Exception:
        for storage, _ in storages:
            storage.resize_(0)
        raise


class MemoryOccupation:
    """Release and resume of the engine's memory regions, on the engine thread (Engine.run_control)."""

    def __init__(self, engine):
        self.engine, self.sched = engine, engine.scheduler
        self.device = torch.device(engine.config.device)
        self._weights: list[tuple[torch.UntypedStorage, int]] = []  # while released: storage, size to restore
        RESIDENT.labels("weights").set_function(lambda: weights_bytes(engine.model))
        RESIDENT.labels("kv_cache").set_function(engine.pool.resident_bytes)
        for tag in ALL_TAGS:
            RELEASED.labels(tag).set_function(partial(self._released, tag))

    def _released(self, tag: str) -> float:
        return float(tag in self.sched.released)

    def release(self, tags: list[str]) -> None:
        sched = self.sched
        again = [t for t in tags if t in sched.released]
        if again:
            raise MemoryOccupationError(f"already released: {', '.join(again)}; /resume_memory_occupation first")
        if sched.running or sched.frozen or (sched.waiting and not sched.paused):
            raise MemoryOccupationError(
                "release_memory_occupation needs an idle engine (SGLang asserts it): "
                f"{len(sched.running)} running, {len(sched.frozen)} frozen by an in_place pause, "
                f"{len(sched.waiting)} waiting; let them finish, or /pause_generation with mode abort or retract "
                "first (requests waiting in a paused engine stay queued until resume and continue)"
            )
        if WEIGHTS in tags:
            bad = [s for s in _storages(self.engine.model) if not s.resizable()]
            if bad:
                raise MemoryOccupationError(f"{len(bad)} weight storages cannot be freed in place (not resizable)")
        if KV_CACHE in tags:
            self.engine.pool.free_storage()
            sched.speculation.ngrams.clear()
        if WEIGHTS in tags:
            self.engine.weights.discard()
            self._weights = [(s, s.nbytes()) for s in _storages(self.engine.model)]
            for storage, _ in self._weights:
                storage.resize_(0)
        sched.released.update(tags)
        self._give_back()

    def resume(self, tags: list[str]) -> None:
        """SGLang's order: cuda_graph, weights, kv_cache. A region that cannot be allocated again stays
        released, and the error says which were resumed before it."""
        missing = [t for t in tags if t not in self.sched.released]
        if missing:
            raise MemoryOccupationError(
                f"not released: {', '.join(missing)} (released: {', '.join(sorted(self.sched.released)) or 'nothing'})"
            )
        done: list[str] = []
        for tag in (CUDA_GRAPH, WEIGHTS, KV_CACHE):
            if tag not in tags:
                continue
            try:
                if tag == WEIGHTS:
                    _allocate(self._weights)
                    self._weights = []
                elif tag == KV_CACHE:
                    self.engine.pool.restore_storage()
            except Exception as exc:
                if tag == KV_CACHE:  # the keys may have been allocated and the values not
                    self.engine.pool.free_storage()
                self._give_back()
                raise MemoryOccupationError(
                    f"could not allocate {tag} again ({type(exc).__name__}: {exc}); "
                    f"resumed: {', '.join(done) or 'nothing'}"
                ) from exc
            self.sched.released.discard(tag)
            done.append(tag)

    def _give_back(self) -> None:
        """Freed CUDA memory from PyTorch's cache back to the device, where another process can take it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

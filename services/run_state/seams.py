"""The seams a role is given rather than building itself, as `Protocol`s: the data plane (blocking, and the
rollout's asyncio one), its membership in the run, the prompt ledger, the eval results, and the two ends of the
weight broadcast. A role finds the first ones in its run session (services/role/session.py: TransferQueue,
AsyncTransferQueue, RunMembership, PromptLedger, EvaluationStore) and is given the weight broadcast's ends
(WeightPublisher, WeightReceiver); a role's unit test passes the in-memory fakes of tests/fakes/ and runs the
role in milliseconds, without Redis, gRPC or processes. (The rollout's engines are its own seam:
services/rollout/engine_pool.py.)"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch

from services.run_state.evaluations import Evaluation
from services.transferqueue.codec import Batch


class DataPlane(Protocol):
    """What roles use of TransferQueue (services/transferqueue/client/queue.py has the semantics)."""

    def register_task(self, name: str, required_fields: Sequence[str], group_size: int = 1) -> Any: ...

    def partition(self, name: str) -> Any: ...

    def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        padded: bool = False,
        pad_value: int = 0,
    ) -> Batch: ...

    def claim_rows(
        self,
        partition: str,
        task: str,
        batch_size: int,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        claim_key: str = "",
    ) -> Any: ...

    def read_claimed(self, claimed: Any, fields: Sequence[str], padded: bool = False, pad_value: int = 0) -> Batch: ...

    def get(
        self, partition: str, rows: Sequence[int], fields: Sequence[str], padded: bool = False, pad_value: int = 0
    ) -> Batch: ...

    def put(self, partition: str, columns: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[int]: ...

    def ack(self, lease: str | Batch, rows: Sequence[int] = ()) -> int: ...

    def release(self, lease: str | Batch) -> int: ...

    def reset_task(self, partition: str, task: str) -> int: ...

    def clear_partition(self, name: str) -> bool: ...

    def close(self) -> None: ...


class AsyncDataPlane(Protocol):
    """What the rollout uses of AsyncTransferQueue."""

    async def create_partition(
        self, name: str, group_size: int = 1, exist_ok: bool = False, placement_block: int = 0
    ) -> Any: ...

    async def list_partitions(self, prefix: str = "") -> list: ...

    async def seal_partition(self, name: str) -> Any: ...

    async def register_task(self, name: str, required_fields: Sequence[str], group_size: int = 1) -> Any: ...

    async def put(self, partition: str, columns: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[int]: ...

    async def claim(
        self,
        partition: str,
        task: str,
        batch_size: int,
        fields: Sequence[str] | None = None,
        wait_s: float = 0.0,
        lease_s: float = 0.0,
        min_rows: int = 0,
        padded: bool = False,
        pad_value: int = 0,
    ) -> Batch: ...

    async def release(self, lease: str | Batch) -> int: ...

    async def lost_rows(self, partition: str, task: str) -> list[int]: ...

    async def close(self) -> None: ...


class Ledger(Protocol):
    """Which prompt groups the rollout has written (services/run_state/prompt_ledger.py has the semantics)."""

    async def load(self) -> tuple[int, set[int]]: ...

    async def mark_written(self, position: int, step: int, rows: Sequence[int] = ()) -> int: ...

    async def slots_with_rows(self, step: int, rows: Iterable[int]) -> set[int]: ...

    async def unwrite(self, slot: int, step: int) -> None: ...

    async def groups_written(self, step: int) -> int: ...

    async def replacements(self) -> dict[int, int]: ...

    async def skip(
        self, slot: int, position: int, reason: str, first_spare: int, filtered_step: int | None = None
    ) -> int: ...

    async def filtered(self, step: int) -> int: ...


class Evaluations(Protocol):
    """Where the rollout keeps its evaluations (services/run_state/evaluations.py: EvaluationStore)."""

    async def record(self, evaluation: Evaluation) -> None: ...

    async def all(self) -> list[Evaluation]: ...


class WeightSender(Protocol):
    """The trainer's end of the weight broadcast (services/dcs/sync/publisher.py: WeightPublisher)."""

    receiver_roles: list[str]
    adapter_scaling: float | None  # a LoRA trainer's alpha / r: what it publishes is an adapter
    adapter_config: dict | None  # and its peft adapter_config.json (services/trainer/lora.py adapter_config)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int, announce: bool = True) -> Any: ...

    def prefetch_group(self, receiver_roles: list[str]) -> None: ...

    def resume_engines(self) -> int: ...

    def left_out(self) -> list[str]: ...

    def reported(self, timeout_s: float | None = None) -> None: ...

    def close(self) -> None: ...


class WeightFollower(Protocol):
    """A forward role's end of it (services/dcs/sync/receiver.py: WeightReceiver, driven by follow_weights)."""

    version: int

    def declare(self) -> None: ...

    def next(self, wait_s: float) -> Any: ...

    def receive(self, published: Any, on_bucket: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]: ...

    def loaded(self, published: Any, load_seconds: float) -> None: ...

    def close(self) -> None: ...


class Membership(Protocol):
    """A service's membership in a run (services/dcs/membership.py): pause at safe points, report progress. The
    rollout also acknowledges a pause without blocking, and marks an engine it keeps registered `suspended`
    while that engine is unreachable."""

    node_id: str
    suspended: bool

    @property
    def paused(self) -> bool: ...

    def safe_point(
        self, stop: threading.Event | None = None, while_paused: Callable[[], None] | None = None
    ) -> None: ...

    def acknowledge_pause(self) -> None: ...

    def progress(self, step: int | None = None, weight_version: int | None = None) -> None: ...

    def close(self) -> None: ...

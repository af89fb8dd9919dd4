"""The seams a role is given rather than building itself, as `Protocol`s: the data plane and its membership
in the run. The services pass the real ones (TransferQueue, RunMembership); a role's unit test passes the
in-memory fakes of tests/fakes.py and runs the role in milliseconds, without Redis, gRPC or processes."""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Protocol, Sequence

from services.transferqueue.codec import Batch


class DataPlane(Protocol):
    """What roles use of TransferQueue (services/transferqueue/client/queue.py has the semantics)."""

    def register_task(self, name: str, required_fields: Sequence[str], group_size: int = 1) -> Any: ...

    def partition(self, name: str) -> Any: ...

    def claim(self, partition: str, task: str, batch_size: int, fields: Sequence[str] | None = None,
              wait_s: float = 0.0, lease_s: float = 0.0, min_rows: int = 0, padded: bool = False,
              pad_value: int = 0) -> Batch: ...

    def claim_rows(self, partition: str, task: str, batch_size: int, wait_s: float = 0.0, lease_s: float = 0.0,
                   min_rows: int = 0, claim_key: str = "") -> Any: ...

    def read_claimed(self, claimed: Any, fields: Sequence[str], padded: bool = False, pad_value: int = 0) -> Batch: ...

    def get(self, partition: str, rows: Sequence[int], fields: Sequence[str], padded: bool = False,
            pad_value: int = 0) -> Batch: ...

    def put(self, partition: str, columns: Mapping[str, Any], rows: Sequence[int] | None = None) -> list[int]: ...

    def ack(self, lease: str | Batch, rows: Sequence[int] = ()) -> int: ...

    def release(self, lease: str | Batch) -> int: ...

    def close(self) -> None: ...


class Membership(Protocol):
    """A service's membership in a run (services/dcs/membership.py): pause at safe points, report progress."""

    node_id: str

    def safe_point(self, stop: threading.Event | None = None,
                   while_paused: Callable[[], None] | None = None) -> None: ...

    def progress(self, step: int | None = None, weight_version: int | None = None) -> None: ...

    def close(self) -> None: ...

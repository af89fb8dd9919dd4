"""In-memory fakes of a role's membership in the run and of the run state it keeps in Redis: the rollout's prompt
ledger (services/run_state/seams.py: Ledger) and the subset of a Redis client the trainer's progress record uses
(services/run_state/trainer_progress.py reads and writes it unchanged)."""

from __future__ import annotations

import threading

from services.run_state.trainer_progress import TrainerProgress


class FakeMembership:
    """Always running; records the registration it was made with and the progress reported. Made as
    RunMembership is, `FakeMembership(dcs, registration)` (FakeRunSession.join makes one so)."""

    node_id = "fake-node"
    paused = False

    def __init__(self, dcs=None, registration=None, *args, **kwargs):
        self.registration = registration
        self.steps: list[int] = []
        self.versions: list[int] = []
        self.suspended = False
        self.closed = False

    def safe_point(self, stop=None, while_paused=None) -> None:
        pass

    def acknowledge_pause(self) -> None:
        pass

    def progress(self, step: int | None = None, weight_version: int | None = None) -> None:
        if step is not None:
            self.steps.append(step)
        if weight_version is not None:
            self.versions.append(weight_version)

    def close(self) -> None:
        self.closed = True


class InMemoryLedger:
    """The prompt ledger's semantics (services/run_state/prompt_ledger.py): positions below `frontier` are
        written, positions at or above it iff in `written`; a repeated mark is not counted again; a skipped group's
    slot holds the next spare prompt position."""

    def __init__(self, frontier: int = 0, written=(), steps: dict[int, set[int]] | None = None):
        self.frontier = frontier
        self.written = set(written)
        self.steps: dict[int, set[int]] = {k: set(v) for k, v in (steps or {}).items()}
        self.marks: list[int] = []  # every mark_written call, in order
        self.rows: dict[int, dict[int, list[int]]] = {}  # step -> slot -> its TransferQueue rows
        self.replaced: dict[int, int] = {}  # slot -> the spare prompt position it holds
        self.skipped: dict[int, str] = {}  # prompt position -> why its group was dropped
        self.filtered_by_step: dict[int, int] = {}  # step -> groups dynamic sampling dropped

    async def load(self) -> tuple[int, set[int]]:
        return self.frontier, set(self.written)

    async def mark_written(self, position: int, step: int, rows=()) -> int:
        self.marks.append(position)
        if rows:
            self.rows.setdefault(step, {})[position] = list(rows)
        if position < self.frontier or position in self.written:  # written again after its rows were lost
            self.steps.setdefault(step, set()).add(position)
        else:
            self.written.add(position)
            self.steps.setdefault(step, set()).add(position)
            while self.frontier in self.written:
                self.written.remove(self.frontier)
                self.frontier += 1
        return await self.groups_written(step)

    async def groups_written(self, step: int) -> int:
        return len(self.steps.get(step, ()))

    async def slots_with_rows(self, step: int, rows) -> set[int]:
        wanted = set(rows)
        return {slot for slot, held in self.rows.get(step, {}).items() if wanted.intersection(held)}

    async def unwrite(self, slot: int, step: int) -> None:
        self.steps.get(step, set()).discard(slot)

    async def replacements(self) -> dict[int, int]:
        return dict(self.replaced)

    async def skip(
        self, slot: int, position: int, reason: str, first_spare: int, filtered_step: int | None = None
    ) -> int:
        """The slot's group is dropped; it holds the next spare prompt position from now on (a group dynamic
        sampling dropped is counted for its step)."""
        if self.replaced.get(slot, slot) != position:  # a repeat: nothing more is allocated
            return self.replaced[slot]
        self.replaced[slot] = first_spare + len(self.skipped)
        self.skipped[position] = reason
        if filtered_step is not None:
            self.filtered_by_step[filtered_step] = self.filtered_by_step.get(filtered_step, 0) + 1
        return self.replaced[slot]

    async def filtered(self, step: int) -> int:
        return self.filtered_by_step.get(step, 0)


class InMemoryEvaluations:
    """The rollout's eval results (services/rollout/evaluation.py: Evaluations); `fail_next` makes the next
    record raise, as a Redis outage would."""

    def __init__(self):
        self.recorded: dict[int, object] = {}
        self.fail_next = 0

    async def record(self, evaluation) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("redis went away")
        self.recorded[evaluation.version] = evaluation

    async def all(self) -> list:
        return [self.recorded[v] for v in sorted(self.recorded)]


class ProgressBox:
    """The trainer's progress as a test sets it (the role reads it through `read` or `aread`)."""

    def __init__(self, progress: TrainerProgress | None = None):
        self.value = progress or TrainerProgress()

    def read(self) -> TrainerProgress:
        return self.value

    async def aread(self) -> TrainerProgress:
        return self.value


class InMemoryRedis:
    """get / set / hset / hget / hmget / hgetall / hvals and a transaction pipeline of them: what the trainer's progress
    record, its step reports and its tracking (the latest evaluation) need."""

    def __init__(self):
        self.strings: dict[str, str] = {}
        self.hashes: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        return self.strings.get(key)

    def set(self, key: str, value: str) -> bool:
        with self._lock:
            self.strings[key] = value
        return True

    def hset(self, key: str, field: str, value: str) -> int:
        with self._lock:
            fresh = field not in self.hashes.setdefault(key, {})
            self.hashes[key][field] = value
        return int(fresh)

    def hget(self, key: str, field: str) -> str | None:
        return self.hashes.get(key, {}).get(field)

    def hmget(self, key: str, fields: list[str]) -> list[str | None]:
        return [self.hashes.get(key, {}).get(field) for field in fields]

    def hgetall(self, key: str) -> dict[str, str]:
        return dict(self.hashes.get(key, {}))

    def hvals(self, key: str) -> list[str]:
        return list(self.hashes.get(key, {}).values())

    def pipeline(self, transaction: bool = True) -> "_Pipeline":
        return _Pipeline(self)

    def close(self) -> None:
        pass


class _Pipeline:
    """Queued commands, applied together by execute()."""

    def __init__(self, client: InMemoryRedis):
        self.client = client
        self.queued: list = []

    def __enter__(self) -> "_Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.queued = []

    def set(self, key: str, value: str) -> "_Pipeline":
        self.queued.append(lambda: self.client.set(key, value))
        return self

    def hset(self, key: str, field: str, value: str) -> "_Pipeline":
        self.queued.append(lambda: self.client.hset(key, field, value))
        return self

    def execute(self) -> list:
        results, self.queued = [command() for command in self.queued], []
        return results

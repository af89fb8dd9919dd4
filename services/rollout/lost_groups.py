"""Slots to generate again because their rows were lost with a storage shard before the trainer consumed them.

The TransferQueue controller marks rows lost when a shard comes back without its data (a new incarnation).
For every task that had not consumed them they count as consumed and are listed by LostRows, and their
partition is unsealed; a group a live lease held stays in that lease instead, and only becomes lost if the
lease is given back (released, expired) rather than acked, since its holder may have read it before the
loss (docs/transferqueue.md). Every `check` the rollout looks for partitions of its run whose losses
changed, asks which rows the actor's training task lost (LostRows), and maps those to slots through the
rows the ledger keeps per written slot. Each such slot leaves its step (`unwrite`) and is queued in `redo`;
the rollout generates it again (as new rows) ahead of anything else, and the usual path seals the step
once every slot is written again. A partition whose lost rows the trainer had all consumed (or still holds)
needs nothing: it is sealed again at once, and so is one whose step the trainer has finished. So training
stays exactly-once: a sample the trainer consumed is never generated again, and one it had not is
generated once more."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable

from prometheus_client import Counter

from services.run_contract.partitions import ACTOR_TRAIN_TASK, partition_prefix, step_of, task_name
from services.run_state.seams import AsyncDataPlane, Ledger
from services.run_state.trainer_progress import TrainerProgress
from services.transferqueue.errors import TQError

log = logging.getLogger(__name__)
REGENERATED = Counter(
    "sluice_rollout_groups_regenerated_total",
    "groups generated again because their rows were lost with a storage shard",
)


def _losses(info) -> tuple[int, int]:
    """(rows lost in the partition, rows lost before some task consumed them): either grows when there is
    something to look at (the second also when a lease holding lost rows is given back)."""
    return int(getattr(info, "lost_rows", 0)), sum(int(getattr(t, "lost", 0)) for t in info.tasks)


class LostGroups:
    def __init__(
        self,
        tq: AsyncDataPlane,
        ledger: Ledger,
        run_id: str,
        groups_per_step: int,
        trainer_progress: Callable[[], Awaitable[TrainerProgress]],
    ):
        self.tq, self.ledger, self.run_id, self.groups_per_step = tq, ledger, run_id, groups_per_step
        self.trainer_progress = trainer_progress
        self.task = task_name(run_id, ACTOR_TRAIN_TASK)
        self.redo: collections.deque[int] = collections.deque()
        self.generating: set[int] = set()  # taken from redo, not yet written again
        self._handled: dict[str, tuple[int, int]] = {}  # partition -> its _losses already looked at

    async def check(self) -> int:
        """Queue the slots of newly lost rows; -> how many were queued."""
        queued = 0
        for info in await self.tq.list_partitions(partition_prefix(self.run_id)):
            lost, step = _losses(info), step_of(info.name)
            if step is None or lost == self._handled.get(info.name, (0, 0)):
                continue
            slots = set()
            if (await self.trainer_progress()).next_step <= step:
                slots = await self.ledger.slots_with_rows(step, await self.tq.lost_rows(info.name, self.task))
                slots -= set(self.redo) | self.generating
            for slot in sorted(slots):
                await self.ledger.unwrite(slot, step)
                self.redo.append(slot)
            if not slots and await self.ledger.groups_written(step) >= self.groups_per_step:
                await self.tq.seal_partition(info.name)  # the trainer had consumed every lost row
            self._handled[info.name] = lost
            queued += len(slots)
            REGENERATED.inc(len(slots))
            log.warning(
                "rows were lost with a storage shard",
                extra={"partition": info.name, "lost_rows": lost[0], "slots_to_generate_again": sorted(slots)},
            )
        return queued

    def take(self) -> int:
        slot = self.redo.popleft()
        self.generating.add(slot)
        return slot

    def written(self, slot: int) -> None:
        self.generating.discard(slot)

    async def watch(self, interval_s: float, found: Callable[[], None]) -> None:
        """`check` every interval_s, calling `found` when slots were queued; a failed check is retried."""
        while True:
            try:
                if await self.check():
                    found()
            except TQError as exc:
                log.warning("checking for lost rows failed; retrying", extra={"error": exc.message})
            await asyncio.sleep(interval_s)

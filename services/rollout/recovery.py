"""Where a restarted rollout resumes: the ledger, corrected by what open partitions already hold."""

from __future__ import annotations

import collections
import logging

from services.run_contract.partitions import partition_prefix, step_of, task_name
from services.run_contract.run_config import RunConfig
from services.run_state.seams import AsyncDataPlane, Ledger

log = logging.getLogger(__name__)


async def recover_positions(
    tq: AsyncDataPlane, ledger: Ledger, run: RunConfig, replaced: dict[int, int], recover_task: str
):
    """Slots still to generate, in order. Groups already in open partitions count as written even if the ledger
    missed them (a crash between the put and the mark); a row of a spare prompt counts for the slot that took
    it (`replaced`: slot -> the spare prompt position it holds)."""
    slot_of = {position: slot for slot, position in replaced.items()}
    for info in await tq.list_partitions(partition_prefix(run.name)):
        step = step_of(info.name)
        if step is None or info.allocated_rows == 0:
            continue
        batch = await tq.claim(info.name, task_name(run.name, recover_task), batch_size=max(info.allocated_rows, 1))
        if batch.rows:
            await tq.release(batch)
            rows_of = collections.defaultdict(list)
            for row, position in zip(batch.rows, batch.columns["prompt_position"].tolist()):
                rows_of[int(position)].append(row)
            for position, rows in sorted(rows_of.items()):
                await ledger.mark_written(slot_of.get(position, position), step, rows)
        if not info.sealed and await ledger.groups_written(step) >= run.rollout_batch_size:
            await tq.seal_partition(info.name)
    frontier, written = await ledger.load()
    log.info("rollout position", extra={"frontier": frontier, "written_beyond": len(written)})

    def positions():
        p = frontier
        while True:
            if p not in written:
                yield p
            p += 1

    return positions()

"""How each data-parallel rank of the actor trainer gets its share of a step's global batches: the leader claims
a global batch (waiting while the partition fills) and shares the claim key's nonce, the other ranks claim the
same rows by that key, and each rank reads its own whole groups of them. With one rank the batch is read with
the claim, and claimed again when rows of it were lost with their storage shard."""

from __future__ import annotations

import itertools
import secrets
import threading
from typing import Protocol

from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_contract.sample_fields import STEP_RECORD_INPUTS, actor_inputs
from services.run_state.seams import DataPlane
from services.runtime.spans import span
from services.trainer.backend import TrainerBackend
from services.trainer.data_parallel import DataParallel
from services.trainer.tasks import claim_global_batch, read_or_give_back
from services.transferqueue.codec import Batch


class ClaimingLeader(Protocol):
    """The leader's side of a claim (services/trainer/service.py's ActorTrainer): a pause safe point before it
    claims, what runs between polls while it waits for rows, and the version it trains (the claim's span)."""

    version: int

    def pause_point(self, halt: threading.Event) -> None: ...

    def waiting(self, step: int, halt: threading.Event) -> None: ...


class GlobalBatchClaims:
    def __init__(
        self,
        tq: DataPlane,
        run: RunConfig,
        task: str,
        lease_s: float,
        dp: DataParallel,
        backend: TrainerBackend,
        leader: ClaimingLeader,
    ):
        self.tq, self.run, self.task, self.lease_s = tq, run, task, lease_s
        self.dp, self.backend, self.leader = dp, backend, leader

    def nonce(self) -> int:
        """A step's claim keys: the leader's random nonce (the ranks claim the same rows by it), 0 elsewhere."""
        return secrets.randbits(62) if self.dp.is_leader else 0

    def claimed_batch(self, step: int, nonce: int, it: int, halt: threading.Event):
        """(claimed, batch) of global batch `it`; the batch is read here with one rank (None with several);
        claimed again when rows of it were lost with their storage shard. (None, None) as claim."""
        for retry in itertools.count():
            claimed = self.claim(step, nonce, it, halt, retry)
            if claimed is None or self.dp.size > 1:
                return claimed, None
            batch = read_or_give_back(self.tq, claimed, actor_inputs(self.run))
            if batch is not None:
                return claimed, batch

    def claim(self, step: int, nonce: int, it: int, halt: threading.Event, retry: int = 0):
        """Global batch `it` of step N: the leader claims it (waiting while the partition fills), the other
        ranks claim the same rows by the claim key the leader shares. None when halted or none was found."""
        run, dp, leader = self.run, self.dp, self.leader
        partition = partition_name(run.name, step)
        if not dp.is_leader:
            got, nonce = dp.share([0, 0])
            return (
                self.tq.claim_rows(
                    partition, self.task, run.global_batch_size, lease_s=self.lease_s, claim_key=f"{nonce}-{it}"
                )
                if got
                else None
            )
        leader.pause_point(halt)
        with span("claim", step, leader.version):
            claimed = claim_global_batch(
                self.tq,
                partition,
                self.task,
                run.global_batch_size,
                self.lease_s,
                halt,
                lambda: leader.waiting(step, halt),
                claim_key=f"{nonce}-{it}" + (f"-{retry}" if retry else ""),
            )
        if dp.size > 1:
            dp.share([int(claimed is not None), nonce])  # found, and the claim key's nonce
        return claimed

    def my_share(self, step: int, claimed, batch: Batch | None) -> tuple[Batch, Batch]:
        """(info, batch): the global batch's fields the leader records (STEP_RECORD_INPUTS) and this rank's
        share of it to train. With one rank both are the batch read with the claim; with several the split
        needs every row's length, and the leader's metrics every row's ids."""
        if self.dp.size == 1:
            assert batch is not None  # claimed_batch reads it with one rank
            return batch, batch
        partition = partition_name(self.run.name, step)
        info = self.tq.get(partition, claimed.rows, STEP_RECORD_INPUTS)
        mine = self.dp.my_rows(
            claimed.rows,
            info["response_length"].tolist(),
            self.run.group_rows,
            self.backend.data_rank,
            self.backend.data_size,
        )
        return info, self.tq.get(partition, mine, actor_inputs(self.run))

"""The actor's data-parallel group: every rank holds the whole model, trains on its share of each
global batch, and the summed gradients make every rank take the same optimizer step.

Rank 0 leads: it claims each global batch (the other ranks get the same lease through its claim
key), acks it, publishes weights, checkpoints and clears partitions; decisions reach the other ranks
as integer tensors over the group (nothing is pickled). Loss totals (tokens, sequences) are those of
the whole global batch, so summing the ranks' gradients gives exactly the one-process gradient."""

from __future__ import annotations

import enum
import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from services.transferqueue.client.balance import balanced_split


def init_method(master: str) -> str:
    """env:// when the rendezvous is torchrun's (MASTER_ADDR:MASTER_PORT, whose store torchrun's agent already
    hosts, so rank 0 must not open its own there), else a TCP store that rank 0 opens at `master`."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") and master == f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}":
        return "env://"
    return f"tcp://{master}"


def process_group_backend(device: str) -> str:
    """gloo for CPU tensors (the control messages, and CPU training); NCCL for CUDA tensors beside it."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


class Order(enum.IntEnum):
    """What rank 0 tells the other ranks to do next (DataParallel.order), with a step and a version."""

    STOP = 0  # the run is done: return
    TRAIN = 1  # train step N (at version V) on this rank's share of each global batch
    CHECKPOINT = 2  # write the sharded model's files of the final checkpoint (N: its next step)
    GATHER = 3  # gather the weights with the leader, which publishes them (or sends them again)


class DataParallel:
    def __init__(
        self, rank: int = 0, size: int = 1, master: str = "", backend: str = "gloo", timeout_s: float = 7200.0
    ):
        if not 0 <= rank < size:
            raise ValueError(f"dp rank {rank} is outside a group of {size}")
        self.rank, self.size = rank, size
        if size > 1:
            if not master:
                raise ValueError("--dp-master host:port is required with --dp-size > 1")
            # ranks wait on each other while rank 0 waits for data: the timeout bounds a whole step
            dist.init_process_group(
                backend,
                init_method=init_method(master),
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=timeout_s),
            )

    def ensure_group(self, backend: str = "gloo") -> None:
        """A process group even for one rank (FSDP and megatron build theirs on it): a private one on
        loopback."""
        if not dist.is_initialized():
            from services.runtime.processes import free_port

            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, ints: Sequence[int]) -> list[int]:
        """Rank 0's values, on every rank."""
        t = torch.tensor(list(ints), dtype=torch.int64)
        if self.size > 1:
            dist.broadcast(t, 0)
        return t.tolist()

    def order(self, order: Order, step: int = 0, version: int = 0) -> None:
        """Rank 0: tell the other ranks what to do next."""
        self.share([order, step, version])

    def next_order(self) -> tuple[Order, int, int]:
        """A rank other than 0: what rank 0 tells it to do next, (order, step, version)."""
        order, step, version = self.share([0, 0, 0])
        return Order(order), step, version

    def total(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if self.size > 1:
            dist.all_reduce(t)
        return float(t)

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        if self.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
            offset += n

    def my_rows(
        self,
        rows: list[int],
        response_lengths: Sequence[int],
        group_size: int,
        share: int | None = None,
        shares: int | None = None,
    ) -> list[int]:
        """This rank's whole groups of `rows`, balanced by response tokens (every rank computes the
        same split): share `share` of `shares` (default: this rank's of the group's size; a backend whose
        ranks of one model replica train the same rows passes its data-parallel rank and size)."""
        share, shares = (self.rank, self.size) if share is None else (share, shares)
        assert shares is not None  # a caller that passes a share passes the number of shares with it
        groups = [rows[i : i + group_size] for i in range(0, len(rows), group_size)]
        weights = [float(sum(response_lengths[i : i + group_size])) for i in range(0, len(rows), group_size)]
        return [r for g in balanced_split(weights, shares)[share] for r in groups[g]]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def close(self, wait_s: float = 30.0) -> None:
        """Leave the group. The ranks meet first (a bounded barrier, so a dead peer cannot hold a
        shutdown): a rank that tears gloo down while a peer still talks to it can abort with
        'terminate called without an active exception' (seen once in CI on the non-leader rank)."""
        if self.size > 1 and dist.is_initialized():
            try:
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=timedelta(seconds=wait_s))
                else:
                    dist.barrier()
            except RuntimeError:
                pass  # a peer is gone: leave anyway
            dist.destroy_process_group()

"""Independent broadcast groups for weight sync: a TCPStore rendezvous at the group's master
address/port (rank 0 hosts it), a PrefixStore per group name, and a ProcessGroupGloo (CPU) or
ProcessGroupNCCL (GPU) built on it directly, without init_process_group, so a process can belong
to several groups and never touches the default group. This is the same construction SGLang's
/init_weights_update_group uses, so engines and our own receivers can share one group."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class BroadcastGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    store: dist.Store
    pg: object

    @classmethod
    def open(cls, name: str, backend: str, master_address: str, master_port: int, rank: int, world_size: int,
             timeout_s: float) -> "BroadcastGroup":
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout,
                              wait_for_workers=False)
        prefixed = dist.PrefixStore(name, store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"unknown backend {backend!r}")
        return cls(name, rank, world_size, backend, timeout_s, store, pg)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Blocks until done; raises if a member fails or the group's deadline passes."""
        work = self.pg.broadcast(tensor, src)
        if not work.wait(datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"broadcast in {self.name} did not finish in {self.timeout_s}s")

    def close(self) -> None:
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:
            pass
        self.pg = None
        self.store = None

"""Independent broadcast groups for weight sync: a TCPStore rendezvous at the group's master
address/port (rank 0 hosts it), a PrefixStore per group name, and a ProcessGroupGloo (CPU) or
ProcessGroupNCCL (GPU) built on it directly, without init_process_group, so a process can belong
to several groups and never touches the default group. The store keys are the ones SGLang's
/init_weights_update_group meets its peers under (sglang_group_store), so a real SGLang server, an SGLang-style
trainer (slime, AReaL, verl), the built-in engine and Sluice's own receivers can share one group."""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

FORM_SLACK_S = 5.0  # past the group's timeout, before a group that has not formed is given up


def sglang_group_store(store: dist.Store, name: str, backend: str) -> dist.Store:
    """The store view the group's members meet in, as SGLang builds it: its `init_custom_process_group` wraps the
    rendezvous store in PrefixStore(name), and torch's `_new_process_group_helper` wraps that in
    PrefixStore(f"{name}/") and then PrefixStore(f"{device}/") (the first device of the backend: cpu for gloo, cuda
    for nccl). A member built any other way never meets SGLang's (their keys differ)."""
    device = {"gloo": "cpu", "nccl": "cuda"}.get(backend)
    if device is None:
        raise ValueError(f"unknown backend {backend!r}")
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))


@dataclass
class BroadcastGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    store: dist.Store | None  # None once closed
    pg: Any  # a gloo or NCCL process group; None once closed

    @classmethod
    def open(
        cls,
        name: str,
        backend: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        form_within_s: float | None = None,
    ) -> "BroadcastGroup":
        """Join the group, within `timeout_s` (plus a little). A member killed while the mesh forms can
        leave gloo waiting on its connection past every timeout (the chaos test saw the trainer sit in
        gloo's Pair::waitUntilConnected for minutes after an actor_fwd died mid-handshake), so the group is
        formed on a helper thread that is abandoned at the deadline: the sync fails on time, and the next
        sync forms a new group on a new port. `form_within_s`: a shorter deadline for forming (what is left
        of the publisher's)."""
        formed: dict = {}

        def form() -> None:
            try:
                formed["group"] = cls._form(name, backend, master_address, master_port, rank, world_size, timeout_s)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                formed["error"] = exc

        thread = threading.Thread(target=form, name=f"form-{name}", daemon=True)
        thread.start()
        thread.join((timeout_s if form_within_s is None else min(form_within_s, timeout_s)) + FORM_SLACK_S)
        if thread.is_alive():
            raise TimeoutError(f"sync group {name} did not form within {timeout_s:g}s: a member is gone")
        if "error" in formed:
            raise formed["error"]
        return formed["group"]

    @classmethod
    def _form(
        cls,
        name: str,
        backend: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> "BroadcastGroup":
        timeout = datetime.timedelta(seconds=timeout_s)
        # a member other than rank 0 checks in with the store's host (wait_for_workers: it counts the workers that
        # joined, which is what a master built by torch's tcp rendezvous, as SGLang-style trainers build theirs,
        # waits for); rank 0 does not wait here: the group's own mesh forms within the timeout anyway
        store = dist.TCPStore(
            master_address, master_port, world_size, rank == 0, timeout=timeout, wait_for_workers=rank != 0
        )
        prefixed = sglang_group_store(store, name, backend)
        pg: Any  # ProcessGroupGloo or ProcessGroupNCCL
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

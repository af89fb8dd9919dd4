"""Which transfer a weight publish uses (the trainer's `--sync-backend`): gloo, nccl or CUDA IPC.

    gloo  tensors through host memory over TCP: any device, any machine (CPU trainers and receivers)
    nccl  GPU to GPU (NVLink, InfiniBand, PCIe): the trainer and every receiver on a GPU of its own; NCCL
          refuses two ranks of one group on one device
    ipc   a receiver on the trainer's own GPU maps the trainer's bucket through a CUDA IPC handle and copies it
          (SGLang's /update_weights_from_tensor idea, as slime and verl push weights into a colocated engine):
          no copy through the host, no process group; only engines that announce it take it

`auto` picks per sync group, from where its members compute (each one's GPU UUID: engines say it in their model
info, other receivers in their registration; unknown = not the trainer's GPU, which is how a separate SGLang
server usually runs):

    the trainer on a CPU                                  -> gloo
    no receiver on the trainer's GPU                      -> nccl
    every receiver on the trainer's GPU, all engines
    that take IPC handles                                 -> ipc
    otherwise (some share the GPU, some do not)           -> gloo
"""

from __future__ import annotations

from dataclasses import dataclass

SYNC_BACKENDS = ("auto", "gloo", "nccl", "ipc")


@dataclass(frozen=True)
class ReceiverPlace:
    """Where one receiver of a sync computes."""

    role: str
    gpu: str | None  # its GPU's UUID; None on a CPU or when it did not say
    takes_ipc: bool = False  # an engine that announces CUDA IPC weight updates


def choose_backend(requested: str, trainer_gpu: str | None, receivers: list[ReceiverPlace]) -> str:
    """The transfer for one sync group (module docstring). An explicit choice that cannot work is refused with
    a ValueError naming why (a mistaken flag fails the run at its first publish, not by timing out)."""
    if requested not in SYNC_BACKENDS:
        raise ValueError(f"unknown sync backend {requested!r}; one of {', '.join(SYNC_BACKENDS)}")
    sharing = [r for r in receivers if trainer_gpu is not None and r.gpu == trainer_gpu]
    if requested == "auto":
        if trainer_gpu is None:
            return "gloo"
        if not sharing:
            return "nccl"
        if len(sharing) == len(receivers) and all(r.takes_ipc for r in receivers):
            return "ipc"
        return "gloo"
    if requested == "nccl" and (trainer_gpu is None or sharing):
        raise ValueError(
            "sync backend nccl needs the trainer on a GPU and every receiver on another GPU"
            + (f" ({', '.join(r.role for r in sharing)} shares the trainer's)" if sharing else "")
        )
    if requested == "ipc":
        strangers = [r.role for r in receivers if not (r.takes_ipc and trainer_gpu and r.gpu == trainer_gpu)]
        if trainer_gpu is None or strangers:
            raise ValueError(
                "sync backend ipc needs the trainer on a GPU and every receiver an engine on that GPU "
                f"that takes CUDA IPC updates (not: {', '.join(strangers) or 'the trainer'})"
            )
    return requested


def gpu_uuid(device: str) -> str | None:
    """The UUID of a CUDA device (None for a CPU): the same GPU has the same UUID in every process, whatever its
    index under that process's CUDA_VISIBLE_DEVICES."""
    if not device.startswith("cuda"):
        return None
    import torch

    index = torch.device(device).index
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)

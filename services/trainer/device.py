"""What the trainer does differently on a CUDA device: TF32 matmuls (`--tf32`), and an honest compute time and
the peak memory of a step.

CUDA kernels run asynchronously: a step's Python returns once its kernels are queued, so a wall clock read
right after it measures the queueing, and the GPU's work is charged to whatever waits next (the data wait,
the publish). The clock here synchronizes the device before reading the time, so `compute_s` is the GPU's
own time. On CPU it is a plain wall clock."""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """Made at the start of a step: resets the device's peak-memory counter, so `memory()` is this step's."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def since(self, started: float) -> float:
        """Seconds from `started` (time.perf_counter()) until the device has finished the work queued so far."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def memory(self) -> dict[str, float]:
        """{"gpu_memory_peak_gb": the most memory torch allocated on the GPU during the step} on CUDA; {} on CPU."""
        if not self.cuda:
            return {}
        return {"gpu_memory_peak_gb": torch.cuda.max_memory_allocated(self.device) / 2**30}


def allow_tf32(device: str, enabled: bool = True) -> None:
    """On CUDA, float32 matmuls and convolutions in TF32 (10-bit mantissa inputs, float32 accumulation: several
    times the float32 throughput of an A100/H100's tensor cores); `enabled` False keeps full float32. A no-op
    on CPU, where TF32 does not exist and these settings must not move the CPU's kernels."""
    if torch.device(device).type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled

"""What the trainer does differently on a CUDA device: TF32 matmuls (`--tf32`), an honest compute time and the
peak memory of a step, and micro-batches sized from the memory the GPU has left (`--auto-micro-batch`).

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
        self.allocated_at_start = 0  # bytes torch held on the GPU as the step began (weights, optimizer state)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated_at_start = torch.cuda.memory_allocated(self.device)

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


def rows_that_fit(budget: float, fixed: float, bytes_per_token: float, tokens_per_row: int, at_most: int) -> int:
    """Micro-batch rows whose activations fit: floor((budget - fixed) / (bytes_per_token * tokens_per_row)),
    at least 1 and at most `at_most`."""
    if bytes_per_token <= 0 or tokens_per_row <= 0:
        return at_most
    return max(1, min(at_most, int((budget - fixed) // (bytes_per_token * tokens_per_row))))


class MicroBatchSizer:
    """The micro-batch size of each step. Without `auto` (or off a GPU) the run's micro_batch_size. With it, on
    a GPU, each step measures what one token of a micro-batch costs and the next step takes as many rows as fit
    in what the device has left (other processes, an engine on the same GPU, keep theirs):

        fixed     = bytes allocated as the step began (weights, optimizer state) + the gradients (weights' size)
        per token = (step's peak - fixed) / (rows x padded length of its micro-batches)
        budget    = fraction x (the device's free memory + what this process's allocator holds)
        rows      = (budget - fixed) / (per token x longest sequence seen), within [1, the step's rows]

    as verl's dynamic batch size packs by a token budget, but the budget measured rather than given."""

    def __init__(self, device: str, auto: bool, model: torch.nn.Module, fraction: float = 0.85):
        self.cuda = torch.device(device).type == "cuda"
        self.auto = auto and self.cuda
        self.device, self.fraction = device, fraction
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.per_token = 0.0  # bytes a token of a micro-batch costs (0: not measured yet)
        self._fixed = 0  # bytes the step holds whatever its micro-batches: weights, optimizer state, gradients
        self.longest = 0
        self.last_rows = 0

    def rows(self, configured: int, batch) -> int:
        """The micro-batch size for `batch` (remembered, with its padded length, for `observe`)."""
        self.longest = max(self.longest, max((len(t) for t in batch["tokens"]), default=0))
        rows = configured
        if self.auto and self.per_token > 0:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = self.fraction * (free + torch.cuda.memory_reserved(self.device))
            rows = rows_that_fit(budget, self._fixed, self.per_token, self.longest, len(batch))
        self.last_rows = rows
        return rows

    def observe(self, clock: DeviceClock) -> dict[str, float]:
        """After the step: its memory metrics, and (auto) the cost per token its peak shows."""
        metrics = clock.memory()
        if self.auto and self.last_rows and self.longest:
            self._fixed = clock.allocated_at_start + self.grad_bytes
            peak = torch.cuda.max_memory_allocated(clock.device)
            self.per_token = max(peak - self._fixed, 1) / (self.last_rows * self.longest)
            metrics["micro_batch_size"] = self.last_rows
        return metrics

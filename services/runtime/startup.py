"""What a service's start cost before it could do anything: when its process began (wall clock) and how long
its imports took, logged once as `service starting` by the entry point every service shares
(services/runtime/service_main.py), so a stack's start-up can be read off its services' logs
(benchmarks/stack_start.py, docs/performance.md), and imports run without the cyclic garbage collector."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from typing import Iterator

log = logging.getLogger(__name__)


class StartupError(ValueError):
    """A service cannot start on what it was given (a model directory without weights, ...): its message names
    what is wrong, so the entry point logs it alone, without a traceback, and exits 2 (service_main.py)."""


def process_started_at() -> float | None:
    """When this process started, in seconds since the epoch (the kernel's clock ticks: 10 ms), from /proc;
    None where there is no /proc."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


def log_service_start(command: str) -> None:
    """One line: the process's start, the wall seconds since then (the interpreter and the imports) and the
    CPU seconds they took."""
    started_at = process_started_at()
    fields = {"command": command, "pid": os.getpid(), "import_cpu_s": round(time.process_time(), 3)}
    if started_at is not None:
        fields.update(started_at=round(started_at, 3), import_s=round(time.time() - started_at, 3))
    log.info("service starting", extra=fields)


@contextlib.contextmanager
def imports_uncollected() -> Iterator[None]:
    """The collector off while a command's modules are imported: importing torch, transformers, gRPC and
    FastAPI makes millions of objects that all live as long as the process, and the full collections their
    growth triggers walk every one of them again and again to free next to nothing (~0.5 of a torch
    process's ~2.5 CPU seconds of imports on a 2-core machine, where a stack's services start side by side).
    What the imports left as garbage is collected on the first collection after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

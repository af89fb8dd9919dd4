"""The garbage collector of a long-running service: freeze what was loaded at start-up, and measure pauses.

Why: a Sluice process imports torch, transformers, grpc and FastAPI and then loads a model, so it holds
millions of long-lived objects. CPython's full (generation 2) collection walks all of them, and it runs
whenever enough new container objects pile up (25% of the long-lived ones): every few seconds in a busy
service. Measured on a 2-core machine in a fully-async run (`benchmarks/step_timeline.py`): full collections
of 110-240 ms in the engine, the rollout, the trainer and the advantage service every 1-3 s each, each one a
stop-the-world pause in a step that takes 60-90 ms, so one of them costs the whole pipeline two or three
steps. `gc.freeze()` (Python >= 3.7, the technique Instagram published for forked web servers) moves every
object tracked so far into a permanent generation that no collection visits; the collector then only walks
what was made since, and a full collection costs what the service allocates while it runs.

`manage_service_heap()` (the entry point every service shares, after the imports) measures pauses and freezes;
`freeze_heap()` freezes again once a role or the engine has loaded its model (objects made after a freeze are
collected as usual). Cycles among frozen objects are never freed, which is what start-up state (modules, the
model) wants anyway, and why `freeze_heap` does nothing in a process that is not a service (a test runner
that builds and drops many roles).
`sluice_gc_pause_seconds` (a histogram per generation, on /metrics) shows the pauses that remain, and
`sluice_gc_frozen_objects` how much the last freeze took out of the collector's way."""

from __future__ import annotations

import gc
import time

from prometheus_client import Gauge, Histogram

GC_PAUSE = Histogram(
    "sluice_gc_pause_seconds",
    "garbage collection pauses, by generation",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
FROZEN = Gauge("sluice_gc_frozen_objects", "objects frozen out of garbage collection (services/runtime/heap.py)")
_started: list[float] = []
_service_process = [False]


def _measure(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        GC_PAUSE.labels(str(info.get("generation", "?"))).observe(time.perf_counter() - _started[0])


def manage_service_heap() -> int:
    """This process is a service: record every collection's pause in sluice_gc_pause_seconds, and freeze what
    is alive now (and at each later freeze_heap); -> objects frozen."""
    _service_process[0] = True
    if _measure not in gc.callbacks:
        gc.callbacks.append(_measure)
    return freeze_heap()


def freeze_heap() -> int:
    """In a service: collect once, then exclude every object alive now from later collections; -> objects
    frozen (0 outside a service)."""
    if not _service_process[0]:
        return 0
    gc.collect()
    gc.freeze()
    FROZEN.set(gc.get_freeze_count())
    return gc.get_freeze_count()

"""Where a service's time goes: named intervals (spans) tagged with the step and weight version they served.

Every service process has one recorder (`RECORDER`); its loop wraps each piece of work, e.g.

    with span("train", step=step, version=version):
        ...

Names used across Sluice: generate, reward, put, claim (waiting for rows), forward, advantage, train,
checkpoint, publish, weight_load, pause. A span's start and end are wall-clock seconds (`time.time()`), so the
spans of processes on one machine line up on one time axis (`benchmarks/step_timeline.py` draws them as a
Gantt chart). They are exported two ways: totals per name on `/metrics` (`sluice_span_seconds_total`,
`sluice_spans_total`), and the recent spans themselves as JSON on `GET /spans?since=T` of the service's HTTP
endpoint (a bounded ring buffer: the newest `capacity` spans).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

from prometheus_client import Counter

SPAN_SECONDS = Counter("sluice_span_seconds_total", "seconds spent in spans of each name", ["name"])
SPAN_COUNT = Counter("sluice_spans_total", "spans recorded, by name", ["name"])


@dataclass
class Span:
    name: str
    start: float
    end: float
    step: int | None = None
    version: int | str | None = None


class SpanRecorder:
    def __init__(self, capacity: int = 50_000):
        self.service = ""
        self._spans: deque[Span] = deque(maxlen=capacity)
        self._open: dict[str, Span] = {}  # the last span of each name, for merge()
        self._lock = threading.Lock()

    def record(
        self, name: str, start: float, end: float, step: int | None = None, version: int | str | None = None
    ) -> None:
        span = Span(name, start, end, step, version)
        with self._lock:
            self._spans.append(span)
            self._open[name] = span
        SPAN_SECONDS.labels(name).inc(max(0.0, end - start))
        SPAN_COUNT.labels(name).inc()

    def merge(
        self,
        name: str,
        start: float,
        end: float,
        gap_s: float,
        step: int | None = None,
        version: int | str | None = None,
    ) -> None:
        """Record, or extend the last span of this name when it ended less than `gap_s` before `start` with the
        same tags: an engine's back-to-back forward steps become one busy interval, not thousands of spans."""
        with self._lock:
            last = self._open.get(name)
            if last is not None and start - last.end < gap_s and (last.step, last.version) == (step, version):
                SPAN_SECONDS.labels(name).inc(max(0.0, end - last.end))
                last.end = end
                return
        self.record(name, start, end, step, version)

    @contextmanager
    def span(self, name: str, step: int | None = None, version: int | str | None = None) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.record(name, start, time.time(), step, version)

    def since(self, t: float = 0.0, limit: int = 20_000) -> dict:
        """Spans that ended after `t`, oldest first (at most `limit`, the newest kept)."""
        with self._lock:
            found = [asdict(s) for s in self._spans if s.end > t]
        return {"service": self.service, "now": time.time(), "spans": found[-limit:]}


RECORDER = SpanRecorder()
span = RECORDER.span

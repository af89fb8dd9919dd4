"""The actor trainer's experiment tracking (rank 0), off its critical path; and its step reports to the coordinator.

The trainer calls `offer_samples(step, batch)` while it trains a step (it keeps references to a few rows when
the step is due for a completions table) and `step_finished(step, metrics)` once the step is recorded; both
return at once. A daemon thread does the rest: it opens the backends (services/tracking), adds what is known
only across steps, writes the record to every backend and, every `tracking.completions_every` steps, decodes
the kept rows with the run's tokenizer into (prompt, response, reward). Nothing here can stop or slow
training: every failure is logged once and that part is switched off.

Whatever the run tracks, each recorded step is reported to the coordinator, where followers read it
(ReportingTracker, services/trainer/step_reports.py: another daemon thread). Only the run's last step waits,
a bounded while, for its report to land: the trainer finishes the run after it.

Added to each step's metrics (the trainer's own are in services/trainer/service.py):

    step_s         = wall_time(step N) - wall_time(step N-1)   (the first: since the tracker started)
    samples_per_s  = samples / step_s
    staleness_mean = sum(s * count_s) / sum(count_s) over the step's staleness histogram
    eval           = the run's latest evaluation result, in the first step after it appeared
    reward_by_source/<source> = the step's mean reward per data source (services/run_state/source_rewards.py)
    busy/<service> = the seconds service <service> spent working in [t0, t1] / (t1 - t0), t1 = this step's
                     wall time, t0 = the end of the previous window: at most one window per
                     BUSY_WINDOW_S, so the spans of every service of the run (their `GET /spans`, the
                     coordinator's topology says where) are read a few times a minute, not every step
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

from services.tracking.timeline import fetch_spans, span_client, stage_busy
from services.run_contract.run_config import RunConfig
from services.run_state.evaluations import read_latest_evaluation
from services.run_state.source_rewards import read_source_rewards
from services.tracking.tracker import FanOutTracker, open_trackers
from services.trainer.step_reports import StepReports

log = logging.getLogger(__name__)

BUSY_WINDOW_S = 5.0
LAST_REPORT_WAIT_S = 30.0  # the run's last step waits this long, at most, for the coordinator to get its report


def sample_stats(rewards: Sequence[float], lengths: Sequence[int]) -> dict:
    """reward_mean, reward_std (population), response_length_mean / _max and samples of a step's samples."""
    n = max(len(rewards), 1)
    mean = sum(rewards) / n
    return {
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "response_length_mean": sum(lengths) / max(len(lengths), 1),
        "response_length_max": max(lengths, default=0),
        "samples": len(rewards),
    }


def staleness_mean(histogram: dict | None) -> float | None:
    counts = {int(k): v for k, v in (histogram or {}).items()}
    total = sum(counts.values())
    return sum(s * n for s, n in counts.items()) / total if total else None


class TrainingTracker:
    """`latest_eval()` returns the run's newest evaluation result (a dict of numbers with the version it was
    taken at) or None; `tokenizer_dir` is where the run's tokenizer is (the run's model directory)."""

    def __init__(
        self,
        run: RunConfig,
        run_dir: str,
        tokenizer_dir: str | None = None,
        latest_eval: Callable[[], dict | None] | None = None,
        open_tracker: Callable[..., FanOutTracker] = open_trackers,
        busy_fractions: Callable[[float, float], dict[str, float]] | None = None,
        source_rewards: Callable[[int], dict[str, float]] | None = None,
    ):
        self.run, self.run_dir = run, run_dir
        self.source_rewards = source_rewards
        self.busy_fractions = busy_fractions
        self._busy_since = time.time()
        self.every = run.tracking.completions_every
        self.tokenizer_dir = tokenizer_dir or run.model
        self.latest_eval = latest_eval
        self.open_tracker = open_tracker
        self._samples: dict[int, list] = {}
        self._queue: queue.Queue = queue.Queue()
        self._previous_wall = time.time()
        self._last_eval: dict | None = None
        self._tokenizer: Any = None  # a transformers tokenizer, loaded on first use
        self._failed: set[str] = set()  # parts switched off after a failure (each logged once)
        self._thread = threading.Thread(target=self._work, name="tracking", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called by the trainer

    def offer_samples(self, step: int, batch) -> None:
        """Keep the first completions_rows rows of `batch` (references, no copy) when step N is due."""
        if not self.every or step % self.every or step in self._samples or "completions" in self._failed:
            return
        k = min(self.run.tracking.completions_rows, len(batch["reward"]))
        self._samples[step] = [
            (
                batch["tokens"][i],
                int(batch["prompt_length"][i]),
                int(batch["response_length"][i]),
                float(batch["reward"][i]),
            )
            for i in range(k)
        ]

    def step_finished(self, step: int, metrics: dict) -> None:
        self._queue.put((step, dict(metrics), time.time(), self._samples.pop(step, None)))

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued, then close the backends (a stuck backend is left behind after timeout_s)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "tracking did not finish in time; its last records may be missing", extra={"timeout_s": timeout_s}
            )

    # ------------------------------------------------------------------ the tracking thread

    def _work(self) -> None:
        try:
            tracker = self.open_tracker(
                self.run.tracking, self.run_dir, self.run.name, self.run.model_dump(mode="json")
            )
        except Exception as exc:
            log.warning("tracking could not start; the run goes on without it", extra={"error": repr(exc)})
            while self._queue.get() is not None:  # drained, so the trainer never blocks on it
                pass
            return
        while (item := self._queue.get()) is not None:
            step, metrics, wall_time, samples = item
            self._guarded(
                "metrics", lambda: tracker.log_metrics(step, self.record(metrics, wall_time, step), wall_time)
            )
            if samples:
                self._guarded("completions", lambda: tracker.log_completions(step, self.completions(samples)))
        self._guarded("close", tracker.close)

    def _guarded(self, part: str, call: Callable[[], None]) -> None:
        if part in self._failed:
            return
        try:
            call()
        except Exception as exc:
            self._failed.add(part)
            log.warning(
                "tracking failed; this part is switched off for the rest of the run",
                extra={"part": part, "error": repr(exc)},
            )

    def record(self, metrics: dict, wall_time: float, step: int | None = None) -> dict:
        """The step's metrics with step_s, samples_per_s, staleness_mean, busy, reward_by_source and a new eval
        result (formulas above)."""
        step_s = max(wall_time - self._previous_wall, 1e-9)
        self._previous_wall = wall_time
        out = dict(metrics, step_s=step_s)
        if self.source_rewards is not None and step is not None:
            self._guarded("sources", lambda: self._add_sources(out, step))
        if metrics.get("samples"):
            out["samples_per_s"] = metrics["samples"] / step_s
        mean = staleness_mean(metrics.get("staleness"))
        if mean is not None:
            out["staleness_mean"] = mean
        busy = self.busy_fractions
        if busy is not None and wall_time - self._busy_since >= BUSY_WINDOW_S:
            since, self._busy_since = self._busy_since, wall_time
            self._guarded("busy", lambda: out.update(busy=busy(since, wall_time)))
        if self.latest_eval is not None and "eval" not in self._failed:
            result = self._eval_result()
            if result is not None and result != self._last_eval:
                self._last_eval = result
                out["eval"] = result
        return out

    def _add_sources(self, out: dict, step: int) -> None:
        assert self.source_rewards is not None  # called only when there is one
        by_source = self.source_rewards(step)
        if by_source:
            out["reward_by_source"] = by_source

    def _eval_result(self) -> dict | None:
        assert self.latest_eval is not None  # called only when there is one
        try:
            return self.latest_eval()
        except Exception as exc:
            self._failed.add("eval")
            log.warning("reading the latest eval result failed; evals are not tracked", extra={"error": repr(exc)})
            return None

    def completions(self, samples: list) -> list[dict]:
        """(prompt, response, reward) rows, decoded with the run's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
        rows = []
        for tokens, prompt_length, response_length, reward in samples:
            ids = [int(t) for t in tokens[: prompt_length + response_length]]
            rows.append(
                {
                    "prompt": self._tokenizer.decode(ids[:prompt_length], skip_special_tokens=True),
                    "response": self._tokenizer.decode(ids[prompt_length:], skip_special_tokens=True),
                    "reward": reward,
                }
            )
        return rows


class NoTracking:
    """What the trainer holds when it tracks nothing (no output dir, or not rank 0)."""

    def offer_samples(self, step: int, batch) -> None:
        pass

    def step_finished(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


NO_TRACKING = NoTracking()


class ReportingTracker:
    """Rank 0's hook on each recorded step: reported to the coordinator (`reports`), and passed on to `tracker` (a
    TrainingTracker, or NO_TRACKING without an output dir). The run's last step waits for its report: the trainer
    finishes the run after it, and a follower (`sluice run`) reads the steps up to the run's end only."""

    def __init__(self, reports: StepReports, tracker: TrainingTracker | NoTracking, num_steps: int):
        self.reports, self.tracker, self.num_steps = reports, tracker, num_steps

    def offer_samples(self, step: int, batch) -> None:
        self.tracker.offer_samples(step, batch)

    def step_finished(self, step: int, metrics: dict) -> None:
        last = step == self.num_steps - 1
        if not self.reports.recorded(wait_s=LAST_REPORT_WAIT_S if last else 0.0):
            log.warning(
                "the coordinator did not get the last step's report in time; it is sent again until the trainer ends",
                extra={"step": step, "wait_s": LAST_REPORT_WAIT_S},
            )
        self.tracker.step_finished(step, metrics)

    def close(self) -> None:
        self.tracker.close()
        self.reports.close()


Tracker = ReportingTracker | TrainingTracker | NoTracking  # what the trainer holds: rank 0's, or NO_TRACKING


def eval_reader(redis, run_id: str) -> Callable[[], dict | None] | None:
    """The run's latest evaluation result (services/run_state/evaluations.py) as a dict, read from Redis."""
    if redis is None:
        return None

    def latest() -> dict | None:
        evaluation = read_latest_evaluation(redis, run_id)
        return evaluation.model_dump() if evaluation is not None else None

    return latest


def busy_reader(dcs, run_id: str) -> Callable[[float, float], dict[str, float]] | None:
    """Each live service of the run (the coordinator's topology), busy seconds in [start, end] / (end - start),
    from its spans (services/tracking/timeline.py: the union of its working spans)."""
    if dcs is None:
        return None

    client = span_client()  # one for the run: kept open between reads

    def busy(start: float, end: float) -> dict[str, float]:
        urls = {
            f"{n.role}-{n.rank}": url
            for nodes in dcs.topology().roles.values()
            for n in nodes
            if n.run_id == run_id and n.alive and (url := n.url())
        }
        spans = fetch_spans(urls, since=start, timeout_s=5.0, token=dcs.token or "", client=client)
        seconds = stage_busy(spans, start, end)
        return {lane: round(s / max(end - start, 1e-9), 4) for lane, s in seconds.items()}

    return busy


def open_training_tracker(run: RunConfig, output_dir: str, run_id: str, redis=None, dcs=None) -> Tracker:
    """Rank 0's: the tracker writing to <output_dir>/<run_id> (none when output_dir is empty), behind the step
    reports to the coordinator (ReportingTracker) when there are a coordinator and the run's Redis."""
    tracker: TrainingTracker | NoTracking = NO_TRACKING
    if output_dir:
        tracker = TrainingTracker(
            run,
            os.path.join(output_dir, run_id),
            latest_eval=eval_reader(redis, run_id),
            busy_fractions=busy_reader(dcs, run_id),
            source_rewards=(lambda step: read_source_rewards(redis, run_id, step)) if redis else None,
        )
    if redis is None or dcs is None:
        return tracker
    return ReportingTracker(StepReports(dcs, redis, run_id), tracker, run.num_steps)

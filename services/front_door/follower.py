"""Following a run to its end through the coordinator alone (its run status and the trainer's step records),
so the same loop serves `sluice run` on this machine and `sluice run --attach URL RUN` on a stack elsewhere.

A run ends when the coordinator says it is finished, failed or stopped; a follower also ends it when every
step is recorded (a coordinator whose trainer has not said `finish` yet), when a local service process dies
(`liveness`), or when it is asked to stop following (Ctrl-C)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from services.dcs.client import DCSClient, DCSError
from services.dcs.models import RunStatus

ENDED = ("finished", "failed", "stopped")
_PAGE = 100  # step records per request


@dataclass
class StepSeen:
    step: int
    metrics: dict
    seen_at: float | None  # monotonic, when first seen (samples/s and the ETA); None: done before we looked


@dataclass
class RunProgress:
    """What a view shows: the run's steps so far, its services and how it stands."""

    run_id: str
    num_steps: int
    rows_per_step: int
    started_at: float = field(default_factory=time.monotonic)
    next_step: int = 0
    weight_version: int = 0
    steps: list[StepSeen] = field(default_factory=list)
    status: RunStatus | None = None
    state: str = "starting"  # the run's lifecycle status, or "interrupted" / "unreachable"
    failure: str | None = None  # "role: message" once it failed
    eval_reward: float | None = None
    first_poll_at: float | None = None  # monotonic; steps done before it say nothing of the rate
    extra: dict = field(default_factory=dict)  # more summary fields (the demo's exactly-once check)

    def samples_per_s(self) -> float | None:
        """rows_per_step * (steps seen finishing since the first poll) / (time from it to the last of them)."""
        timed = [s.seen_at for s in self.steps if s.seen_at is not None]
        if self.first_poll_at is None or not timed or timed[-1] <= self.first_poll_at:
            return None
        return self.rows_per_step * len(timed) / (timed[-1] - self.first_poll_at)

    def eta_s(self) -> float | None:
        """(num_steps - next_step) * mean seconds per step seen."""
        rate = self.samples_per_s()
        return (self.num_steps - self.next_step) * self.rows_per_step / rate if rate else None

    def summary(self) -> dict:
        rewards = [s.metrics.get("reward_mean") for s in self.steps if "reward_mean" in s.metrics]
        rate = self.samples_per_s()
        return {
            "event": self.state,
            "run": self.run_id,
            "steps": self.next_step,
            "num_steps": self.num_steps,
            "wall_s": round(time.monotonic() - self.started_at, 2),
            "samples_per_s": round(rate, 3) if rate else None,
            "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "eval_reward": self.eval_reward,
            "weight_version": self.weight_version,
            "failure": self.failure,
            **self.extra,
        }


class View(Protocol):
    def step(self, progress: RunProgress, seen: StepSeen) -> None: ...

    def refresh(self, progress: RunProgress) -> None: ...

    def end(self, progress: RunProgress) -> None: ...


class RunFollower:
    """Polls the coordinator every `poll_s` and feeds a view until the run ends or `interrupt` is set.
    `liveness()` returns a failure message when a local service died; `eval_reward()` the latest held-out
    reward, if the caller can read it. `on_interrupt(progress)` runs when following is interrupted (to pause
    the run); `before_summary(progress)` when following ends, before the summary (to check a finished run:
    it may add to progress.extra, or fail it)."""

    def __init__(
        self,
        dcs: DCSClient,
        run_id: str,
        num_steps: int,
        rows_per_step: int,
        poll_s: float = 0.5,
        liveness: Callable[[], str | None] = lambda: None,
        eval_reward: Callable[[], float | None] = lambda: None,
        on_interrupt: Callable[[RunProgress], None] = lambda progress: None,
        before_summary: Callable[[RunProgress], None] = lambda progress: None,
    ):
        self.dcs = dcs
        self.progress = RunProgress(run_id, num_steps, rows_per_step)
        self.poll_s = poll_s
        self.liveness = liveness
        self.eval_reward = eval_reward
        self.on_interrupt = on_interrupt
        self.before_summary = before_summary
        self.interrupt = threading.Event()

    def poll(self, view: View) -> bool:
        """One look at the run; True once it has ended."""
        p = self.progress
        p.status = self.dcs.status(p.run_id)
        p.state = p.status.status
        failure = p.status.failure
        p.failure = f"{failure.role}: {failure.message}" if failure is not None else None
        self._fetch_steps(view)
        p.eval_reward = self.eval_reward()
        if p.state not in ENDED and p.next_step >= p.num_steps:
            p.state = "finished"
        if p.state not in ENDED and (died := self.liveness()):
            p.state, p.failure = "failed", died
        view.refresh(p)
        return p.state in ENDED

    def _fetch_steps(self, view: View) -> None:
        """The trainer's progress and the step records since the last seen, each shown."""
        p = self.progress
        now: float | None = time.monotonic()  # one time per poll
        if p.first_poll_at is None:
            p.first_poll_at, now = now, None
        while True:
            page = self.dcs.steps(p.run_id, first=p.steps[-1].step + 1 if p.steps else 0, limit=_PAGE)
            p.next_step, p.weight_version = page.next_step, page.weight_version
            new = [StepSeen(record.step, record.metrics, now) for record in page.steps]
            p.steps.extend(new)  # all of them before any is shown: each line shows the rate over them all
            for seen in new:
                view.step(p, seen)
            if len(page.steps) < _PAGE:
                return

    def follow(self, view: View, unreachable_s: float = 60.0) -> RunProgress:
        """Until the run ends or `interrupt` is set (then its state is "interrupted"). A coordinator that
        cannot be reached for `unreachable_s` ends it as failed."""
        p = self.progress
        reached = time.monotonic()
        while not self.interrupt.is_set():
            try:
                if self.poll(view):
                    break
                reached = time.monotonic()
            except DCSError as exc:
                if exc.status != 503:
                    p.state, p.failure = "failed", f"coordinator: {exc}"
                    break
                # 503: the coordinator's Redis is down (being restarted): unreachable for now, as below
                if self._unreachable(exc, reached, unreachable_s, view):
                    break
            except OSError as exc:  # a local coordinator that died is the liveness check's to name
                if self._unreachable(exc, reached, unreachable_s, view):
                    break
            self.interrupt.wait(self.poll_s)
        else:
            p.state = "interrupted"
            self.on_interrupt(p)
            try:  # the steps that finished while it paused
                self._fetch_steps(view)
            except (DCSError, OSError):
                pass
        self.before_summary(p)
        view.end(p)
        return p

    def _unreachable(self, exc: Exception, reached: float, unreachable_s: float, view: View) -> bool:
        """The coordinator did not answer; True (the run failed) once a local service died or it has not
        answered for `unreachable_s`."""
        p = self.progress
        p.failure = self.liveness() or f"coordinator unreachable: {exc}"
        if self.liveness() or time.monotonic() - reached > unreachable_s:
            p.state = "failed"
            return True
        p.state = "unreachable"
        view.refresh(p)
        return False


def exit_code(progress: RunProgress) -> int:
    """0 finished, 1 failed, 3 stopped by an operator, 130 interrupted here (as a shell reports Ctrl-C)."""
    return {"finished": 0, "stopped": 3, "interrupted": 130}.get(progress.state, 1)

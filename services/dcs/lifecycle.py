"""A run's lifecycle on the coordinator: the transitions of `Run.status` and the rules that guard them.

    running --pause--> paused --resume--> running
    running | paused --fail-->   failed     (a role's fatal error; the first failure wins)
    running | paused --finish--> finished   (the trainer trained num_steps)
    running | paused --stop-->   stopped    (the operator: every role exits at its next safe point)

failed, finished and stopped are terminal: nothing leaves them (a transition out is a 409 that changes
nothing). Repeating the transition into the state a run is already in is a no-op (stop of a stopped run,
finish of a finished run); a failure reported to a failed run is kept in its later failures (the newest 10)."""

from __future__ import annotations

from typing import Literal

from services.dcs.models import ENDED, Failure, FailureReport, Run
from services.dcs.state import Conflict, RedisState


def _refuse_if_ended(run: Run, action: str) -> None:
    if run.status in ENDED:
        raise Conflict(f"run {run.run_id} is {run.status}; it cannot {action}")


async def set_desired(state: RedisState, run_id: str, desired: Literal["running", "paused"]) -> Run:
    """Pause (a new pause_seq every role must acknowledge) or resume a running or paused run."""

    def change(run: Run) -> bool:
        _refuse_if_ended(run, "pause" if desired == "paused" else "resume")
        if run.desired_state == desired:
            return False
        run.desired_state = desired
        run.status = desired
        if desired == "paused":
            run.pause_seq += 1
        return True

    return await state.update_run(run_id, change)


async def end(state: RedisState, run_id: str, to: Literal["finished", "stopped"]) -> Run:
    """finish or stop: running | paused -> `to` ("finished" | "stopped"); a no-op if it is already there."""
    now = await state.now()

    def change(run: Run) -> bool:
        if run.status == to:
            return False
        _refuse_if_ended(run, "finish" if to == "finished" else "stop")
        run.status, run.ended_at = to, now
        return True

    return await state.update_run(run_id, change)


async def fail(state: RedisState, run_id: str, report: FailureReport) -> Run:
    """Record a role's fatal error: the first one makes the run failed; later ones are kept beside it.
    A finished or stopped run cannot fail (409)."""
    failure = Failure(**report.model_dump(), at=await state.now())
    later = False

    def change(run: Run) -> bool:
        nonlocal later
        if run.status in ("finished", "stopped"):
            raise Conflict(f"run {run.run_id} is {run.status}; a {run.status} run cannot fail")
        later = run.status == "failed"
        if later:
            return False
        run.status, run.failure, run.ended_at = "failed", failure, failure.at
        return True

    run = await state.update_run(run_id, change)
    if later:
        await state.add_later_failure(run_id, failure)
    return run

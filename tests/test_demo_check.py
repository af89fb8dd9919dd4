"""The demo's end check (services/demo.py exactly_once) on hand-made step records: a finished run must have
trained every step, an interrupted one what it trained so far, each sample once and none too stale."""

from __future__ import annotations

from types import SimpleNamespace

from services.demo import exactly_once
from services.front_door.follower import RunProgress


def _local(trained: int, num_steps: int = 10, rows: int = 4, duplicate: bool = False, stale: int = 1):
    steps = {
        s: {"samples": [f"s{s}-{i}" for i in range(rows)], "metrics": {"staleness": {str(stale): rows}}}
        for s in range(trained)
    }
    if duplicate:
        steps[trained - 1]["samples"][0] = "s0-0"
    run = SimpleNamespace(num_steps=num_steps, rows_per_step=rows, max_staleness=1)
    return SimpleNamespace(run=run, trained_steps=lambda: steps)


def _checked(local, state: str) -> RunProgress:
    progress = RunProgress("demo", local.run.num_steps, local.run.rows_per_step, state=state)
    exactly_once(local, progress)
    return progress


def test_a_finished_run_passes_only_with_every_step_trained():
    assert _checked(_local(10), "finished").extra["every_sample_once"]
    short = _checked(_local(7), "finished")
    assert short.state == "failed" and "expected: 40" in short.failure


def test_an_interrupted_run_is_checked_on_the_steps_it_trained():
    progress = _checked(_local(3), "interrupted")
    assert progress.state == "interrupted" and progress.extra["samples"] == 12 and progress.extra["every_sample_once"]
    assert _checked(_local(0), "interrupted").state == "interrupted"  # nothing trained yet: nothing to check


def test_a_sample_trained_twice_or_too_stale_fails_any_ending():
    for state in ("finished", "interrupted", "stopped"):
        assert _checked(_local(10, duplicate=True), state).state == "failed"
        assert _checked(_local(10, stale=2), state).state == "failed"

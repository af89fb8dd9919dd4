"""Following a run: one JSON line per trained step and a summary, ended by the coordinator's status, by every
step being recorded, by a dead local service, by an unreachable coordinator or by Ctrl-C. The coordinator is
an in-memory stand-in here (tests/front_door/test_rest_commands.py talks to a real one)."""

from __future__ import annotations

import io
import json

from services.dcs.client import DCSError
from services.dcs.models import Failure, Run, RunConfig, RunStatus, ServiceStatus, StepRecord, StepsPage
from services.front_door.follower import RunFollower, exit_code
from services.front_door.live_view import JsonLinesView, RichLiveView, render

CONFIG = RunConfig(
    name="r",
    model="m",
    n_samples_per_prompt=2,
    rollout_batch_size=2,
    global_batch_size=4,
    micro_batch_size=2,
    num_steps=3,
)


class ScriptedCoordinator:
    """Answers status() and steps() from a script: one (status, failure, steps recorded so far) per poll."""

    def __init__(self, script):
        self.script = list(script)
        self.polls = 0

    def _now(self):
        return self.script[min(self.polls, len(self.script) - 1)]

    def status(self, run_id):
        state, failure, _ = self._now()
        run = Run(
            run_id=run_id,
            config=CONFIG,
            desired_state="running",
            pause_seq=0,
            created_at=0.0,
            status=state,
            failure=failure,
        )
        trainer = ServiceStatus(
            node_id="n1",
            role="trainer",
            rank=0,
            state="dead" if failure else "running",
            step=1,
            weight_version=2,
            last_heartbeat=0.0,
            pause_acknowledged=False,
        )
        return RunStatus(run=run, status=state, failure=failure, latest_weight_version=0, services=[trainer])

    def steps(self, run_id, first=0, limit=100):
        _, _, recorded = self._now()
        self.polls += 1
        records = [
            StepRecord(
                step=s, metrics={"reward_mean": 0.1 * s, "loss": 1.0, "weight_version": s + 1, "staleness": {"0": 4}}
            )
            for s in range(first, min(recorded, first + limit))
        ]
        return StepsPage(next_step=recorded, weight_version=recorded, steps=records)


class Unreachable:
    def status(self, run_id):
        raise ConnectionRefusedError("connection refused")


def follow(coordinator, **kwargs):
    out = io.StringIO()
    follower = RunFollower(coordinator, "r", CONFIG.num_steps, CONFIG.rows_per_step, poll_s=0, **kwargs)
    progress = follower.follow(JsonLinesView(out))
    return progress, [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_line_per_step_and_the_summary_when_the_run_finishes():
    script = [("running", None, 0), ("running", None, 2), ("running", None, 2), ("finished", None, 3)]
    progress, lines = follow(ScriptedCoordinator(script), eval_reward=lambda: 0.5)
    assert [line.get("step") for line in lines[:-1]] == [0, 1, 2]
    assert lines[1]["reward_mean"] == 0.1 and lines[1]["weight_version"] == 2 and lines[1]["eval_reward"] == 0.5
    assert "staleness" not in lines[0]  # a dict per step: only its max is shown
    summary = lines[-1]
    assert summary["event"] == "finished" and summary["steps"] == 3 and summary["failure"] is None
    assert summary["reward_first"] == 0.0 and summary["reward_last"] == 0.2
    assert exit_code(progress) == 0


def test_every_step_recorded_ends_the_run_before_the_coordinator_says_so():
    progress, lines = follow(ScriptedCoordinator([("running", None, 3)]))
    assert lines[-1]["event"] == "finished" and exit_code(progress) == 0


def test_a_failure_on_the_coordinator_ends_it_with_the_role_and_message():
    failure = Failure(role="rollout", node_id=None, message="reward 'import:x:y' does not import", at=1.0)
    progress, lines = follow(ScriptedCoordinator([("running", None, 1), ("failed", failure, 1)]))
    assert lines[-1]["event"] == "failed"
    assert lines[-1]["failure"] == "rollout: reward 'import:x:y' does not import"
    assert exit_code(progress) == 1


def test_a_dead_local_service_ends_it_as_failed():
    progress, lines = follow(
        ScriptedCoordinator([("running", None, 1)]), liveness=lambda: "trainer exited with code 1: boom"
    )
    assert (lines[-1]["event"], lines[-1]["failure"]) == ("failed", "trainer exited with code 1: boom")
    assert exit_code(progress) == 1


def test_a_coordinator_gone_too_long_fails_it():
    out = io.StringIO()
    follower = RunFollower(Unreachable(), "r", 3, 4, poll_s=0)
    progress = follower.follow(JsonLinesView(out), unreachable_s=0)
    assert progress.state == "failed" and "connection refused" in progress.failure
    assert exit_code(progress) == 1


class RedisRestarting(ScriptedCoordinator):
    """The coordinator answers 503 (its Redis is down) on the polls named, and from the script otherwise."""

    def __init__(self, script, unavailable: set[int]):
        super().__init__(script)
        self.unavailable = unavailable

    def status(self, run_id):
        if self.polls in self.unavailable:
            self.polls += 1
            raise DCSError(503, "redis unavailable")
        return super().status(run_id)


def test_a_coordinator_answering_503_while_its_redis_restarts_does_not_end_the_run():
    script = [
        ("running", None, 0),
        ("running", None, 1),
        ("running", None, 1),
        ("running", None, 2),
        ("finished", None, 3),
    ]
    progress, lines = follow(RedisRestarting(script, unavailable={1, 2}))
    assert progress.state == "finished" and exit_code(progress) == 0
    assert [line.get("step") for line in lines[:-1]] == [0, 1, 2]


def test_a_coordinator_answering_503_for_too_long_fails_the_run():
    follower = RunFollower(RedisRestarting([("running", None, 0)], unavailable={0}), "r", 3, 4, poll_s=0)
    progress = follower.follow(JsonLinesView(io.StringIO()), unreachable_s=0)
    assert progress.state == "failed" and "503" in progress.failure


def test_an_interrupt_pauses_then_shows_the_steps_that_finished_meanwhile():
    paused = []
    follower = RunFollower(
        ScriptedCoordinator([("running", None, 2)]),
        "r",
        3,
        4,
        poll_s=0,
        on_interrupt=lambda progress: paused.append(progress.state),
    )
    follower.interrupt.set()
    out = io.StringIO()
    progress = follower.follow(JsonLinesView(out))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert paused == ["interrupted"]
    assert [line.get("step") for line in lines] == [0, 1, None] and lines[-1]["event"] == "interrupted"
    assert progress.next_step == lines[-1]["steps"] == 2 and exit_code(progress) == 130


def test_the_live_panel_shows_the_step_reward_services_and_failure():
    from rich.console import Console

    failure = Failure(role="trainer", node_id=None, message="CUDA out of memory", at=1.0)
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    follower = RunFollower(ScriptedCoordinator([("running", None, 2), ("failed", failure, 2)]), "r", 3, 4, poll_s=0)
    progress = follower.follow(RichLiveView(console))
    text = console.file.getvalue()
    assert "failed" in text and "step 2/3" in text and "failure: trainer: CUDA out of memory" in text
    console.file = io.StringIO()
    console.print(render(progress))
    panel = console.file.getvalue()
    assert "0.1" in panel  # the last step's reward
    trainer_row = next(line for line in panel.splitlines() if "trainer" in line and "dead" in line)
    assert "CUDA out of memory" in trainer_row  # the service's last error


def test_steps_seen_in_one_poll_show_one_rate_and_steps_done_before_the_first_poll_none():
    script = [("running", None, 1), ("running", None, 1), ("running", None, 3), ("finished", None, 3)]
    follower = RunFollower(ScriptedCoordinator(script), "r", 3, 4, poll_s=0.01)
    out = io.StringIO()
    follower.follow(JsonLinesView(out))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    rates = [line["samples_per_s"] for line in lines if "step" in line]
    assert rates[0] is None  # step 0 was done before the follower looked: it says nothing of the rate
    assert rates[1] == rates[2] is not None and rates[1] > 0  # both counted once the poll saw them


def test_the_panel_shows_eta_rates_staleness_version_and_eval():
    from rich.console import Console

    from services.front_door.follower import RunProgress, StepSeen

    progress = RunProgress(
        run_id="r",
        num_steps=10,
        rows_per_step=4,
        started_at=0.0,
        next_step=4,
        weight_version=4,
        state="running",
        eval_reward=0.625,
        first_poll_at=100.0,
    )
    progress.steps = [
        StepSeen(
            step=s,
            metrics={"reward_mean": 0.5, "loss": 0.25, "tokens_per_s": 1234.0, "staleness_max": 1},
            seen_at=100.0 + 2.0 * s,
        )
        for s in (1, 2, 3)
    ]
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    console.print(render(progress))
    panel = console.file.getvalue()
    # 3 steps of 4 rows in 6 s: 2 rows/s; 6 steps left: 12 s
    assert "step 4/10" in panel and "ETA 0m12s" in panel
    header = next(line for line in panel.splitlines() if "tokens/s" in line).split()
    values = panel.splitlines()[
        panel.splitlines().index(next(line for line in panel.splitlines() if "tokens/s" in line)) + 1
    ].split()
    shown = dict(zip(["reward", "eval", "loss", "samples/s", "tokens/s", "staleness", "version"], values))
    assert header[-3:] == ["tokens/s", "staleness", "version"]
    assert shown == {
        "reward": "0.5",
        "eval": "0.625",
        "loss": "0.25",
        "samples/s": "2",
        "tokens/s": "1234",
        "staleness": "1",
        "version": "4",
    }


def test_auto_view_is_the_panel_on_a_terminal_and_json_lines_otherwise(monkeypatch):
    import sys

    from services.front_door.live_view import choose_view

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert isinstance(choose_view("auto"), RichLiveView)
    assert isinstance(choose_view("json"), JsonLinesView)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert isinstance(choose_view("auto"), JsonLinesView)
    assert isinstance(choose_view("live"), RichLiveView)

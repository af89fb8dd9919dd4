"""The tracking backends write what a step logs, readable back with each tool's own reader; the fan-out keeps
going when one backend fails; steps.jsonl holds every record."""

from __future__ import annotations

import json
import logging

import pytest

from services.run_contract.run_config import TrackingSettings
from services.tracking import backends
from services.tracking.tracker import FanOutTracker, StepsLog, open_trackers, scalar_metrics

T0 = 1_700_000_000.0
STEPS = [
    {"reward_mean": 0.25, "loss": 1.5, "staleness": {"0": 3, "1": 1}, "weight_version": 1, "note": "x"},
    {"reward_mean": 0.75, "loss": 0.5, "staleness": {"1": 4}, "weight_version": 2, "note": "y"},
]
CONFIG = {"name": "run-a", "optim": {"lr": 1e-6, "betas": [0.9, 0.999]}}  # a run's configuration, as JSON
ROWS = [
    {"prompt": "reverse abc", "response": "c|b\na", "reward": 1.0},
    {"prompt": "p2", "response": "r2", "reward": 0.0},
]


def log_two_steps(tracker) -> None:
    for step, metrics in enumerate(STEPS):
        tracker.log_metrics(step, metrics, T0 + step)
    tracker.log_completions(1, ROWS)
    tracker.close()


def test_scalar_metrics_flattens_histograms_and_drops_what_is_not_a_number():
    assert scalar_metrics({**STEPS[0], "nan": float("nan")}) == {
        "reward_mean": 0.25,
        "loss": 1.5,
        "staleness/0": 3.0,
        "staleness/1": 1.0,
        "weight_version": 1.0,
    }


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_two_steps(backends.TensorBoardTracker(str(tmp_path / "tb"), CONFIG))
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    assert [(e.step, e.value, e.wall_time) for e in events.Scalars("reward_mean")] == [(0, 0.25, T0), (1, 0.75, T0 + 1)]
    assert [(e.step, e.value) for e in events.Scalars("staleness/1")] == [(0, 1.0), (1, 4.0)]
    assert "note" not in events.Tags()["scalars"]
    [text] = events.Tensors("completions/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 1 and "| reverse abc | c\\|b\\na | 1.0 |" in table and "| p2 | r2 | 0.0 |" in table
    [config] = events.Tensors("run_config/text_summary")
    assert json.loads(config.tensor_proto.string_val[0].decode().strip("`\n")) == CONFIG


def test_steps_log_appends_one_json_line_per_step_and_completion(tmp_path):
    log_two_steps(StepsLog(str(tmp_path), CONFIG))
    log_two_steps(StepsLog(str(tmp_path)))  # a restarted trainer appends
    assert json.loads((tmp_path / "run_config.json").read_text()) == CONFIG
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert steps[:2] == [{"step": i, "wall_time": T0 + i, **m} for i, m in enumerate(STEPS)] and len(steps) == 4
    completions = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert completions[:2] == [{"step": 1, **row} for row in ROWS]


class Recording:
    def __init__(self):
        self.calls, self.closed = [], False

    def log_metrics(self, step, metrics, wall_time):
        self.calls.append(("metrics", step))

    def log_completions(self, step, rows):
        self.calls.append(("completions", step))

    def close(self):
        self.closed = True


class Broken(Recording):
    def log_metrics(self, step, metrics, wall_time):
        raise OSError("disk full")


def test_a_backend_that_raises_is_logged_once_and_dropped_and_the_others_go_on(caplog):
    good, broken = Recording(), Broken()
    fan_out = FanOutTracker({"broken": broken, "good": good})
    with caplog.at_level(logging.WARNING, logger="services.tracking.tracker"):
        log_two_steps(fan_out)
    assert good.calls == [("metrics", 0), ("metrics", 1), ("completions", 1)] and good.closed
    assert broken.calls == [] and broken.closed
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.backend == "broken" and "disk full" in warning.error


def test_a_backend_that_cannot_start_is_left_out(tmp_path, monkeypatch, caplog):
    def missing(*args):
        raise ImportError("No module named 'wandb'")

    monkeypatch.setattr(backends, "WandbTracker", missing)
    with caplog.at_level(logging.WARNING, logger="services.tracking.tracker"):
        fan_out = open_trackers(TrackingSettings(report_to=["wandb", "tensorboard"]), str(tmp_path), "run")
    assert sorted(fan_out.backends) == ["steps.jsonl", "tensorboard"]
    assert any("sluice-rl[tracking]" in r.getMessage() for r in caplog.records)
    log_two_steps(fan_out)
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 2 and (tmp_path / "tensorboard").is_dir()


def test_report_to_is_validated():
    with pytest.raises(ValueError, match="none alone"):
        TrackingSettings(report_to=["none", "wandb"])
    with pytest.raises(ValueError, match="at most once"):
        TrackingSettings(report_to=["wandb", "wandb"])
    with pytest.raises(ValueError):
        TrackingSettings(report_to=["neptune"])
    assert TrackingSettings().report_to == ["tensorboard"]

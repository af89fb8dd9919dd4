"""What a tracking backend does, the run's own step log, and the fan-out to every backend of a run.

A backend (services/tracking/backends.py) implements `Tracker`. The trainer talks to one `FanOutTracker`: a
backend that raises is logged once and dropped, so tracking never stops training. `StepsLog` is always on: one
JSON line per step in `<run dir>/steps.jsonl` and per sample completion in `<run dir>/completions.jsonl`, the
input of `sluice report` (services/tracking/report.py)."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Protocol, Sequence

from services.run_contract.run_config import TrackingSettings

log = logging.getLogger(__name__)

STEPS_FILE = "steps.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
RUN_CONFIG_FILE = "run_config.json"


class Tracker(Protocol):
    """One tracking backend. `metrics` is a step's record: numbers, and dicts of numbers (a histogram such
    as staleness), see `scalar_metrics`; each completion row has prompt, response and reward."""

    def log_metrics(self, step: int, metrics: dict, wall_time: float) -> None: ...

    def log_completions(self, step: int, rows: Sequence[dict]) -> None: ...

    def close(self) -> None: ...


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The finite numbers of a step's record; a dict value becomes one scalar per key (`staleness/0`)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, dict):
            out.update({f"{name}/{k}": v for k, v in scalar_metrics(value).items()})
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
    return out


class StepsLog:
    """`<run dir>/steps.jsonl` (one record per step: step, wall_time and the step's metrics as the trainer
    recorded them) and `<run dir>/completions.jsonl` (one line per logged sample). Appends, so a restarted
    trainer continues the same files; each line is flushed when written. `run_config` goes to
    `<run dir>/run_config.json`."""

    def __init__(self, run_dir: str, run_config: dict | None = None):
        os.makedirs(run_dir, exist_ok=True)
        if run_config is not None:
            with open(os.path.join(run_dir, RUN_CONFIG_FILE), "w", encoding="utf-8") as f:
                json.dump(run_config, f, indent=2)
        self.steps = open(os.path.join(run_dir, STEPS_FILE), "a", encoding="utf-8")
        self.completions = open(os.path.join(run_dir, COMPLETIONS_FILE), "a", encoding="utf-8")

    def log_metrics(self, step: int, metrics: dict, wall_time: float) -> None:
        self.steps.write(json.dumps({"step": step, "wall_time": wall_time, **metrics}, default=str) + "\n")
        self.steps.flush()

    def log_completions(self, step: int, rows: Sequence[dict]) -> None:
        for row in rows:
            self.completions.write(json.dumps({"step": step, **row}) + "\n")
        self.completions.flush()

    def close(self) -> None:
        self.steps.close()
        self.completions.close()


class FanOutTracker:
    """Every call goes to each backend in turn; one that raises is logged once, closed and dropped."""

    def __init__(self, backends: dict[str, Tracker]):
        self.backends = dict(backends)

    def _each(self, call: str, *args) -> None:
        for name, backend in list(self.backends.items()):
            try:
                getattr(backend, call)(*args)
            except Exception as exc:
                log.warning(
                    "tracking backend failed; it is disabled for the rest of the run",
                    extra={"backend": name, "call": call, "error": repr(exc)},
                )
                del self.backends[name]
                if call != "close":
                    try:
                        backend.close()
                    except Exception:
                        pass  # already reported as failed

    def log_metrics(self, step: int, metrics: dict, wall_time: float) -> None:
        self._each("log_metrics", step, metrics, wall_time)

    def log_completions(self, step: int, rows: Sequence[dict]) -> None:
        self._each("log_completions", step, rows)

    def close(self) -> None:
        self._each("close")
        self.backends.clear()


def open_backend(
    name: str, settings: TrackingSettings, run_dir: str, run_name: str, run_config: dict | None = None
) -> Tracker:
    """The backend `name` of `report_to`, writing under `run_dir` (imported here: each needs its package);
    `run_config` (the run's configuration as JSON) is recorded with the run: its hyper-parameters."""
    from services.tracking import backends

    experiment, config = settings.experiment or run_name, run_config or {}
    if name == "tensorboard":
        return backends.TensorBoardTracker(os.path.join(run_dir, "tensorboard"), config)
    if name == "wandb":
        return backends.WandbTracker(run_dir, settings.project, experiment, config)
    if name == "mlflow":
        return backends.MLflowTracker(os.path.join(run_dir, "mlflow"), settings.project, experiment, config)
    raise ValueError(f"tracking.report_to: unknown backend {name!r}; one of tensorboard, wandb, mlflow, none")


def open_trackers(
    settings: TrackingSettings, run_dir: str, run_name: str, run_config: dict | None = None
) -> FanOutTracker:
    """steps.jsonl (and run_config.json) plus every backend of `settings.report_to`; one that cannot start
    (its package missing, its files not writable) is logged and left out, so the run goes on with the others."""
    backends: dict[str, Tracker] = {"steps.jsonl": StepsLog(run_dir, run_config)}
    for name in settings.report_to:
        if name == "none":
            continue
        try:
            backends[name] = open_backend(name, settings, run_dir, run_name, run_config)
        except Exception as exc:
            hint = " (pip install 'sluice-rl[tracking]')" if isinstance(exc, ImportError) else ""
            log.warning(
                f"tracking backend {name} could not start{hint}; the run goes on without it",
                extra={"backend": name, "error": repr(exc)},
            )
    return FanOutTracker(backends)

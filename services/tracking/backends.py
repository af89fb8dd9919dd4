"""The tracking backends, all local files under the run dir and no account: TensorBoard event files (the
default; `tensorboard --logdir <run dir>/tensorboard`), a W&B run in offline mode (`wandb sync` uploads it
later) and a local MLflow store (`mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow/mlflow.db`). Each imports its package
when it is made, so a run that does not use W&B or MLflow needs neither (they are the `tracking` extra)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

from services.tracking.tracker import scalar_metrics

COLUMNS = ("prompt", "response", "reward")


def completions_markdown(rows: Sequence[dict]) -> str:
    """A markdown table of the rows (TensorBoard's text plugin renders markdown); cells on one line."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def flat_params(config: dict, prefix: str = "") -> dict[str, object]:
    """A nested configuration as dotted keys: {"optim": {"lr": 1e-6}} -> {"optim.lr": 1e-6}."""
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardTracker:
    """Scalars under their metric names (a dict metric as `name/key`), completions as a markdown table under
    the `completions` text tag; flushed every step so a live TensorBoard sees each one."""

    def __init__(self, log_dir: str, run_config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)
        if run_config:  # the hyper-parameters, as the text tab shows them
            self.writer.add_text("run_config", "```\n" + json.dumps(run_config, indent=2) + "\n```", global_step=0)

    def log_metrics(self, step: int, metrics: dict, wall_time: float) -> None:
        for name, value in scalar_metrics(metrics).items():
            self.writer.add_scalar(name, value, global_step=step, walltime=wall_time)
        self.writer.flush()

    def log_completions(self, step: int, rows: Sequence[dict]) -> None:
        self.writer.add_text("completions", completions_markdown(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in offline mode under `<run dir>/wandb` (nothing leaves the machine; `wandb sync` uploads
    it); completions as a `wandb.Table`. W&B's capture of the process's console is off: the service's
    stdout is its JSON log."""

    def __init__(self, run_dir: str, project: str, name: str, run_config: dict | None = None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            name=name,
            dir=run_dir,
            mode="offline",
            reinit="create_new",
            config=run_config or {},
            settings=wandb.Settings(console="off", silent=True),
        )

    def log_metrics(self, step: int, metrics: dict, wall_time: float) -> None:
        self.run.log({**scalar_metrics(metrics), "wall_time": wall_time}, step=step)

    def log_completions(self, step: int, rows: Sequence[dict]) -> None:
        table = self.wandb.Table(columns=list(COLUMNS), data=[[row.get(c) for c in COLUMNS] for row in rows])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before W&B's service process has written the run file; teardown waits for it
        self.wandb.teardown()


class MLflowTracker:
    """One MLflow run in a local store under `store_dir`: `mlflow.db` (SQLite: MLflow's file store is in
    maintenance mode and refused by default since 3.x) and `artifacts/`, in experiment `experiment_name`;
    completions as a JSON artifact per step (`completions/step_000010.json`)."""

    def __init__(self, store_dir: str, experiment_name: str, run_name: str, run_config: dict | None = None):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        store = Path(store_dir).resolve()
        store.mkdir(parents=True, exist_ok=True)
        self.Metric = Metric
        self.client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(experiment_name, artifact_location=(store / "artifacts").as_uri())
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in flat_params(run_config or {}).items()]
        for start in range(0, len(params), 100):  # MLflow's per-call limit
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log_metrics(self, step: int, metrics: dict, wall_time: float) -> None:
        ms = int(wall_time * 1000)
        batch = [
            self.Metric(key=name.replace(":", "_"), value=value, timestamp=ms, step=step)
            for name, value in scalar_metrics(metrics).items()
        ]
        for start in range(0, len(batch), 1000):  # MLflow's per-call limit
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_completions(self, step: int, rows: Sequence[dict]) -> None:
        # MLflow writes any JSON value (a list here), though its hint names a dict
        self.client.log_dict(
            self.run_id,
            [dict(row) for row in rows],  # type: ignore[arg-type]
            f"completions/step_{step:06d}.json",
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id, end_time=int(time.time() * 1000))

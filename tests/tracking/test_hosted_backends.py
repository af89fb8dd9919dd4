"""The optional backends (the `tracking` extra, which the `test` extra installs), offline and local: a W&B
offline run under the run dir with the metrics in its run file, and a local MLflow store (SQLite and an
artifact dir) with the metrics and completions; no network."""

from __future__ import annotations

import json
import struct

import mlflow

from services.tracking import backends
from tests.tracking.test_trackers import CONFIG, ROWS, T0, log_two_steps


def wandb_records(run_file) -> list[bytes]:
    """The records of a W&B run file: after a 7-byte file header (`:W&B`, magic, version), LevelDB's log format:
    32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def wandb_rows(run_file, kind: str) -> list[dict]:
    """The records of one kind of an offline W&B run file as dicts: "history" (what run.log wrote), "run" (its
    config, as wandb.init got it)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for data in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == kind:
            items = record.history.item if kind == "history" else record.run.config.update
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def test_wandb_offline_run_is_written_under_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: any network use would fail
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log_two_steps(backends.WandbTracker(str(tmp_path), "sluice-test", "run-a", CONFIG))
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    [run_file] = run_dir.glob("run-*.wandb")
    history = wandb_rows(run_file, "history")
    [config] = wandb_rows(run_file, "run")
    assert (config["name"], config["optim"]) == (CONFIG["name"], CONFIG["optim"])
    metrics = [(h["_step"], h["reward_mean"], h["staleness/1"], h["wall_time"]) for h in history if "reward_mean" in h]
    assert metrics == [(0, 0.25, 1, T0), (1, 0.75, 4, T0 + 1)]
    [table] = [h for h in history if "completions/_type" in h]
    assert (table["_step"], table["completions/_type"], table["completions/nrows"]) == (1, "table-file", len(ROWS))
    written = json.loads((run_dir / "files" / table["completions/path"]).read_text())
    assert written["columns"] == ["prompt", "response", "reward"]
    assert written["data"] == [[row["prompt"], row["response"], row["reward"]] for row in ROWS]


def test_mlflow_local_store_has_the_metrics_and_completions(tmp_path):
    tracker = backends.MLflowTracker(str(tmp_path / "mlflow"), "sluice-test", "run-a", CONFIG)
    run_id = tracker.run_id
    log_two_steps(tracker)
    assert sorted(p.name for p in (tmp_path / "mlflow").iterdir()) == ["artifacts", "mlflow.db"]  # all under it
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.params == {"name": "run-a", "optim.lr": "1e-06", "optim.betas": "[0.9, 0.999]"}
    assert client.get_experiment(run.info.experiment_id).name == "sluice-test"
    history = sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, "reward_mean"))
    assert history == [(0, 0.25, int(T0 * 1000)), (1, 0.75, int((T0 + 1) * 1000))]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "staleness/0")] == [(0, 3.0)]
    [artifact] = client.list_artifacts(run_id, "completions")
    assert artifact.path == "completions/step_000001.json"
    local = client.download_artifacts(run_id, artifact.path, str(tmp_path / "download"))
    assert json.loads(open(local).read()) == ROWS

"""`sluice report`: report.png and summary.json from a synthetic steps.jsonl (and spans.json), and its errors."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import matplotlib.image
import pytest

from services.cli import main as sluice
from services.tracking.report import ReportError, report_at_end, save_spans, write_report

T0 = 1_700_000_000.0
REWARDS = [0.1, 0.3, 0.2, 0.6, 0.8]


def write_steps(run_dir, rewards=REWARDS, duplicate_step: int | None = 2) -> None:
    """One record per step, 10 s apart, 4 samples of 20 tokens each; an eval result at steps 0 and 4; step
    `duplicate_step` recorded twice (a restarted trainer), the second record the one that counts."""
    lines = []
    for step, reward in enumerate(rewards):
        row = {
            "step": step,
            "wall_time": T0 + 10 * (step + 1),
            "step_s": 10.0,
            "reward_mean": reward,
            "reward_std": 0.1,
            "samples": 4,
            "tokens": 80,
            "response_length_mean": 5.0 + step,
            "response_length_max": 8 + step,
            "staleness": {"0": 2, "1": 2},
            "staleness_mean": 0.5,
            "staleness_max": 1,
            "weight_version": step + 1,
        }
        if step in (0, 4):
            row["eval"] = {"mean_reward": 0.05 + 0.1 * step, "pass_at_k": 0.5}
        if step == duplicate_step:
            lines.append(json.dumps({**row, "reward_mean": -5.0}))
        lines.append(json.dumps(row))
    (run_dir / "steps.jsonl").write_text("\n".join(lines) + "\n")


def test_report_summary_and_png_from_steps(tmp_path):
    write_steps(tmp_path)
    paths = write_report(str(tmp_path), thresholds=(0.25, 0.7, 0.95))
    assert paths == {"png": str(tmp_path / "report.png"), "summary": str(tmp_path / "summary.json")}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 5 and (summary["first_step"], summary["last_step"]) == (0, 4)
    assert summary["wall_time_s"] == 50.0  # from the start of step 0 (its end minus its step_s) to step 4's end
    assert summary["reward"] == {"first": 0.1, "last": 0.8, "best": 0.8, "best_step": 4}
    assert summary["eval_reward"] == {
        "first": 0.05,
        "last": pytest.approx(0.45),
        "best": pytest.approx(0.45),
        "best_step": 4,
    }
    assert summary["time_to_reward"] == [
        {"threshold": 0.25, "step": 1, "seconds": 20.0},
        {"threshold": 0.7, "step": 4, "seconds": 50.0},
        {"threshold": 0.95, "step": None, "seconds": None},
    ]
    assert summary["throughput"]["samples_per_s"] == pytest.approx(20 / 50)
    assert summary["throughput"]["tokens_per_s"] == pytest.approx(400 / 50)
    assert summary["last_weight_version"] == 5
    height, width, _ = matplotlib.image.imread(paths["png"]).shape
    assert width > 1000 and height > 700


def test_report_draws_the_service_timeline_when_spans_were_saved(tmp_path):
    write_steps(tmp_path)
    write_report(str(tmp_path))
    without = matplotlib.image.imread(str(tmp_path / "report.png")).shape[0]
    spans = {
        "trainer": [
            {"name": "claim", "start": T0, "end": T0 + 5, "step": 0, "version": 0},
            {"name": "train", "start": T0 + 5, "end": T0 + 9, "step": 0, "version": 0},
        ],
        "rollout": [{"name": "generate", "start": T0, "end": T0 + 8, "step": 0, "version": 0}],
        "advantage": [],
    }
    save_spans(str(tmp_path), spans)
    write_report(str(tmp_path))
    assert matplotlib.image.imread(str(tmp_path / "report.png")).shape[0] > without  # a timeline panel below


def test_report_of_a_dir_without_steps_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(ReportError, match="steps.jsonl does not exist"):
        write_report(str(tmp_path))
    assert sluice(["report", str(tmp_path)]) == 2
    assert "steps.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "steps.jsonl").write_text('{"step": 0, "wall_time": 1.0}\nnot json\n')
    with pytest.raises(ReportError, match="steps.jsonl:2 is not a step record"):
        write_report(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]


def test_sluice_report_command_prints_the_paths(tmp_path, capsys):
    write_steps(tmp_path, duplicate_step=None)
    assert sluice(["report", str(tmp_path), "--thresholds", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "png": str(tmp_path / "report.png"),
        "summary": str(tmp_path / "summary.json"),
    }
    assert json.loads((tmp_path / "summary.json").read_text())["time_to_reward"] == [
        {"threshold": 0.5, "step": 3, "seconds": 40.0}
    ]


class SpansService(BaseHTTPRequestHandler):
    """A service's GET /spans behind its bearer token (services/runtime/metrics.py serves the real one)."""

    spans = [{"name": "train", "start": T0, "end": T0 + 4, "step": 0, "version": 0}]

    def do_GET(self):
        ok = self.path.startswith("/spans") and self.headers.get("Authorization") == "Bearer tok"
        body = json.dumps({"service": "trainer", "now": T0, "spans": self.spans}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body if ok else b"{}")

    def log_message(self, *args):
        pass


def test_report_at_end_saves_the_services_spans_then_writes_the_report(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), SpansService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert report_at_end(str(tmp_path), {"trainer": url}, token="tok") is None  # nothing trained: no report
        write_steps(tmp_path)
        paths = report_at_end(str(tmp_path), {"trainer": url, "gone": "http://127.0.0.1:9"}, token="tok")
    finally:
        server.shutdown()
        server.server_close()
    assert json.loads((tmp_path / "spans.json").read_text()) == {"trainer": SpansService.spans}  # gone: no lane
    assert json.loads(open(paths["summary"]).read())["steps"] == 5

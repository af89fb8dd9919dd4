"""`sluice report RUN_DIR`: a run's report from the files the trainer wrote there (services/tracking/tracker.py).

Inputs: `steps.jsonl` (one record per trained step), and `spans.json` ({service: spans}, services/runtime/spans.py)
when whoever ran the services saved it (`save_spans`). Outputs, in RUN_DIR:

  report.png    reward (mean, +- std band) and eval reward against step and against wall time, response length
                (mean, max), staleness (mean, max), and the per-service timeline when spans.json is there
  summary.json  steps, wall time, first / last / best reward (and eval reward), time to reward thresholds,
                throughput

Wall time is counted from the start of the first step: t0 = wall_time(first) - step_s(first). Time to reward t
is the elapsed time (and step) of the first step whose reward_mean >= t (null if never). Throughput over
the run: samples/s = sum(samples) / wall time, tokens/s = sum(tokens) / wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from services.runtime.settings_cli import HelpWithDefaults
from services.tracking.tracker import STEPS_FILE

log = logging.getLogger(__name__)

SPANS_FILE = "spans.json"
PNG_FILE, SUMMARY_FILE = "report.png", "summary.json"
DEFAULT_THRESHOLDS = (0.25, 0.5, 0.75, 0.9)
EVAL_REWARD_KEYS = ("mean_reward", "reward_mean", "reward")  # the first one an eval result has is plotted


class ReportError(ValueError):
    """The run dir has nothing to report (no steps.jsonl, or no step in it)."""


def load_steps(run_dir: str) -> list[dict]:
    """The step records, by step; a step recorded twice (a restarted trainer) keeps its last record."""
    path = os.path.join(run_dir, STEPS_FILE)
    if not os.path.isfile(path):
        raise ReportError(f"{path} does not exist: RUN_DIR must be a trainer's run dir (<output_dir>/<run_id>)")
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                by_step[int(row["step"])] = row
            except (ValueError, KeyError, TypeError) as exc:
                raise ReportError(f"{path}:{number} is not a step record ({exc})") from None
    if not by_step:
        raise ReportError(f"{path} holds no steps yet")
    return [by_step[s] for s in sorted(by_step)]


def eval_reward(row: dict) -> float | None:
    result = row.get("eval") or {}
    return next((float(result[k]) for k in EVAL_REWARD_KEYS if isinstance(result.get(k), (int, float))), None)


def elapsed(rows: list[dict]) -> list[float]:
    """Seconds since the start of the first step, for each row."""
    t0 = rows[0]["wall_time"] - float(rows[0].get("step_s", 0.0))
    return [row["wall_time"] - t0 for row in rows]


def _extremes(points: list[tuple[int, float]]) -> dict | None:
    if not points:
        return None
    best_step, best = max(points, key=lambda p: p[1])
    return {"first": points[0][1], "last": points[-1][1], "best": best, "best_step": best_step}


def summarize(rows: list[dict], thresholds=DEFAULT_THRESHOLDS) -> dict:
    """summary.json's content (formulas in the module docstring)."""
    times = elapsed(rows)
    wall = times[-1]
    rewards = [(r["step"], float(r["reward_mean"])) for r in rows if isinstance(r.get("reward_mean"), (int, float))]
    evals = [(r["step"], v) for r in rows if (v := eval_reward(r)) is not None]
    reached = []
    for t in thresholds:
        hit = next(
            (
                (r["step"], s)
                for r, s in zip(rows, times)
                if isinstance(r.get("reward_mean"), (int, float)) and r["reward_mean"] >= t
            ),
            None,
        )
        reached.append({"threshold": t, "step": hit[0] if hit else None, "seconds": round(hit[1], 3) if hit else None})
    samples = sum(r.get("samples", 0) for r in rows)
    tokens = sum(r.get("tokens", 0) for r in rows)
    return {
        "steps": len(rows),
        "first_step": rows[0]["step"],
        "last_step": rows[-1]["step"],
        "wall_time_s": round(wall, 3),
        "reward": _extremes(rewards),
        "eval_reward": _extremes(evals),
        "time_to_reward": reached,
        "throughput": {
            "samples_per_s": samples / wall if wall > 0 else None,
            "tokens_per_s": tokens / wall if wall > 0 else None,
            "steps_per_min": 60 * len(rows) / wall if wall > 0 else None,
        },
        "last_weight_version": rows[-1].get("weight_version"),
    }


def load_spans(run_dir: str) -> dict[str, list[dict]] | None:
    path = os.path.join(run_dir, SPANS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        spans = json.load(f)
    return {lane: s for lane, s in spans.items() if s} or None


def save_spans(run_dir: str, spans_by_lane: dict[str, list[dict]]) -> str:
    """Write {service: spans} (services/tracking/timeline.py fetch_spans) as the report's timeline input."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, SPANS_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spans_by_lane, f)
    return path


def _series(rows: list[dict], key: str, xs: list) -> tuple[list, list]:
    pairs = [(x, float(r[key])) for x, r in zip(xs, rows) if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _reward_panel(ax, rows: list[dict], xs: list, xlabel: str) -> None:
    x, mean = _series(rows, "reward_mean", xs)
    ax.plot(x, mean, label="reward (train)", color="tab:blue")
    _, std = _series(rows, "reward_std", xs)
    if len(std) == len(mean):
        ax.fill_between(
            x,
            [m - s for m, s in zip(mean, std)],
            [m + s for m, s in zip(mean, std)],
            color="tab:blue",
            alpha=0.15,
            label="+- std",
        )
    evals = [(x_, v) for x_, r in zip(xs, rows) if (v := eval_reward(r)) is not None]
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "o-", color="tab:red", label="eval reward")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _pair_panel(ax, rows: list[dict], steps: list, keys: tuple[str, str], ylabel: str) -> None:
    for key in keys:
        x, y = _series(rows, key, steps)
        if y:
            ax.plot(x, y, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def draw_report(rows: list[dict], spans: dict[str, list[dict]] | None, path: str, title: str = "") -> None:
    """The report PNG (matplotlib, Agg backend); the timeline panel only when spans are given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from services.tracking.timeline import draw_lanes

    steps, seconds = [r["step"] for r in rows], elapsed(rows)
    unit, scale = ("minutes", 60) if seconds[-1] >= 300 else ("seconds", 1)  # a short run in seconds
    lanes = len(spans) if spans else 0
    fig = plt.figure(figsize=(14, 9 + (1.5 + 0.5 * lanes if spans else 0)))
    grid = fig.add_gridspec(3 if spans else 2, 2, height_ratios=[3, 3, 1 + 0.5 * lanes] if spans else [3, 3])
    _reward_panel(fig.add_subplot(grid[0, 0]), rows, steps, "step")
    _reward_panel(fig.add_subplot(grid[0, 1]), rows, [t / scale for t in seconds], f"wall time ({unit})")
    _pair_panel(
        fig.add_subplot(grid[1, 0]),
        rows,
        steps,
        ("response_length_mean", "response_length_max"),
        "response length (tokens)",
    )
    _pair_panel(fig.add_subplot(grid[1, 1]), rows, steps, ("staleness_mean", "staleness_max"), "staleness (versions)")
    if spans:
        ax = fig.add_subplot(grid[2, :])
        start = min(s["start"] for lane in spans.values() for s in lane)
        end = max(s["end"] for lane in spans.values() for s in lane)
        draw_lanes(ax, spans, start, end)
        ax.set_title("per-service timeline")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(run_dir: str, thresholds=DEFAULT_THRESHOLDS) -> dict[str, str]:
    """Write report.png and summary.json into `run_dir`; returns {"png": path, "summary": path}."""
    rows = load_steps(run_dir)
    summary = summarize(rows, thresholds)
    png, summary_path = os.path.join(run_dir, PNG_FILE), os.path.join(run_dir, SUMMARY_FILE)
    name = os.path.basename(os.path.normpath(run_dir))
    draw_report(
        rows, load_spans(run_dir), png, title=f"{name}: {summary['steps']} steps, {summary['wall_time_s'] / 60:.1f} min"
    )
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return {"png": png, "summary": summary_path}


def report_at_end(run_dir: str, service_urls: dict[str, str] | None = None, token: str = "") -> dict[str, str] | None:
    """What a launcher does when its run ends, while the services still answer: save their spans
    (`GET /spans` of each URL with the stack's `token`, services/tracking/timeline.py) for the timeline, then
    write the report. Returns
    write_report's paths; None, with a warning, when the run dir has no steps (nothing was trained)."""
    from services.tracking.timeline import fetch_spans

    if service_urls:
        save_spans(run_dir, fetch_spans(service_urls, token=token))
    try:
        return write_report(run_dir)
    except ReportError as exc:
        log.warning("no run report", extra={"run_dir": run_dir, "reason": str(exc)})
        return None


def _thresholds(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--thresholds: comma-separated numbers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sluice report",
        description=(
            "Write report.png and summary.json into a run dir (<trainer --output-dir>/<run_id>) from its steps.jsonl "
            "(and spans.json, for the per-service timeline); prints their paths as JSON."
        ),
        formatter_class=HelpWithDefaults,
    )
    parser.add_argument("run_dir", help="the run dir: the trainer's <output_dir>/<run_id>")
    parser.add_argument(
        "--thresholds",
        type=_thresholds,
        default=",".join(str(t) for t in DEFAULT_THRESHOLDS),
        help="reward thresholds for time-to-reward, comma-separated",
    )
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.run_dir, args.thresholds)
    except ReportError as exc:
        print(f"sluice report: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(paths))
    return 0

"""Span recording and the timeline arithmetic built on it (pure functions; the e2e run checks the real spans)."""

from __future__ import annotations

import pytest

from services.tracking.timeline import draw_lanes, overlap_summary, stage_busy, step_table, union_seconds
from services.runtime.spans import SpanRecorder


def test_recorder_merges_back_to_back_spans_and_filters_by_time():
    rec = SpanRecorder(capacity=4)
    rec.merge("generate", 0.0, 1.0, gap_s=0.1, version="1")
    rec.merge("generate", 1.05, 2.0, gap_s=0.1, version="1")  # within the gap: extends
    rec.merge("generate", 2.5, 3.0, gap_s=0.1, version="1")  # a real gap: a new span
    rec.merge("generate", 3.01, 3.5, gap_s=0.1, version="2")  # another version: a new span
    spans = rec.since(0.0)["spans"]
    assert [(s["start"], s["end"], s["version"]) for s in spans] == [(0.0, 2.0, "1"), (2.5, 3.0, "1"), (3.01, 3.5, "2")]
    assert [s["start"] for s in rec.since(2.9)["spans"]] == [2.5, 3.01]
    for i in range(5):
        rec.record("train", 10.0 + i, 10.5 + i, step=i)
    assert len(rec.since(0.0)["spans"]) == 4  # a bounded ring: the newest kept


def test_recorder_span_context_records_even_when_the_work_raises():
    rec = SpanRecorder()
    with pytest.raises(ValueError):
        with rec.span("publish", step=3, version=4):
            raise ValueError("sync failed")
    [span] = rec.since()["spans"]
    assert (span["name"], span["step"], span["version"]) == ("publish", 3, 4) and span["end"] >= span["start"]


def test_union_counts_overlaps_once():
    assert union_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_seconds([]) == 0.0


def _s(name, start, end, step=None):
    return {"name": name, "start": start, "end": end, "step": step, "version": None}


def test_step_table_and_overlap_bound():
    spans = {
        "trainer": [
            _s("claim", 0, 2, 0),
            _s("train", 2, 3, 0),
            _s("publish", 3, 3.5, 0),
            _s("claim", 3.5, 4, 1),
            _s("train", 4, 5, 1),
            _s("publish", 5, 5.5, 1),
        ],
        "rollout": [_s("generate", 0, 2, 0), _s("generate", 1, 4, 1), _s("put", 4, 4.5, 1)],
    }
    rows = step_table(spans)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["wall_s"] == 3.5 and rows[0]["trainer_s"] == {"claim": 2.0, "publish": 0.5, "train": 1.0}
    assert rows[1]["wall_s"] == 2.0 and rows[1]["busy_s"] == {"rollout": 1.0}  # [3.5, 5.5]: generate to 4, put
    busy = stage_busy(spans, 0, 5.5)
    assert busy == {"trainer": 3.0, "rollout": 4.5}  # claims are waiting, not work
    summary = overlap_summary(spans, 0, 5.5)
    assert summary["ideal_overlap_bound"] == pytest.approx(7.5 / 4.5, abs=1e-3)
    assert summary["achieved_overlap"] == pytest.approx(7.5 / 5.5, abs=1e-3)
    # an engine is part of the generation stage with its rollout: their overlap counts once
    spans["engine-0"] = [_s("generate", 0.5, 4.2)]
    merged = overlap_summary(spans, 0, 5.5)
    assert merged["stage_busy_s"] == {"generation": 4.5, "trainer": 3.0}
    assert merged["busy_fraction"]["engine-0"] == pytest.approx(3.7 / 5.5, abs=1e-3)


def test_lanes_draw_each_colour_once_per_lane_waiting_under_working_and_clipped_to_the_window():
    """A bar per span re-fit the axes to every bar drawn before it (minutes for a 200-step run's ~10,000 spans):
    a lane's spans of one colour are one collection, waiting spans drawn first, spans clipped to [start, end]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = {
        "trainer": [{"name": "claim", "start": 10.0 + i, "end": 10.5 + i} for i in range(500)]
        + [{"name": "train", "start": 10.5 + i, "end": 11.0 + i} for i in range(500)],
        "rollout": [
            {"name": "generate", "start": 5.0, "end": 12.0},
            {"name": "put", "start": 12.0, "end": 12.2},
            {"name": "generate", "start": 600.0, "end": 700.0},
        ],
    }
    fig, ax = plt.subplots()
    try:
        draw_lanes(ax, spans, start=10.0, end=100.0)
        bars = [(c.get_facecolor()[0][:3].round(3).tolist(), len(c.get_paths())) for c in ax.collections]
    finally:
        plt.close(fig)
    grey, red = matplotlib.colors.to_rgb("lightgrey"), matplotlib.colors.to_rgb("tab:red")
    blue, olive = matplotlib.colors.to_rgb("tab:blue"), matplotlib.colors.to_rgb("tab:olive")
    rounded = [[round(x, 3) for x in c] for c in (grey, red, blue, olive)]
    # trainer: 90 claims and 90 trains inside the window, waiting first; rollout: the generate clipped to [10, 12]
    # (the one at 600 s is outside), then the put
    assert bars == [(rounded[0], 90), (rounded[1], 90), (rounded[2], 1), (rounded[3], 1)]

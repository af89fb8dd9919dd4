"""benchmarks/dynamic_sampling.py's and benchmarks/lora_vs_full.py's arithmetic, without running a demo: the
zero-variance groups counted from a trainer's completions.jsonl, the share dynamic sampling dropped (f / (f + G)),
a threshold never reached counted as a miss in the median, and the demo's run config with each script's changes.
The runs themselves take minutes each (docs/algorithms.md, docs/trainer.md)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import demo_runs  # noqa: E402
import dynamic_sampling  # noqa: E402


def test_zero_variance_groups_are_counted_per_step_by_prompt(tmp_path):
    rows = [
        (0, "a", 1.0),
        (0, "a", 1.0),
        (0, "b", 0.0),
        (0, "b", 1.0),
        (1, "a", 0.0),
        (1, "a", 0.0),
        (1, "c", 0.0),
        (1, "c", 0.0),
    ]
    path = tmp_path / "completions.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "prompt": p, "response": "x", "reward": r}) + "\n" for s, p, r in rows)
    )
    assert demo_runs.zero_variance_per_step(str(path)) == {
        0: {"zero_variance": 1, "groups": 2},
        1: {"zero_variance": 2, "groups": 2},
    }


def test_the_filtered_share_is_dropped_over_generated_groups():
    steps = [
        {
            "step": s,
            "end_s": float(s + 1),
            "reward_mean": 0.5,
            "filtered_groups": f,
            "publish_bytes": 1,
            "publish_s": 0.1,
            "staleness_max": 1,
        }
        for s, f in enumerate([8, 0])
    ]
    result = {
        "steps": steps,
        "zero_variance": {0: {"zero_variance": 0, "groups": 8}, 1: {"zero_variance": 0, "groups": 8}},
        "evals": [(0, 0.2), (5, 0.85)],
        "first_at": {"version": 5, "seconds": 3.0},
        "exactly_once": True,
        "wall_s": 9.0,
    }
    summary = dynamic_sampling.summarize_run(result, groups_per_step=8)
    assert summary["filtered_share"] == pytest.approx(8 / 24, abs=1e-4)  # 8 dropped of 8 + 8 + 8 generated
    assert summary["filtered_share_by_tenth"] == [0.5, 0.0]
    assert summary["zero_variance_trained"] == 0.0
    assert (summary["steps_to_threshold"], summary["best_eval"], summary["final_eval"]) == (5, 0.85, 0.85)


def test_a_seed_that_never_reaches_the_threshold_counts_as_a_miss():
    assert dynamic_sampling.median([100, None, None], missing_as=301) == 301
    assert dynamic_sampling.median([100, 120, None], missing_as=301) == 120
    assert dynamic_sampling.median([100, None]) == 100


def test_the_demo_run_takes_each_scripts_changes_and_logs_every_sample(tmp_path):
    args = demo_runs.demo_args(seed=3, steps=20)
    run = demo_runs.demo_config(
        args,
        str(tmp_path),
        str(tmp_path),
        {
            "rollout": {"filter_groups": "zero_variance"},
            "optim": {"lr": 5e-4},
            "trainer": {"lora": {"rank": 8, "alpha": 16.0}},
        },
    )
    assert (run.rollout.filter_groups, run.optim.lr, run.trainer.lora.rank, run.num_steps) == (
        "zero_variance",
        5e-4,
        8,
        20,
    )
    assert run.rollout.prompts == "demo:reverse" and run.optim.seed == 3 and run.optim.lr_schedule == "cosine"
    assert run.tracking.completions_every == 1 and run.tracking.completions_rows == run.global_batch_size == 64
    with pytest.raises(ValueError, match="filter_groups"):
        demo_runs.demo_config(args, str(tmp_path), str(tmp_path), {"rollout": {"filter_groups": "sometimes"}})

"""Scoring and summarising for benchmarks/time_to_reward.py: the greedy held-out score of each saved
checkpoint, one system's JSON block from its step times and scores, medians over reps, and the ratios
(sluice's time to reward over a baseline's, at the highest threshold both reach after step 0)."""

from __future__ import annotations

import statistics

import torch

from warm_start import Score, greedy_eval


def evaluate(
    snapshots: dict[int, str], tokenizer, eval_rows: list[dict], max_new_tokens: int, score: Score
) -> dict[int, float]:
    """step -> greedy held-out reward (the task's `score`) of the checkpoint written after that step."""
    from transformers import AutoModelForCausalLM

    out = {}
    for step, path in sorted(snapshots.items()):
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        out[step] = greedy_eval(model, tokenizer, eval_rows, max_new_tokens, score)
    return out


def system_result(
    step_end: dict[int, float],
    train_reward: dict[int, float],
    eval_reward: dict[int, float],
    startup_s: float,
    thresholds: list[float],
    **extra,
) -> dict:
    """step_end and eval_reward include step 0 (the warm start, at 0 s)."""
    steps = max(step_end)
    first = {str(t): next((s for s in sorted(eval_reward) if eval_reward[s] >= t), None) for t in thresholds}
    curve = [
        {
            "step": s,
            "wall_s": round(step_end.get(s, 0.0), 2),
            "train_reward": None if s not in train_reward else round(train_reward[s], 4),
            "eval_reward": None if s not in eval_reward else round(eval_reward[s], 4),
        }
        for s in range(0, steps + 1)
    ]
    return {
        "startup_s": round(startup_s, 2),
        "steps": steps,
        "wall_s": round(step_end[steps], 2),
        "steps_per_s": round(steps / step_end[steps], 4),
        "time_to_reward_s": {t: None if s is None else round(step_end[s], 2) for t, s in first.items()},
        "steps_to_reward": first,
        "final_eval_reward": eval_reward[max(eval_reward)],
        "curve": curve,
        **extra,
    }


def median_result(reps: list[dict]) -> dict:
    """Medians over reps (a rep that never reached a threshold counts as infinitely slow); the curve is rep 0's."""
    out = {**reps[0], "seeds": [r["seed"] for r in reps]}
    for key in ("startup_s", "wall_s", "steps_per_s", "final_eval_reward"):
        out[key] = round(statistics.median(r[key] for r in reps), 4)
    for key in ("time_to_reward_s", "steps_to_reward"):
        meds = {t: statistics.median(float("inf") if r[key][t] is None else r[key][t] for r in reps) for t in out[key]}
        out[key] = {t: None if m == float("inf") else round(m, 2) for t, m in meds.items()}
    if len(reps) > 1:
        out["reps"] = [{k: v for k, v in r.items() if k != "steps"} for r in reps]
    return out


def ratio(base: dict | None, sluice: dict | None, thresholds: list[float]) -> dict | None:
    """sluice's time over `base`'s at the highest threshold both reach after step 0 (target <= 1.0)."""
    if base is None or sluice is None:
        return None
    # thresholds the warm start already meets (time 0 for both) say nothing
    both = [
        t
        for t in thresholds
        if (base["time_to_reward_s"][str(t)] or 0) > 0 and (sluice["time_to_reward_s"][str(t)] or 0) > 0
    ]
    if not both:
        return None
    t = max(both)
    sluice_s, base_s = sluice["time_to_reward_s"][str(t)], base["time_to_reward_s"][str(t)]
    return {
        "threshold": t,
        "sluice_s": sluice_s,
        "baseline_s": base_s,
        "sluice_over_baseline": round(sluice_s / base_s, 3),
    }


def ratio_vs_strongest(baselines: dict[str, dict], sluice: dict | None, thresholds: list[float]) -> dict | None:
    """Sluice against each baseline run at the highest threshold the two both reach; the headline is the
    least favourable to Sluice (the strongest baseline at that threshold), with every run's ratio beside it."""
    each = {name: r for name, block in baselines.items() if (r := ratio(block, sluice, thresholds)) is not None}
    if not each:
        return None
    against = max(each, key=lambda name: each[name]["sluice_over_baseline"])
    return {**each[against], "against": against, "each": each}

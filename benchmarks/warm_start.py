"""The warm start and held-out scoring of benchmarks/time_to_reward.py, over the project's warm start
(services/demo_tasks/warm_start.py, the one `sluice demo` uses), for either task shape (benchmarks/ttr_tasks.py).

Rows are {"prompt": text, "label": answer}. Prompts are encoded the way the rollout role encodes a text prompt
(one user message, chat template, generation prompt); the model answers " b c a d" and then EOS. The warm start
stops once the task's reward (ttr_tasks.TaskShape.score) of greedy answers to a slice of training prompts
reaches the target; the held-out score is the mean of the same reward over greedy answers.
"""

from __future__ import annotations

from typing import Callable

from services.demo_tasks import warm_start as project_warm_start

Score = Callable[[str, dict], float]  # (response, fields) -> reward


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _pairs(rows: list[dict]) -> list[tuple[str, dict]]:
    return [(r["prompt"], {"label": r["label"]}) for r in rows]


def warm_start(
    base_dir: str,
    out_dir: str,
    rows: list[dict],
    max_steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    target: float,
    check_rows: list[dict],
    score: Score,
    check_every: int = 5,
    max_new_tokens: int = 12,
) -> dict:
    return project_warm_start.warm_start(
        base_dir,
        out_dir,
        _pairs(rows),
        max_steps,
        batch_size,
        lr,
        seed,
        target,
        _pairs(check_rows),
        check_every,
        max_new_tokens,
        score=score,
    )


def greedy_eval(model, tokenizer, rows: list[dict], max_new_tokens: int, score: Score, batch_size: int = 64) -> float:
    """Mean reward of greedy answers to rows (the held-out set)."""
    return project_warm_start.greedy_eval(model, tokenizer, _pairs(rows), max_new_tokens, score, batch_size=batch_size)

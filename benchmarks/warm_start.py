"""The task splits of benchmarks/time_to_reward.py, over the project's warm start (services/demo_tasks).

Task "reverse": the prompt is `Reverse: d a c b` (3 to 5 letters drawn from REVERSE_LETTERS, each a single
token of the offline tokenizer both with and without a leading space), the answer is the letters in
reverse order, `b c a d`. Rows are {"prompt": text, "label": answer}; the reward is Sluice's built-in
`exact_match` (stripped response == stripped label), binary. Prompts are encoded the way the rollout role
encodes a text prompt (one user message, chat template, generation prompt); the model answers " b c a d"
and then EOS.

The benchmark draws its own splits (distinct prompts, the held-out set disjoint from training, seeded by
--seed) so both systems read the same JSONL rows; the warm start and the greedy evaluation are
services/demo_tasks/warm_start.py, the ones `sluice demo` uses.
"""

from __future__ import annotations

import random

from services.demo_tasks import warm_start as project_warm_start
from services.demo_tasks.catalog import REVERSE_LETTERS, REVERSE_MAX, REVERSE_MIN


def reverse_row(rng: random.Random) -> dict:
    letters = [rng.choice(REVERSE_LETTERS) for _ in range(rng.randint(REVERSE_MIN, REVERSE_MAX))]
    return {"prompt": "Reverse: " + " ".join(letters), "label": " ".join(reversed(letters))}


def make_splits(seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): distinct prompts, no prompt in both."""
    rng = random.Random(f"time-to-reward:{seed}")
    seen: set[str] = set()

    def distinct(n: int) -> list[dict]:
        rows: list[dict] = []
        while len(rows) < n:
            row = reverse_row(rng)
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
        return rows

    held_out = distinct(n_eval)  # drawn first, so the held-out set does not depend on n_train
    train = distinct(n_train)
    return train, held_out


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _pairs(rows: list[dict]) -> list[tuple[str, dict]]:
    return [(r["prompt"], {"label": r["label"]}) for r in rows]


def warm_start(base_dir: str, out_dir: str, rows: list[dict], max_steps: int, batch_size: int, lr: float,
               seed: int, target: float, check_rows: list[dict], check_every: int = 5,
               max_new_tokens: int = 12) -> dict:
    return project_warm_start.warm_start(base_dir, out_dir, _pairs(rows), max_steps, batch_size, lr, seed, target,
                                         _pairs(check_rows), check_every, max_new_tokens)


def greedy_eval(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean exact_match of greedy answers to rows (the held-out set)."""
    return project_warm_start.greedy_eval(model, tokenizer, _pairs(rows), max_new_tokens, batch_size=batch_size)

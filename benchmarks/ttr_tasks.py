"""The two task shapes of benchmarks/time_to_reward.py (`--tasks reverse,short`): rows, reward, model size and
the defaults that fit each. Imported by the Sluice rollout too (the short task's `import:` reward), so this
module imports nothing heavy.

  reverse  `Reverse: d a c b` -> `b c a d` (3-5 letters), the built-in `exact_match` reward (binary), the
           "small" preset (~3.4M parameters), 12 new tokens. Training-bound: the optimizer step is most of a
           step's time.
  short    `Reverse: d a c` -> `c a d` (2-4 letters), a partial-credit reward (position_credit: the fraction of
           answer positions right, over the longer of answer and label), the "mini" preset (~0.28M parameters),
           answers of 2-4 tokens + EOS, 6 new tokens. Each step's compute is small, so its fixed cost (hand-offs,
           RPCs, weight copies, Python) dominates: a change that only helps larger models cannot hide a per-step
           cost here. Sluice scores it as a user would a reward of their own: `import:ttr_tasks:position_credit`
           (a plain function, so the rollout runs it in a worker thread), with this directory on the services'
           PYTHONPATH.

Letters come from REVERSE_LETTERS, each a single token of the offline tokenizer with and without a leading space.
"""

from __future__ import annotations

import random
from typing import Callable, NamedTuple

from services.demo_tasks.catalog import REVERSE_LETTERS, REVERSE_MAX, REVERSE_MIN

SHORT_MIN, SHORT_MAX = 2, 4


def reverse_row(rng: random.Random) -> dict:
    letters = [rng.choice(REVERSE_LETTERS) for _ in range(rng.randint(REVERSE_MIN, REVERSE_MAX))]
    return {"prompt": "Reverse: " + " ".join(letters), "label": " ".join(reversed(letters))}


def short_row(rng: random.Random) -> dict:
    letters = [rng.choice(REVERSE_LETTERS) for _ in range(rng.randint(SHORT_MIN, SHORT_MAX))]
    return {"prompt": "Reverse: " + " ".join(letters), "label": " ".join(reversed(letters))}


def exact_label(response: str, fields: dict, prompt=None) -> float:
    """Sluice's built-in `exact_match` on the "label" field (stripped response == stripped label)."""
    return 1.0 if response.strip() == str(fields["label"]).strip() else 0.0


def position_credit(response: str, fields: dict, prompt=None) -> float:
    """Partial credit: answer words equal to the label's at the same position, over the longer of the two
    (a missing or extra word costs as much as a wrong one); 1.0 only for the exact answer."""
    want, got = str(fields["label"]).split(), response.split()
    if not want and not got:
        return 1.0
    return sum(a == b for a, b in zip(got, want)) / max(len(want), len(got))


class TaskShape(NamedTuple):
    row: Callable[[random.Random], dict]  # rng -> {"prompt", "label"}
    score: Callable[..., float]  # (response, fields[, prompt]) -> reward, the same for every system
    reward_spec: str  # the Sluice rollout's rollout.reward for the same reward
    summary: str
    distinct_train: bool  # training prompts all distinct (else drawn with repeats)
    preset: str
    steps: int
    quick_steps: int
    eval_every: int
    thresholds: tuple[float, ...]
    max_new_tokens: int
    lr: float
    n_train: int
    sft_target: float
    sft_steps: int
    sft_lr: float


TASKS: dict[str, TaskShape] = {
    "reverse": TaskShape(
        reverse_row,
        exact_label,
        "exact_match",
        "reverse 3-5 letters, exact_match reward (binary), small preset",
        True,
        preset="small",
        steps=80,
        quick_steps=20,
        eval_every=5,
        thresholds=(0.6, 0.7, 0.8, 0.9),
        max_new_tokens=12,
        lr=1e-4,
        n_train=4000,
        sft_target=0.4,
        sft_steps=300,
        sft_lr=5e-4,
    ),
    # the warm start leaves ~0.49 held-out; one seed of the in-process loop (not timed) reached 0.6 at step ~100
    "short": TaskShape(
        short_row,
        position_credit,
        "import:ttr_tasks:position_credit",
        "reverse 2-4 letters, partial-credit reward (position_credit), mini preset",
        False,
        preset="mini",
        steps=300,
        quick_steps=30,
        eval_every=10,
        thresholds=(0.55, 0.6, 0.65, 0.7, 0.8),
        max_new_tokens=6,
        lr=1e-3,
        n_train=4000,
        sft_target=0.5,
        sft_steps=300,
        sft_lr=2e-3,
    ),
}


def make_splits(task: str, seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): distinct held-out prompts, none of them in training. The reverse task's
    splits are the ones this benchmark drew before it had a second task (same generator and order)."""
    shape = TASKS[task]
    rng = random.Random(f"time-to-reward:{seed}" if task == "reverse" else f"time-to-reward:{task}:{seed}")
    held_out: list[dict] = []
    seen: set[str] = set()
    while len(held_out) < n_eval:  # drawn first, so the held-out set does not depend on n_train
        row = shape.row(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            held_out.append(row)
    excluded = set(seen)
    train: list[dict] = []
    while len(train) < n_train:
        row = shape.row(rng)
        if row["prompt"] in excluded:
            continue
        if shape.distinct_train:
            excluded.add(row["prompt"])
        train.append(row)
    return train, held_out

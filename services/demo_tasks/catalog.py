"""The row generators of the built-in tasks (services/demo_tasks/__init__.py says what each teaches).
Each row is a pure function of its index, so a resumed run and every process see the same rows."""

from __future__ import annotations

import random
import zlib

DEMO_LENGTH = 100_000  # training reads rows below it (position % DEMO_LENGTH); held-out rows lie above it

REVERSE_LETTERS = "abcdfilm"  # each a single token of the offline tokenizer, with and without a leading space
REVERSE_MIN, REVERSE_MAX = 3, 5


def reverse_row(index: int) -> tuple[str, dict]:
    """Training and held-out rows come from disjoint halves of the prompt space (1 in 8 prompts, by a
    stable hash, is held out): with ~37k distinct prompts, index-seeded draws alone would put most
    held-out prompts in training too."""
    rng = random.Random(f"demo:reverse:{index}")
    held_out = index >= DEMO_LENGTH
    while True:
        letters = [rng.choice(REVERSE_LETTERS) for _ in range(rng.randint(REVERSE_MIN, REVERSE_MAX))]
        prompt = "Reverse: " + " ".join(letters)
        if (zlib.crc32(prompt.encode()) % 8 == 0) == held_out:
            return prompt, {"label": " ".join(reversed(letters))}


def arith_row(index: int) -> tuple[str, dict]:
    rng = random.Random(f"demo:arith:{index}")
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}? Answer with the number.", {"label": str(a + b)}


def letters_row(index: int) -> tuple[str, dict]:
    rng = random.Random(f"demo:letters:{index}")
    letters = "".join(sorted(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(5, 8))))
    return (
        f"Write a short word using only the letters {', '.join(letters)}. Answer with the word.",
        {"letters": letters},
    )


def tool_row(index: int) -> tuple[str, dict]:
    rng = random.Random(f"demo:tool:{index}")
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"What is {a} + {b}? Use the add tool, then answer with the number.", {"label": str(a + b)}

"""Prompt sources with random access by a global position, so the rollout service can store the next
position and resume exactly there after a restart: no prompt is skipped or repeated.

Position p (0, 1, 2, ... across epochs) is row `perm_e[p % n]` of epoch `e = p // n`, n = len(source).
`perm_e` is the identity when shuffle_seed is None; otherwise a Fisher-Yates shuffle of range(n) driven by
`random.Random(seed_e).random()` with `seed_e` derived from sha256("sluice-prompts:{shuffle_seed}:{epoch}").
Only `Random.random()` under an int seed is promised by Python to stay the same across releases, so
the order does not change when Python is upgraded between a run and its resume.

    open_prompt_source("data/train.jsonl")            one JSON object per line
    open_prompt_source("data/train.parquet")          read with pyarrow
    open_prompt_source("demo:arith")                  a built-in task (DEMO_TASKS)"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from services.demo_tasks import DEMO_LENGTH, DEMO_TASKS

Prompt = str | list[dict]


@dataclass(frozen=True)
class PromptRecord:
    position: int  # global position: epoch * len(source) + place in that epoch's order
    epoch: int
    index: int  # row in the source
    prompt: Prompt  # text, or chat messages [{"role": ..., "content": ...}]
    fields: dict  # every other field of the row (labels etc.), JSON-serialisable values only


class PromptSource:
    """Rows held in memory (or generated on demand, for demo tasks) plus the per-epoch order."""

    def __init__(
        self, name: str, length: int, row: Callable[[int], tuple[Prompt, dict]], shuffle_seed: int | None = None
    ):
        if length <= 0:
            raise ValueError(f"prompt source {name} is empty")
        if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)):
            raise ValueError(f"shuffle_seed must be an int or None, got {shuffle_seed!r}")
        self.name = name
        self.shuffle_seed = shuffle_seed
        self._length = length
        self._row = row
        # a shuffle of a large source costs tens of ms: keep the last two epochs' orders (a group of
        # prompts may straddle an epoch boundary)
        self._orders: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"PromptSource({self.name!r}, rows={self._length}, shuffle_seed={self.shuffle_seed})"

    def record(self, position: int) -> PromptRecord:
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position must be an int >= 0, got {position!r}")
        epoch, offset = divmod(position, self._length)
        index = offset if self.shuffle_seed is None else self._order(epoch)[offset]
        prompt, fields = self._row(index)
        # copies: one record is scored many times (a group of samples), and callers may mutate it
        return PromptRecord(position, epoch, index, copy.deepcopy(prompt), copy.deepcopy(fields))

    def _order(self, epoch: int) -> list[int]:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                order = shuffled_range(self._length, epoch_seed(self.shuffle_seed, epoch))
                self._orders[epoch] = order
                for old in sorted(self._orders)[:-2]:
                    del self._orders[old]
            return order


def epoch_seed(shuffle_seed: int | None, epoch: int) -> int:
    digest = hashlib.sha256(f"sluice-prompts:{shuffle_seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def shuffled_range(n: int, seed: int) -> list[int]:
    """Fisher-Yates over range(n) using only Random.random(), whose output Python keeps stable."""
    rng = random.Random(seed)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order


# ---------------------------------------------------------------------------------------- files


def check_prompt(prompt, where: str) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        return prompt
    raise ValueError(
        f"{where}: the prompt must be a string or a non-empty list of chat messages "
        f'{{"role": str, "content": str}}, got {_excerpt(prompt)}'
    )


def _excerpt(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _split_rows(rows: list[dict], prompt_field: str) -> list[tuple[Prompt, dict]]:
    return [(row[prompt_field], {k: v for k, v in row.items() if k != prompt_field}) for row in rows]


def jsonl_rows(path: Path, prompt_field: str) -> Iterator[dict]:
    """The rows of a JSONL prompt file, each checked as it is read (preflight reads only the first)."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if prompt_field not in row:
                raise ValueError(f"{where}: no {prompt_field!r} field (fields: {sorted(row)})")
            check_prompt(row[prompt_field], f"{where}, field {prompt_field!r}")
            yield row


def load_jsonl(path: Path, prompt_field: str) -> list[tuple[Prompt, dict]]:
    return _split_rows(list(jsonl_rows(path, prompt_field)), prompt_field)


def check_parquet_schema(path: Path, schema, prompt_field: str) -> None:
    """A parquet prompt file's columns: the prompt's is there, and every column has a JSON form."""
    if prompt_field not in schema.names:
        raise ValueError(f"{path}: no {prompt_field!r} column (columns: {schema.names})")
    for field in schema:
        if not _json_compatible(field.type):
            raise ValueError(
                f"{path}: column {field.name!r} has type {field.type}, which has no JSON form "
                f"(use strings, numbers, booleans, lists and structs of them)"
            )


def load_parquet(path: Path, prompt_field: str) -> list[tuple[Prompt, dict]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    check_parquet_schema(path, table.schema, prompt_field)
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        check_prompt(row[prompt_field], f"{path} row {i}, column {prompt_field!r}")
    return _split_rows(rows, prompt_field)


def _json_compatible(t) -> bool:
    import pyarrow.types as pt

    if (
        pt.is_null(t)
        or pt.is_boolean(t)
        or pt.is_integer(t)
        or pt.is_floating(t)
        or pt.is_string(t)
        or pt.is_large_string(t)
    ):
        return True
    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return _json_compatible(t.value_type)
    if pt.is_struct(t):
        return all(_json_compatible(t.field(i).type) for i in range(t.num_fields))
    return False


def check_prompt_file(path: Path, prompt_field: str) -> None:
    """What preflight reads of a prompt file without loading it: a JSONL file's first row, a parquet file's
    schema and row count, checked as the loaders check them. Raises ValueError (or OSError) naming the problem."""
    if path.suffix.lower() == ".jsonl":
        if next(jsonl_rows(path, prompt_field), None) is None:
            raise ValueError(f"{path}: it holds no rows")
        return
    import pyarrow
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except pyarrow.ArrowException as exc:
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None
    check_parquet_schema(path, meta.schema_arrow, prompt_field)
    if meta.metadata.num_rows == 0:
        raise ValueError(f"{path}: it holds no rows")


# ---------------------------------------------------------------------------------------- opening

SPEC_FORMS = "a .jsonl path, a .parquet path, or demo:<task> with task one of " + ", ".join(sorted(DEMO_TASKS))


def open_prompt_source(spec: str, prompt_field: str = "prompt", shuffle_seed: int | None = None) -> PromptSource:
    """spec: a .jsonl path, a .parquet path or demo:<task>. prompt_field names the prompt in each row
    (not used by demo tasks); every other field goes to PromptRecord.fields."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"prompt source spec must be {SPEC_FORMS}; got {spec!r}")
    if spec.startswith("demo:"):
        task = DEMO_TASKS.get(spec[len("demo:") :])
        if task is None:
            raise ValueError(f"unknown demo task {spec!r}; known: {', '.join('demo:' + t for t in sorted(DEMO_TASKS))}")
        return PromptSource(spec, DEMO_LENGTH, task.generate, shuffle_seed)
    path = Path(spec)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = load_jsonl(path, prompt_field)
    elif suffix == ".parquet":
        rows = load_parquet(path, prompt_field)
    else:
        raise ValueError(f"prompt source spec must be {SPEC_FORMS}; got {spec!r}")
    if not rows:
        raise ValueError(f"prompt source {spec} is empty")
    return PromptSource(spec, len(rows), rows.__getitem__, shuffle_seed)


def open_eval_source(spec: str, prompt_field: str = "prompt") -> PromptSource:
    """The held-out prompts of RunConfig.eval, in file order. For demo:<task> they are the task's rows from index
    DEMO_LENGTH on, which training never reaches (it reads row position % DEMO_LENGTH)."""
    if isinstance(spec, str) and spec.startswith("demo:") and spec[len("demo:") :] in DEMO_TASKS:
        generate = DEMO_TASKS[spec[len("demo:") :]].generate
        return PromptSource(spec + " (held out)", DEMO_LENGTH, lambda i: generate(DEMO_LENGTH + i))
    return open_prompt_source(spec, prompt_field)

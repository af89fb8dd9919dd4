"""Prompt sources: JSONL and Parquet files and demo tasks, read by global position so a restarted
rollout service resumes exactly where it stopped."""

from __future__ import annotations

import dataclasses
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.run_contract.prompt_source import DEMO_TASKS, PromptRecord, open_prompt_source

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


def write_jsonl(path, rows, blank_lines: bool = False) -> str:
    lines = []
    for row in rows:
        lines.append(row if isinstance(row, str) else json.dumps(row))
        if blank_lines:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def numbered_jsonl(tmp_path, n: int) -> str:
    return write_jsonl(tmp_path / "numbered.jsonl", [{"prompt": f"p{i}", "label": str(i)} for i in range(n)])


def test_jsonl_rows_text_and_chat_prompts_and_other_fields(tmp_path):
    spec = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "What is 2 + 2?", "label": "4", "meta": {"source": "a", "tags": [1, 2]}},
            {"prompt": CHAT, "label": "hi"},
        ],
        blank_lines=True,
    )
    source = open_prompt_source(spec)
    assert len(source) == 2 and source.name == spec
    first, second = source.record(0), source.record(1)
    assert first == PromptRecord(0, 0, 0, "What is 2 + 2?", {"label": "4", "meta": {"source": "a", "tags": [1, 2]}})
    assert second.prompt == CHAT and second.fields == {"label": "hi"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.position = 5
    first.fields["label"] = "changed"  # callers get copies: the source's rows stay as loaded
    assert source.record(0).fields["label"] == "4"


def test_jsonl_custom_prompt_field(tmp_path):
    spec = write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?", "prompt": "not the prompt"}])
    record = open_prompt_source(spec, prompt_field="question").record(0)
    assert record.prompt == "Why?" and record.fields == {"prompt": "not the prompt"}


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('["a list"]', "line 3: expected a JSON object, got list"),
        ('{"text": "no prompt"}', "line 3: no 'prompt' field (fields: ['text'])"),
        ('{"prompt": "unterminated', "line 3: not valid JSON"),
        ('{"prompt": 42}', "line 3, field 'prompt': the prompt must be a string or a non-empty list of chat messages"),
        ('{"prompt": [{"role": "user"}]}', "line 3, field 'prompt'"),
    ],
)
def test_jsonl_bad_lines_are_named_by_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n' + bad_line + "\n")  # line 2 is blank: line numbers count it
    with pytest.raises(ValueError, match=re.escape(f"{path} {message}")):
        open_prompt_source(str(path))


def test_empty_sources_and_unknown_specs_are_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="empty"):
        open_prompt_source(str(tmp_path / "empty.jsonl"))
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="empty"):
        open_prompt_source(str(tmp_path / "empty.parquet"))
    with pytest.raises(ValueError, match=r"\.jsonl path, a \.parquet path, or demo:<task>"):
        open_prompt_source(str(tmp_path / "train.csv"))
    with pytest.raises(ValueError, match="unknown demo task 'demo:nope'; known: demo:arith, demo:letters"):
        open_prompt_source("demo:nope")
    with pytest.raises(FileNotFoundError):
        open_prompt_source(str(tmp_path / "missing.jsonl"))


def test_parquet_rows_with_chat_prompts(tmp_path):
    table = pa.table(
        {
            "prompt": pa.array([CHAT, [{"role": "user", "content": "Count to 3."}]]),
            "label": ["hi", "1 2 3"],
            "difficulty": [0.5, None],
            "tags": [["greeting"], []],
        }
    )
    pq.write_table(table, tmp_path / "train.parquet")
    source = open_prompt_source(str(tmp_path / "train.parquet"))
    assert len(source) == 2
    assert source.record(0) == PromptRecord(0, 0, 0, CHAT, {"label": "hi", "difficulty": 0.5, "tags": ["greeting"]})
    assert source.record(3).fields == {"label": "1 2 3", "difficulty": None, "tags": []}
    json.dumps(source.record(1).fields)


def test_parquet_errors_name_the_columns(tmp_path):
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), tmp_path / "no_prompt.parquet")
    with pytest.raises(ValueError, match=re.escape("no 'prompt' column (columns: ['question', 'answer'])")):
        open_prompt_source(str(tmp_path / "no_prompt.parquet"))
    pq.write_table(pa.table({"prompt": ["q"], "blob": pa.array([b"\x00"], pa.binary())}), tmp_path / "blob.parquet")
    with pytest.raises(ValueError, match="column 'blob' has type binary, which has no JSON form"):
        open_prompt_source(str(tmp_path / "blob.parquet"))
    pq.write_table(pa.table({"prompt": ["q", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match="row 1, column 'prompt'"):
        open_prompt_source(str(tmp_path / "null.parquet"))


def indices(source, start: int, stop: int) -> list[int]:
    return [source.record(p).index for p in range(start, stop)]


def test_without_shuffle_positions_walk_the_rows_in_order_every_epoch(tmp_path):
    source = open_prompt_source(numbered_jsonl(tmp_path, 7))
    assert indices(source, 0, 21) == list(range(7)) * 3
    record = source.record(7 * 5 + 3)
    assert (record.position, record.epoch, record.index, record.prompt) == (38, 5, 3, "p3")


@pytest.mark.parametrize("shuffle_seed", [None, 0, 1234])
def test_every_row_exactly_once_per_epoch_and_resume_is_exact(tmp_path, shuffle_seed):
    n = 50
    spec = numbered_jsonl(tmp_path, n)
    run = open_prompt_source(spec, shuffle_seed=shuffle_seed)
    epochs = [indices(run, e * n, (e + 1) * n) for e in range(3)]
    for epoch, order in enumerate(epochs):
        assert sorted(order) == list(range(n))
        assert all(run.record(epoch * n + i).epoch == epoch for i in (0, n - 1))
    # a restart at a stored position (mid-epoch) continues the same sequence: nothing skipped or repeated
    stop = 2 * n - 17
    before = [run.record(p).prompt for p in range(stop)]
    resumed = open_prompt_source(spec, shuffle_seed=shuffle_seed)
    after = [resumed.record(p).prompt for p in range(stop, 3 * n)]
    assert before + after == [f"p{i}" for order in epochs for i in order]
    if shuffle_seed is not None:
        assert epochs[0] != list(range(n)) and epochs[0] != epochs[1] != epochs[2]  # fresh order per epoch


def test_shuffle_order_depends_on_the_seed_only(tmp_path):
    spec = numbered_jsonl(tmp_path, 40)
    a, b = open_prompt_source(spec, shuffle_seed=1), open_prompt_source(spec, shuffle_seed=1)
    assert indices(a, 0, 120) == indices(b, 0, 120)
    assert indices(a, 0, 40) != indices(open_prompt_source(spec, shuffle_seed=2), 0, 40)
    # reading out of order (a resume far ahead, then back) gives the same rows
    assert [a.record(p).index for p in (119, 3, 80, 41)] == [indices(b, 0, 120)[p] for p in (119, 3, 80, 41)]


def test_bad_positions_and_seeds_are_refused(tmp_path):
    source = open_prompt_source(numbered_jsonl(tmp_path, 3))
    for bad in (-1, 1.0, "2", True):
        with pytest.raises(ValueError, match="position must be an int >= 0"):
            source.record(bad)
    with pytest.raises(ValueError, match="shuffle_seed must be an int or None"):
        open_prompt_source(numbered_jsonl(tmp_path, 3), shuffle_seed="7")


def test_demo_arith_is_deterministic_and_labelled():
    a, b = open_prompt_source("demo:arith"), open_prompt_source("demo:arith", prompt_field="ignored")
    assert len(a) == 100_000 and DEMO_TASKS["arith"].reward == "arith"
    positions = [0, 1, 2, 99_999, 100_000, 123_456]
    assert [a.record(p) for p in positions] == [b.record(p) for p in positions]
    for p in positions:
        record = a.record(p)
        x, y = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Answer with the number\.", record.prompt).groups())
        assert record.fields == {"label": str(x + y)}
    assert len({a.record(p).prompt for p in range(50)}) > 40  # rows differ
    shuffled = open_prompt_source("demo:arith", shuffle_seed=3)
    assert shuffled.record(5).index != 5 and shuffled.record(5) == open_prompt_source(
        "demo:arith", shuffle_seed=3
    ).record(5)


def test_demo_letters_is_deterministic():
    a, b = open_prompt_source("demo:letters"), open_prompt_source("demo:letters")
    generate, reward = DEMO_TASKS["letters"].generate, DEMO_TASKS["letters"].reward
    assert reward == "letters"
    for p in (0, 7, 100_007):
        record = a.record(p)
        assert record == b.record(p) and (record.prompt, record.fields) == generate(record.index)
        letters = record.fields["letters"]
        assert 5 <= len(letters) <= 8 and letters.isalpha() and letters.islower()
        assert ", ".join(letters) in record.prompt


def test_demo_reverse_held_out_prompts_never_appear_in_training():
    from services.run_contract.prompt_source import open_eval_source

    train, held_out = open_prompt_source("demo:reverse"), open_eval_source("demo:reverse")
    assert DEMO_TASKS["reverse"].reward == "exact_match"
    trained = {train.record(p).prompt for p in range(20_000)}
    evaluated = [held_out.record(p) for p in range(200)]
    assert not trained & {r.prompt for r in evaluated}
    for r in evaluated[:20]:  # the label is the prompt's letters reversed
        letters = r.prompt.removeprefix("Reverse: ").split()
        assert r.fields["label"] == " ".join(reversed(letters)) and 3 <= len(letters) <= 5

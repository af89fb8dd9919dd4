"""The preflight (services/run_contract/preflight.py): every kind of problem it finds, named by its config key,
and what each role checks."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.model.init_model import init_model
from services.rollout.rewards.builtin import BUILTIN_REWARDS
from services.run_contract.preflight import Problem, check_run, describe
from services.run_contract.reward_spec import BUILTIN_REWARD_NAMES
from services.run_contract.run_config import RunConfig

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A real tokenizer's files (the preflight loads it), from a tiny `sluice init-model` model."""
    source = init_model(str(tmp_path_factory.mktemp("tiny") / "m"), preset="tiny", arch="qwen2", seed=0)
    return {name: (Path(source) / name).read_text() for name in ("tokenizer_config.json", "tokenizer.json")}


@pytest.fixture
def model_dir(tmp_path, tokenizer_files):
    """The files a model directory must hold: a real tokenizer (the preflight loads it), the rest placeholders
    (the weights' content is the loader's business, not the preflight's)."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in MODEL_FILES:
        text = tokenizer_files.get(name) or (json.dumps({"model_type": "qwen2"}) if name == "config.json" else "{}")
        (directory / name).write_text(text)
    return directory


def run(model_dir, **rollout) -> RunConfig:
    return RunConfig(name="r", model=str(model_dir), rollout=rollout)


def keys(problems: list[Problem]) -> list[str]:
    return [p.key for p in problems]


def test_a_sound_config_has_no_problems(model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('\n{"prompt": "2+2?", "label": "4"}\n')
    assert check_run(run(model_dir)) == []
    assert check_run(run(model_dir, prompts=str(prompts), reward="math_answer")) == []
    assert check_run(run(model_dir, reward="import:tests.rollout.reward_fixtures:label_in_response")) == []
    assert check_run(run(model_dir, reward="https://judge.example/score")) == []


@pytest.mark.parametrize(
    "missing, named",
    [
        ("config.json", "config.json"),
        ("model.safetensors", "weights"),
        ("tokenizer_config.json", "tokenizer_config.json"),
        ("tokenizer.json", "tokenizer.json"),
    ],
)
def test_a_missing_model_file_is_named(model_dir, missing, named):
    (model_dir / missing).unlink()
    problems = check_run(run(model_dir))
    assert keys(problems) == ["model"] and named in problems[0].message and str(model_dir) in problems[0].message


def test_a_tokenizer_that_does_not_load_is_named(model_dir):
    (model_dir / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    problems = check_run(run(model_dir))
    assert keys(problems) == ["model"] and "tokenizer does not load" in problems[0].message
    # the roles do not load it twice: the rollout loads it as it starts (reported as the run's failure there)
    assert keys(check_run(run(model_dir), role="advantage")) == keys(check_run(run(model_dir), role="rollout")) == []


def test_a_missing_model_directory(tmp_path):
    problems = check_run(run(tmp_path / "nowhere"))
    assert keys(problems) == ["model"] and "does not exist" in problems[0].message


def test_each_role_checks_what_it_reads(model_dir):
    (model_dir / "model.safetensors").unlink()  # no weights: the roles that load them fail
    config = run(model_dir, reward="import:no_such_module_zz:f")
    assert keys(check_run(config, "rollout")) == ["rollout.reward"]  # it reads the tokenizer, not the weights
    for role in ("trainer", "critic", "actor_fwd", "reference"):
        assert keys(check_run(config, role)) == ["model"], role
    assert check_run(config, "advantage") == []
    assert keys(check_run(config)) == ["model", "rollout.reward"]  # the CLI: everything


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("demo:nope", "unknown demo task 'demo:nope'"),
        ("prompts.csv", "must be a .jsonl or .parquet file"),
        ("{tmp}/missing.jsonl", "does not exist"),
        ("{tmp}", "must be a .jsonl"),
    ],
)
def test_prompt_sources_that_cannot_be_read(model_dir, tmp_path, spec, expected):
    problems = check_run(run(model_dir, prompts=spec.format(tmp=tmp_path), reward="exact_match"))
    assert keys(problems) == ["rollout.prompts"] and expected in problems[0].message


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"question": "2+2?"}\n', "no 'prompt' field"),
        ("not json\n", "line 1: not valid JSON"),
        ("[1, 2]\n", "expected a JSON object, got list"),
        ("\n\n", "holds no rows"),
    ],
)
def test_a_jsonl_whose_first_row_is_unusable(model_dir, tmp_path, text, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    problems = check_run(run(model_dir, prompts=str(path), reward="exact_match"))
    assert keys(problems) == ["rollout.prompts"] and expected in problems[0].message


def test_an_unreadable_prompts_file(model_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n')
    path.chmod(0)
    try:
        with open(path):
            pytest.skip("running as root: every file is readable")
    except PermissionError:
        pass
    problems = check_run(run(model_dir, prompts=str(path), reward="exact_match"))
    assert keys(problems) == ["rollout.prompts"] and "cannot be read" in problems[0].message


def test_parquet_prompts(model_dir, tmp_path):
    good, bad, empty = tmp_path / "good.parquet", tmp_path / "bad.parquet", tmp_path / "empty.parquet"
    pq.write_table(pa.table({"question": ["2+2?"], "label": ["4"]}), good)
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    bad.write_text("not parquet")
    assert check_run(run(model_dir, prompts=str(good), prompt_field="question", reward="exact_match")) == []
    for path, expected in ((good, "no 'prompt' column"), (bad, "not a readable parquet"), (empty, "holds no rows")):
        problems = check_run(run(model_dir, prompts=str(path), reward="exact_match"))
        assert keys(problems) == ["rollout.prompts"] and expected in problems[0].message, path


def test_eval_prompts_are_checked_too(model_dir, tmp_path):
    config = RunConfig(name="r", model=str(model_dir), eval={"prompts": str(tmp_path / "held_out.jsonl")})
    problems = check_run(config)
    assert keys(problems) == ["eval.prompts"] and "does not exist" in problems[0].message


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("import:no_such_module_zz:score", "cannot import module 'no_such_module_zz'"),
        ("import:tests.rollout.reward_fixtures:missing", "has no attribute 'missing'"),
        ("import:tests.rollout.reward_fixtures:NOT_A_FUNCTION", "not a function"),
        ("import:tests.rollout.reward_fixtures:two_args", "must take (response, fields, prompt)"),
        ("import:tests.run_contract.broken_reward_module:f", "RuntimeError: this module cannot be imported"),
        ("import:no_colon", "must look like module.path:function"),
        ("http://", "names no host"),
        ("gpt-judge", "unknown reward spec 'gpt-judge'"),
    ],
)
def test_reward_specs_that_do_not_resolve(model_dir, spec, expected):
    problems = check_run(run(model_dir, reward=spec))
    assert keys(problems) == ["rollout.reward"] and expected in problems[0].message


def test_a_reward_is_required_unless_the_prompts_are_a_demo_task(model_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n')
    problems = check_run(run(model_dir, prompts=str(path)))
    assert keys(problems) == ["rollout.reward"] and "required" in problems[0].message
    assert check_run(run(model_dir, prompts="demo:arith")) == []


def test_every_problem_is_found_and_described(model_dir):
    (model_dir / "config.json").unlink()
    problems = check_run(run(model_dir, prompts="demo:nope", reward="nope"))
    assert keys(problems) == ["model", "rollout.prompts", "rollout.reward"]
    line = describe(problems)
    assert line.startswith("model: ") and all(f"{p.key}: {p.message}" in line for p in problems)


def test_the_neutral_reward_names_are_the_rollouts():
    assert BUILTIN_REWARD_NAMES == set(BUILTIN_REWARDS)

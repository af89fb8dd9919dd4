"""The run file: pydantic validation with every problem named by key path and file position, relative paths,
the starting file of `--print-defaults`, and the stack's flags."""

from __future__ import annotations

import os

import pytest

from services.front_door.config_reference import defaults_yaml
from services.front_door.run_file import RunFile, RunFileError, load_run_file, parse_run_file, position_of


def problems(text: str) -> list[str]:
    with pytest.raises(RunFileError) as err:
        parse_run_file(text, "run.yaml")
    assert str(err.value) == "\n".join(err.value.problems)
    return err.value.problems


def test_a_bad_value_names_its_key_and_line_and_column():
    text = "name: r\nmodel: m\nrollout:\n  prompts: demo:letters\n  max_new_tokens: 0\n"
    assert problems(text) == ["run.yaml:5:3: rollout.max_new_tokens: Input should be greater than or equal to 1"]


def test_an_unknown_key_is_an_error_at_its_place():
    text = "name: r\nmodel: m\nalgorithm:\n  estimator: grpo\n  gamma_: 0.9\nstack:\n  engines: 2\n  gpus: 1\n"
    assert problems(text) == ["run.yaml:5:3: algorithm.gamma_: unknown key", "run.yaml:8:3: stack.gpus: unknown key"]


def test_a_missing_key_a_bad_choice_and_a_list_item_are_each_named():
    text = "name: r\nalgorithm:\n  estimator: gpro\noptim:\n  betas: [0.9, high]\n"
    found = problems(text)
    assert found[0] == "run.yaml:1:1: model: Field required"
    assert found[1].startswith("run.yaml:3:3: algorithm.estimator: Input should be 'grpo', ")
    assert found[2].startswith("run.yaml:5:16: optim.betas[1]: Input should be a valid number")
    assert len(found) == 3


def test_a_rule_across_fields_names_the_top_level():
    text = "name: r\nmodel: m\nmode: colocate\nmax_staleness: 2\n"
    assert problems(text) == [
        "run.yaml:1:1: (top level): Value error, colocate mode is synchronous: max_staleness must be 0"
    ]


def test_an_engine_flag_that_does_not_exist_or_that_the_stack_sets_is_refused():
    (bad,) = problems("name: r\nmodel: m\nstack:\n  engine_flags:\n    max_total_token: 10\n")
    assert bad.startswith("run.yaml:4:3: stack.engine_flags: Value error, 'max_total_token' is not an engine flag")
    assert "max_total_tokens" in bad
    (port,) = problems("name: r\nmodel: m\nstack:\n  engine_flags: {port: 1}\n")
    assert "'port' is not an engine flag" in port
    (value,) = problems("name: r\nmodel: m\nstack:\n  engine_flags: {max_running: 0}\n")
    assert value == (
        "run.yaml:4:3: stack.engine_flags: Value error, max_running: Input should be greater than or equal to 1"
    )


def test_invalid_yaml_duplicate_keys_and_a_file_that_is_not_a_mapping():
    assert problems("name: r\nmodel: [m\n")[0].startswith("run.yaml:3:1: not valid YAML:")
    assert problems("name: r\nmodel: m\nrollout:\n  top_k: 1\n  top_k: 2\n") == [
        "run.yaml:5:3: rollout.top_k: duplicate key (it is given twice)"
    ]
    not_a_mapping = "run.yaml:1:1: the run file must be a mapping of settings (name: ..., model: ...)"
    assert problems("- name: r\n") == [not_a_mapping]
    assert problems("") == [not_a_mapping]


def test_an_unreadable_file_is_named(tmp_path):
    with pytest.raises(RunFileError) as err:
        load_run_file(str(tmp_path / "missing.yaml"))
    assert err.value.problems[0].startswith(f"{tmp_path / 'missing.yaml'}: cannot read the run file")


def test_relative_paths_are_relative_to_the_file_and_the_run_splits_from_the_stack(tmp_path):
    path = tmp_path / "sub" / "run.yaml"
    path.parent.mkdir()
    path.write_text(
        "name: r1\nmodel: ../m\nrollout: {prompts: data/p.jsonl}\neval: {prompts: data/e.jsonl}\n"
        "stack:\n  engines: 2\n"
        "  engine_flags: {max_total_tokens: 512, device: cpu}\n"
        "  role_flags: {trainer: {pause_mode: abort, verbose: false}}\n"
    )
    run_file = load_run_file(str(path))
    assert run_file.model == str(tmp_path / "m")
    assert run_file.rollout.prompts == str(tmp_path / "sub" / "data" / "p.jsonl")
    assert run_file.eval.prompts == str(tmp_path / "sub" / "data" / "e.jsonl")
    dirs = run_file.directories()
    run_dir = tmp_path / "sub" / "runs" / "r1"
    assert dirs == {"run": str(run_dir), "logs": str(run_dir / "logs"), "checkpoints": str(run_dir / "checkpoints")}
    assert run_file.engine_argv() == ("--max-total-tokens", "512", "--device", "cpu")
    assert run_file.role_argv() == {
        "trainer": ["--output-dir", str(tmp_path / "sub" / "runs"), "--pause-mode", "abort", "--no-verbose"]
    }
    config = run_file.run_config()
    assert type(config).__name__ == "RunConfig" and "stack" not in config.model_dump()
    assert config.model == run_file.model


def test_demo_prompts_stay_as_they_are(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nmodel: /abs/m\nrollout: {prompts: 'demo:letters'}\neval: {prompts: 'demo:letters'}\n")
    run_file = load_run_file(str(path))
    assert (run_file.model, run_file.rollout.prompts, run_file.eval.prompts) == (
        "/abs/m",
        "demo:letters",
        "demo:letters",
    )


def test_the_printed_defaults_load_back_as_the_defaults(tmp_path):
    text = defaults_yaml()
    assert text.count("\n# ") > 10  # commented: each field's description above it
    path = tmp_path / "run.yaml"
    path.write_text(text)
    loaded = load_run_file(str(path))
    expected = RunFile(name="my-run", model=str(tmp_path / "model"), stack={"init_model": "tiny"})
    assert loaded.model_dump(exclude={"stack"}) == expected.model_dump(exclude={"stack"})
    assert loaded.stack.init_model == "tiny" and loaded.stack.engines == expected.stack.engines
    # every field of every section is in the starting file
    for name in RunFile.model_fields:
        assert f"\n{name}:" in "\n" + text, name


def test_position_of_a_dotted_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nmodel: m\nrollout:\n  prompts: x.jsonl\n")
    assert position_of(str(path), "rollout.prompts") == f"{path}:4:3"
    assert position_of(str(path), "rollout.reward") == f"{path}:4:3"  # not in the file: its section
    assert position_of(str(path), "model") == f"{path}:2:1"
    assert position_of(str(tmp_path / "nope.yaml"), "model") == str(tmp_path / "nope.yaml")
    assert os.path.exists(path)

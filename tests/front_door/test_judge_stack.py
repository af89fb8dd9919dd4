"""A run file with a judge model as the reward: stack.judge and rollout.reward model:judge go together, the judge's
model path is relative to the file, its engine flags are checked, and `sluice run` refuses a judge model directory
that is not one before anything starts."""

from __future__ import annotations

import pytest

from services.cli import main as sluice
from services.front_door.run_file import RunFileError, parse_run_file

BASE = "name: r\nmodel: m\n"


def problems(text: str) -> str:
    with pytest.raises(RunFileError) as e:
        parse_run_file(text, "run.yaml")
    return str(e.value)


def test_the_judge_engine_and_the_judge_reward_go_together():
    assert "stack.judge.model starts a judge engine, which only rollout.reward model:judge uses" in problems(
        BASE + "rollout: {reward: exact_match}\nstack: {judge: {model: j}}\n"
    )
    assert "rollout.reward model:judge needs the stack's judge engine: set stack.judge.model" in problems(
        BASE + "rollout: {reward: 'model:judge'}\n"
    )
    # a judge the operator names to the rollout himself, or one by URL, needs no judge engine of the stack
    parse_run_file(
        BASE + "rollout: {reward: 'model:judge'}\n"
        "stack: {role_flags: {rollout: {judge_urls: 'judge=http://10.0.0.9:30000'}}}\n"
    )
    parse_run_file(BASE + "rollout: {reward: 'model:http://10.0.0.9:30000'}\n")


def test_the_judge_model_is_relative_to_the_file_and_its_flags_are_checked(tmp_path):
    run = parse_run_file(
        BASE + "rollout: {reward: 'model:judge'}\nstack:\n  judge:\n    model: judges/j\n"
        "    engine_flags: {max_running: 4, device: cpu}\n",
        str(tmp_path / "run.yaml"),
    )
    assert run.stack.judge.model == str(tmp_path / "judges" / "j")
    assert run.judge_argv() == ("--max-running", "4", "--device", "cpu")
    assert "stack.judge.engine_flags" in problems(
        BASE + "rollout: {reward: 'model:judge'}\nstack: {judge: {model: j, engine_flags: {port: 1}}}\n"
    )
    assert "judge" not in run.run_config().model_dump()  # the stack's, not the run's the coordinator stores


def test_bad_judge_settings_are_named_at_their_place():
    found = problems(
        BASE + "rollout:\n  reward: 'model:judge'\n  judge:\n    template: 'rate it'\nstack: {judge: {model: j}}\n"
    )
    assert "run.yaml:6:5: rollout.judge.template" in found and "must hold {response}" in found


def test_sluice_run_refuses_a_judge_model_that_is_not_there(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        "name: r\nmodel: m\nrollout:\n  prompts: demo:letters\n  reward: model:judge\n"
        "stack:\n  init_model: tiny\n  judge:\n    model: no-such-judge\n"
    )
    assert sluice(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:9:5: stack.judge.model: " in err and "no-such-judge" in err
    assert not (tmp_path / "runs").exists()  # nothing was started

"""`sluice run` refuses a run before it starts anything: a bad file, what the preflight checks find (each
named by key and place in the file), a checkpoint it was not told to continue, --resume without one."""

from __future__ import annotations

import pytest

from services.cli import main as sluice
from services.model.init_model import init_model

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("model")), preset="tiny")


def write(tmp_path, body: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(body)
    return str(path)


def test_a_bad_file_exits_2_naming_each_problem(tmp_path, capsys):
    path = write(tmp_path, "name: r\nmodel: m\nrollout:\n  max_new_tokens: 0\n  temprature: 1\n")
    assert sluice(["run", path]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"sluice run: {path}:4:3: rollout.max_new_tokens: Input should be greater than or equal to 1",
        f"sluice run: {path}:5:3: rollout.temprature: unknown key",
    ]


def test_preflight_problems_are_named_by_key_and_place(tmp_path, model_dir, capsys):
    path = write(
        tmp_path,
        f"name: r\nmodel: {model_dir}\nrollout:\n  prompts: data/missing.jsonl\n"
        "  reward: import:no_such_module_here:score\n",
    )
    assert sluice(["run", path]) == 2
    err = capsys.readouterr().err
    assert f"sluice run: {path}:4:3: rollout.prompts: " in err and "missing.jsonl" in err
    assert f"sluice run: {path}:5:3: rollout.reward: " in err and "no_such_module_here" in err
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_a_checkpoint_is_continued_only_with_resume_and_resume_needs_one(tmp_path, model_dir, capsys):
    path = write(tmp_path, f"name: r\nmodel: {model_dir}\nstack:\n  checkpoint_dir: ckpt\n")
    assert sluice(["run", path, "--resume"]) == 2
    assert (
        f"{path}:4:3: stack.checkpoint_dir: --resume, but {tmp_path / 'ckpt'} holds no checkpoint"
        in capsys.readouterr().err
    )
    state = tmp_path / "ckpt" / "actor" / "step_00000003"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text('{"next_step": 3, "version": 3}')
    assert sluice(["run", path]) == 2
    err = capsys.readouterr().err
    assert "holds a checkpoint of an earlier run (next step 3): add --resume" in err


def test_print_defaults_and_a_missing_file(tmp_path, capsys):
    assert sluice(["run", "--print-defaults"]) == 0
    assert "\nstack:\n" in capsys.readouterr().out
    assert sluice(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read the run file" in capsys.readouterr().err

"""A missing or malformed model directory is an error naming the directory and the file, never a hub error
about repo ids (Sluice never downloads)."""

import os
import shutil

import pytest

from services.model.init_model import init_model
from services.model.loading import ModelDirError, check_model_dir, load_causal_lm, load_tokenizer
from services.trainer.critic_update import load_critic

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch="qwen2", seed=2)


@pytest.fixture
def copy(model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def test_a_complete_directory_passes(model_dir):
    check_model_dir(model_dir)
    model, tokenizer = load_causal_lm(model_dir)
    assert tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("path", ["/no/such/org/model", "Qwen/Qwen2.5-0.5B", "relative/missing/dir"])
def test_a_path_that_does_not_exist_is_an_error_about_the_path(path):
    for load in (load_causal_lm, load_tokenizer, load_critic):
        with pytest.raises(ModelDirError) as exc:
            load(path)
        assert repr(path) in str(exc.value) and "does not exist" in str(exc.value)
        assert "repo" not in str(exc.value).lower()


@pytest.mark.parametrize(
    "remove, problem",
    [
        ("config.json", "config.json is missing"),
        ("model.safetensors", "no weights"),
        ("tokenizer_config.json", "tokenizer_config.json is missing"),
        ("tokenizer.json", "no tokenizer vocabulary"),
    ],
)
def test_a_missing_file_is_named(copy, remove, problem):
    os.remove(copy / remove)
    with pytest.raises(ModelDirError) as exc:
        load_causal_lm(str(copy))
    assert str(copy) in str(exc.value) and problem in str(exc.value)


def test_the_tokenizer_alone_needs_no_weights(copy):
    os.remove(copy / "model.safetensors")
    assert load_tokenizer(str(copy)).eos_token == "<|endoftext|>"  # the rollout loads only the tokenizer


@pytest.mark.parametrize(
    "content, problem", [("{not json", "config.json is not valid JSON"), ('{"hidden_size": 8}', "no model_type")]
)
def test_a_malformed_config_is_named(copy, content, problem):
    (copy / "config.json").write_text(content)
    with pytest.raises(ModelDirError, match=problem):
        load_causal_lm(str(copy))


def test_corrupt_weights_are_an_error_naming_the_directory(copy):
    (copy / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelDirError) as exc:
        load_causal_lm(str(copy))
    assert str(copy) in str(exc.value) and "does not load" in str(exc.value)


def test_a_file_instead_of_a_directory(copy):
    with pytest.raises(ModelDirError, match="not a directory"):
        check_model_dir(str(copy / "config.json"))


def test_an_engine_given_a_missing_directory_exits_with_one_line_naming_it(tmp_path):
    import subprocess
    import sys

    missing = str(tmp_path / "no-model")
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "engine", "--model", missing, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 2
    assert f"model directory '{missing}': does not exist" in out.stderr and "Traceback" not in out.stderr

"""Checkpoints carry the run's tokenizer and chat template, keep the newest `keep_last`, and the run config
takes the checkpoint settings under `checkpoint:` (and the older `checkpoint_interval`)."""

import json
import os
import shutil

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import checkpoints, latest_checkpoint, save_checkpoint
from services.run_contract.run_config import RunConfig

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch="qwen2", seed=4)


@pytest.fixture(scope="module")
def trained(model_dir):
    model, _ = load_causal_lm(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def _chat(directory: str) -> str:
    return AutoTokenizer.from_pretrained(directory, local_files_only=True).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )


def test_checkpoint_holds_the_tokenizer_and_chat_template_of_the_run_model(model_dir, trained, tmp_path):
    path = save_checkpoint(str(tmp_path), "actor", *trained, model_dir, next_step=1, version=1)
    names = set(os.listdir(path))
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "optimizer.pt",
        "trainer_state.json",
    } <= names
    assert _chat(path) == _chat(model_dir) and "<|im_start|>assistant" in _chat(path)
    source, copy = (AutoTokenizer.from_pretrained(d, local_files_only=True) for d in (model_dir, path))
    assert (copy.eos_token, copy.pad_token) == (source.eos_token, source.pad_token) == ("<|endoftext|>", "<|pad|>")
    assert copy("the answer is 5").input_ids == source("the answer is 5").input_ids


def test_a_chat_template_kept_in_its_own_file_is_copied(model_dir, trained, tmp_path):
    """Newer tokenizers keep the template in chat_template.jinja instead of tokenizer_config.json."""
    source = tmp_path / "model"
    shutil.copytree(model_dir, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    template = config.pop("chat_template", None) or (source / "chat_template.jinja").read_text()
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "chat_template.jinja").write_text("{{ 'custom:' }}" + template)
    path = save_checkpoint(str(tmp_path / "ckpt"), "actor", *trained, str(source), next_step=1, version=1)
    assert (tmp_path / "ckpt" / "actor" / "step_00000001" / "chat_template.jinja").exists()
    assert _chat(path).startswith("custom:") and _chat(path) == _chat(str(source))


@pytest.mark.parametrize("keep", [1, 3])
def test_keep_last_checkpoints_are_kept(model_dir, trained, tmp_path, keep):
    for step in range(1, 6):
        save_checkpoint(str(tmp_path), "actor", *trained, model_dir, next_step=step, version=step, keep=keep)
    assert [c.next_step for c in checkpoints(str(tmp_path), "actor")] == list(range(5, 5 - keep, -1))
    assert sorted(os.listdir(tmp_path / "actor")) == [f"step_{s:08d}" for s in range(6 - keep, 6)]
    assert latest_checkpoint(str(tmp_path), "actor").version == 5


def test_keep_below_one_is_refused_before_anything_is_written(model_dir, trained, tmp_path):
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(str(tmp_path), "actor", *trained, model_dir, next_step=1, version=1, keep=0)
    assert not (tmp_path / "actor").exists()


def test_run_config_checkpoint_settings_and_the_older_spelling(model_dir):
    base = dict(
        name="r", model=model_dir, n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4, micro_batch_size=2
    )
    run = RunConfig(**base, checkpoint={"interval": 5, "keep_last": 4})
    assert (run.checkpoint_interval, run.checkpoint.keep_last, run.checkpoint.on_stop) == (5, 4, True)
    old = RunConfig(**base, checkpoint_interval=3)
    assert old.checkpoint.interval == 3 and old.checkpoint.keep_last == 2
    assert RunConfig.model_validate_json(old.model_dump_json()).checkpoint.interval == 3  # as roles read it
    with pytest.raises(ValidationError, match="disagree"):
        RunConfig(**base, checkpoint_interval=3, checkpoint={"interval": 4})
    with pytest.raises(ValidationError, match="keep_last"):
        RunConfig(**base, checkpoint={"keep_last": 0})
    with pytest.raises(ValidationError, match="keep"):
        RunConfig(**base, checkpoint={"keep": 3})  # unknown key

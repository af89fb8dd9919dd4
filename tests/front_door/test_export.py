"""`sluice export`: a checkpoint becomes a plain Hugging Face directory that transformers loads with the trained
weights (same logits) and the run's tokenizer and chat template; bad input is refused naming the path."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.front_door.export_command import ExportError, export_checkpoint
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import save_checkpoint

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch="llama", seed=6)


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):
    """A trainer checkpoint whose weights moved away from the initial model; (root, trained model)."""
    model, _ = load_causal_lm(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(1))
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    root = str(tmp_path_factory.mktemp("ckpt"))
    for step in (1, 2):
        save_checkpoint(root, "actor", model, optimizer, model_dir, next_step=step, version=step)
    return root, model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_round_trip_loads_in_transformers_with_the_trained_logits(model_dir, checkpoint, tmp_path):
    root, trained = checkpoint
    out = tmp_path / "hf"
    source = export_checkpoint(os.path.join(root, "actor", "step_00000002"), str(out))
    assert source.endswith("step_00000002")
    names = set(os.listdir(out))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    assert not names & {"optimizer.pt", "trainer_state.json"}
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (3, 16), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logits(exported, ids), _logits(trained, ids))
    initial, _ = load_causal_lm(model_dir)
    assert not torch.allclose(_logits(initial, ids), _logits(exported, ids))  # the trained weights, not the start
    tokenizer, original = (AutoTokenizer.from_pretrained(d, local_files_only=True) for d in (str(out), model_dir))
    chat = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat == original.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.eos_token == original.eos_token and tokenizer.pad_token == original.pad_token


def test_export_of_a_checkpoint_dir_takes_the_newest_and_casts_on_request(checkpoint, tmp_path):
    root, trained = checkpoint
    source = export_checkpoint(root, str(tmp_path / "bf16"), dtype="bfloat16")
    assert source.endswith(os.path.join("actor", "step_00000002"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), local_files_only=True, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    # the role folder names the newest too; a plain model directory (no trainer_state.json) exports as it is
    assert export_checkpoint(os.path.join(root, "actor"), str(tmp_path / "a")).endswith("step_00000002")
    assert export_checkpoint(str(tmp_path / "bf16"), str(tmp_path / "again")) == str(tmp_path / "bf16")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"  # kept as stored


def test_export_refuses_bad_input_and_writes_nothing(checkpoint, tmp_path):
    root, _ = checkpoint
    with pytest.raises(ExportError, match="does not exist"):
        export_checkpoint(str(tmp_path / "nowhere"), str(tmp_path / "out"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExportError, match="neither a checkpoint"):
        export_checkpoint(str(empty), str(tmp_path / "out"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(root, str(taken))
    assert os.listdir(taken) == ["keep.txt"] and not (tmp_path / "out").exists()
    for inside in (root, os.path.join(root, "actor")):  # --force there would delete the checkpoint itself
        with pytest.raises(ExportError, match="holds the checkpoint"):
            export_checkpoint(root, inside, force=True)
    assert os.path.isdir(os.path.join(root, "actor", "step_00000002"))


def test_sluice_export_command(checkpoint, tmp_path):
    root, _ = checkpoint
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "export", root, str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "services.cli", "export", str(tmp_path / "nope"), str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 2 and "nope" in bad.stderr and "does not exist" in bad.stderr

"""Trainer checkpoints: <dir>/<role>/step_<N>/ holds a Hugging Face model directory (loadable by
transformers and by `sluice engine --model`) with the run's tokenizer files and chat template, the optimizer
state and trainer_state.json (next step, weight version: the data position). Written to a temporary directory
and renamed, so a crash mid-write leaves the previous checkpoint as the latest; the newest `keep` are kept."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import dataclass

# What a model directory's tokenizer is made of, chat template included (tokenizer_config.json's
# chat_template, or chat_template.jinja / chat_template.json beside it in newer transformers).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
)  # *.model: sentencepiece vocabularies


@dataclass
class CheckpointState:
    next_step: int
    version: int
    path: str


def _root(directory: str, role: str) -> str:
    return os.path.join(directory, role)


def tokenizer_files(directory: str) -> list[str]:
    """Names of the tokenizer files (and chat templates) in a model directory."""
    return sorted(
        name for name in os.listdir(directory) if any(fnmatch.fnmatch(name, pattern) for pattern in TOKENIZER_FILES)
    )


def copy_tokenizer(source: str, target: str) -> list[str]:
    """Copy the tokenizer files of model directory `source` into `target`; returns their names."""
    names = tokenizer_files(source)
    for name in names:
        path = os.path.join(source, name)
        if os.path.isdir(path):  # additional_chat_templates/
            shutil.copytree(path, os.path.join(target, name), dirs_exist_ok=True)
        else:
            shutil.copy(path, target)
    return names


SHARDED = "sharded"  # a backend's own distributed checkpoint inside a checkpoint directory (megatron's, fsdp's)


@dataclass
class ShardedState:
    """What a sharded trainer backend wrote for a checkpoint (every rank together) under a scratch directory:
    `model_dir` holds the weights as Hugging Face safetensors files (services/model/weight_files.py),
    `sharded` the optimizer state in the backend's own distributed format."""

    model_dir: str
    sharded: str


def save_checkpoint(
    directory: str,
    role: str,
    model,
    optimizer,
    tokenizer_dir: str | None,
    next_step: int,
    version: int,
    keep: int = 2,
    state: ShardedState | None = None,
    copied=None,
) -> str:
    """Write <directory>/<role>/step_<next_step>/: the model (safetensors), the tokenizer files of
    `tokenizer_dir` (the run's model directory), the optimizer state and trainer_state.json; then delete all
    but the newest `keep` checkpoints of the role. `state`: a sharded backend's files, moved in instead of
    `model`'s weights (its config is still written) and `optimizer`'s state (as `sharded/`, no optimizer.pt).
    `copied`: a copy of both taken earlier (anything with `model_state` and `optimizer_state`, e.g.
    services/trainer/checkpoint_copy.py), written instead of the live ones."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    root = _root(directory, role)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step_{next_step:08d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if state is None:
        import torch  # loaded already by whoever trains `model`; `sluice run`, which only reads checkpoints, never

        model.save_pretrained(tmp, safe_serialization=True, state_dict=copied.model_state if copied else None)
        torch.save(copied.optimizer_state if copied else optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    else:
        os.replace(state.model_dir, tmp)
        model.config.save_pretrained(tmp)
        if model.can_generate():
            model.generation_config.save_pretrained(tmp)
        os.replace(state.sharded, os.path.join(tmp, SHARDED))
        shutil.rmtree(os.path.dirname(state.model_dir), ignore_errors=True)  # the backend's emptied scratch
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, tmp)
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"next_step": next_step, "version": version}, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def checkpoints(directory: str, role: str) -> list[CheckpointState]:
    """Complete checkpoints, newest first."""
    root = _root(directory, role)
    if not directory or not os.path.isdir(root):
        return []
    found = []
    for name in sorted((d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")), reverse=True):
        state = read_checkpoint(os.path.join(root, name))
        if state is not None:
            found.append(state)
    return found


def read_checkpoint(path: str) -> CheckpointState | None:
    """The state of the checkpoint at `path`; None if it is not a complete checkpoint."""
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        return CheckpointState(int(state["next_step"]), int(state["version"]), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # incomplete


def latest_checkpoint(directory: str, role: str) -> CheckpointState | None:
    found = checkpoints(directory, role)
    return found[0] if found else None


def load_optimizer_state(path: str, optimizer) -> None:
    import torch  # loaded already by the trainer that owns `optimizer`

    # our own file, written by save_checkpoint; weights_only keeps unpickling to tensors and plain types
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))

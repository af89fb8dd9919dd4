"""Trainer checkpoints: <dir>/<role>/step_<N>/ holds a Hugging Face model directory (loadable by
transformers and by `sluice engine --model`), the optimizer state and trainer_state.json (next step,
weight version: the data position). Written to a temporary directory and renamed, so a crash
mid-write leaves the previous checkpoint as the latest."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch


@dataclass
class CheckpointState:
    next_step: int
    version: int
    path: str


def _root(directory: str, role: str) -> str:
    return os.path.join(directory, role)


def save_checkpoint(directory: str, role: str, model, optimizer, tokenizer_dir: str | None, next_step: int,
                    version: int, keep: int = 2) -> str:
    root = _root(directory, role)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step_{next_step:08d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(os.path.join(tokenizer_dir, name), tmp)
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
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
    for name in sorted((d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp")),
                       reverse=True):
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "trainer_state.json")) as f:
                state = json.load(f)
            found.append(CheckpointState(int(state["next_step"]), int(state["version"]), path))
        except (OSError, ValueError, KeyError):
            continue  # incomplete
    return found


def latest_checkpoint(directory: str, role: str) -> CheckpointState | None:
    found = checkpoints(directory, role)
    return found[0] if found else None


def load_optimizer_state(path: str, optimizer) -> None:
    # our own file, written by save_checkpoint; weights_only keeps unpickling to tensors and plain types
    optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))

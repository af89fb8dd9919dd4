"""Load a Hugging Face causal LM and its tokenizer from a local directory (never from a hub).
Hugging Face parameter names are Sluice's one wire format for weights.

Sluice never downloads: a model is a directory, and a directory that is missing or lacks a file is reported
as such (ModelDirError naming the directory and the file) before transformers is asked, which would
otherwise take a path that does not exist for a hub repo id and fail with an error about repo ids."""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING

from services.runtime.startup import StartupError, imports_uncollected

if TYPE_CHECKING:  # torch is imported where a model is loaded: checking a directory (and ModelDirError) needs none
    import torch

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "pytorch_model-*.bin",
)
# any of these is enough for AutoTokenizer (a fast tokenizer's tokenizer.json, or a slow one's vocabulary)
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")  # *.model: sentencepiece


class ModelDirError(StartupError):
    """A model directory that cannot be loaded: names the directory and what is missing or wrong."""

    def __init__(self, directory: str, problem: str):
        self.directory, self.problem = directory, problem
        super().__init__(f"model directory {directory!r}: {problem}")


def _any(directory: str, patterns: tuple[str, ...]) -> bool:
    return any(glob.glob(os.path.join(glob.escape(directory), p)) for p in patterns)


def check_model_dir(directory: str, weights: bool = True, tokenizer: bool = True) -> None:
    """Raise ModelDirError unless `directory` is a local Hugging Face model directory: it exists, holds a
    config.json that is a JSON object with `model_type`, (`weights`) a weights file (*.safetensors or
    pytorch_model*.bin) and (`tokenizer`) tokenizer_config.json with a vocabulary file (tokenizer.json, ...)."""
    if not directory:
        raise ModelDirError(directory, "no path given")
    if not os.path.exists(directory):
        raise ModelDirError(directory, "does not exist (Sluice loads models from local directories only)")
    if not os.path.isdir(directory):
        raise ModelDirError(directory, "is not a directory")
    config = os.path.join(directory, "config.json")
    if not os.path.isfile(config):
        raise ModelDirError(directory, "config.json is missing")
    try:
        with open(config) as f:
            parsed = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelDirError(directory, f"config.json is not valid JSON ({exc})") from None
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise ModelDirError(directory, "config.json has no model_type (not a Hugging Face model config)")
    if weights and not _any(directory, WEIGHT_FILES):
        raise ModelDirError(
            directory,
            "no weights: expected model.safetensors (or model-*.safetensors with "
            "model.safetensors.index.json, or pytorch_model*.bin)",
        )
    if tokenizer:
        if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
            raise ModelDirError(directory, "tokenizer_config.json is missing")
        if not _any(directory, TOKENIZER_VOCAB_FILES):
            raise ModelDirError(
                directory,
                "no tokenizer vocabulary: expected tokenizer.json (or tokenizer.model, vocab.json, vocab.txt)",
            )


def load_tokenizer(directory: str):
    """The tokenizer of a local model directory (chat template included); ModelDirError if it cannot be."""
    check_model_dir(directory, weights=False)
    with imports_uncollected():  # mostly transformers' imports (services/runtime/startup.py)
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:  # a malformed file fails deep in transformers with any error (KeyError, ...)
            raise ModelDirError(directory, f"the tokenizer does not load: {exc}") from exc


def check_tokenizer_loads(directory: str) -> None:
    """ModelDirError unless the directory's tokenizer loads, checked without importing transformers (and with
    it torch: seconds of `sluice run`'s start, before any service starts) where it can be: a fast tokenizer's
    tokenizer.json parsed by the `tokenizers` library, as transformers parses it, and tokenizer_config.json
    read as JSON. A directory with only a slow tokenizer's vocabulary is loaded with AutoTokenizer."""
    check_model_dir(directory, weights=False)
    fast = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(fast):
        load_tokenizer(directory)
        return
    from tokenizers import Tokenizer

    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            json.load(f)
        Tokenizer.from_file(fast)
    except Exception as exc:  # the tokenizers library fails a malformed file with its own Exception type
        raise ModelDirError(directory, f"the tokenizer does not load: {exc}") from exc


def load_causal_lm(directory: str, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """(model in eval mode on `device`, tokenizer) of a local model directory; ModelDirError if a file is
    missing or does not load."""
    check_model_dir(directory)
    with imports_uncollected():  # mostly the imports of transformers' modelling code for this architecture
        import torch
        from safetensors import SafetensorError
        from transformers import AutoModelForCausalLM

        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        tokenizer = load_tokenizer(directory)
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, local_files_only=True)
        except (OSError, ValueError, KeyError, SafetensorError) as exc:  # a truncated or corrupt weights file
            raise ModelDirError(directory, f"the model does not load: {exc}") from exc
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]  # transformers' typing of the decorated .to

"""Load a Hugging Face causal LM and its tokenizer from a local directory (never from a hub).
Hugging Face parameter names are Sluice's one wire format for weights."""

from __future__ import annotations

import torch


def load_causal_lm(directory: str, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, local_files_only=True)
    return model.to(device).eval(), tokenizer

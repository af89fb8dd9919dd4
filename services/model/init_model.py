"""`sluice init-model DIR --preset tiny|small|medium`: a randomly initialised Hugging Face causal LM plus an
offline-built tokenizer, written to DIR and loadable by transformers with no network."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from services.runtime.settings_cli import HelpWithDefaults


def init_model(
    directory: str,
    preset: str = "tiny",
    arch: str = "qwen2",
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 1024,
) -> str:
    from transformers import AutoModelForCausalLM

    from services.model.presets import make_config
    from services.model.tokenizer_build import build_tokenizer

    os.makedirs(directory, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size=vocab_size, seed=seed)
    config = make_config(
        arch,
        preset,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice init-model", description=__doc__, formatter_class=HelpWithDefaults)
    parser.add_argument("directory", help="where to write the model and its tokenizer")
    parser.add_argument(
        "--preset",
        choices=["tiny", "small", "medium"],
        default="tiny",
        help="model shape: tiny (~0.1M parameters, tests), small (~3M, the demo and CPU benchmarks) "
        "or medium (~0.1B, GPU benchmarks)",
    )
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2", help="architecture")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype")
    parser.add_argument("--vocab-size", type=int, default=1024, help="vocabulary of the built tokenizer")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = init_model(args.directory, args.preset, args.arch, args.seed, args.dtype, args.vocab_size)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

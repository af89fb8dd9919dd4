"""Model shapes `sluice init-model` can write: Qwen2 and Llama architectures at test/demo sizes."""

from __future__ import annotations

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

PRESETS = {
    # ~0.1M parameters: unit tests, engine correctness
    "tiny": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    # ~0.28M parameters: time_to_reward's short-answer task, where a step's fixed cost dominates its compute
    "mini": dict(
        hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    ),
    # ~3M parameters: the demo and throughput benchmarks on CPU
    "small": dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
    ),
    # ~0.1B parameters: the engine benchmark on a GPU, where small's steps are all kernel-launch overhead
    "medium": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8
    ),
}
ARCHITECTURES = {"qwen2": Qwen2Config, "llama": LlamaConfig}


def make_config(
    arch: str, preset: str, vocab_size: int, eos_token_id: int, pad_token_id: int, max_position_embeddings: int = 2048
) -> PretrainedConfig:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; one of {sorted(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; one of {sorted(PRESETS)}")
    return ARCHITECTURES[arch](
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **PRESETS[preset],
    )

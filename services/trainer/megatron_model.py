"""A megatron-core GPTModel from a Hugging Face Qwen2 or Llama config, and the weights both ways.

Layouts (HF -> megatron), for tensor-parallel size `tp` and pipeline-parallel size `pp`:
- q/k/v projections -> `linear_qkv`, one fused matrix arranged per query group g (megatron's layout):
  [q heads of group g (heads / groups of them), k of g, v of g] for g in 0..groups-1, each head_dim rows;
  biases the same (Qwen2). Column-parallel: rank r holds groups [r * groups / tp, (r + 1) * groups / tp).
- gate/up projections -> `linear_fc1` = [gate; up]; column-parallel per half: rank r holds
  [gate rows of r; up rows of r].
- o_proj -> `linear_proj`, down_proj -> `linear_fc2`: row-parallel (split along the input dimension).
- embed_tokens / lm_head -> `embedding.word_embeddings` / `output_layer`: vocabulary-parallel (split along the
  vocabulary, which must divide by tp). Norms are replicated.
- Pipeline stage s holds decoder layers [s * L / pp, (s + 1) * L / pp), numbered from 0 within the stage; the
  first stage holds the embedding, the last the final norm and the output layer.
`to_megatron` gives one rank's tensors; `to_hf` merges every rank's (each stage's tp shards) back, exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _check(hf_config, tp: int, pp: int) -> None:
    if hf_config.model_type not in ("qwen2", "llama"):
        raise ValueError(f"the megatron backend builds qwen2 and llama models, not {hf_config.model_type!r}")
    for name, value in (
        ("num_key_value_heads", hf_config.num_key_value_heads),
        ("vocab_size", hf_config.vocab_size),
        ("intermediate_size", hf_config.intermediate_size),
    ):
        if value % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide {name} {value}")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"pipeline-parallel size {pp} does not divide {hf_config.num_hidden_layers} layers")


def init_model_parallel(tp: int, pp: int, seed: int) -> None:
    """megatron's tensor/pipeline groups over the initialised default group, and its model-parallel RNG states
    (dropout and initialisation regions; on CPU they fork the CPU generator, services/trainer/megatron_cpu.py)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(hf_config, tp: int = 1, pp: int = 1, sequence_parallel: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check(hf_config, tp, pp)
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=_head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        bf16=False,
        fp16=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt(
    hf_config,
    tp: int = 1,
    pp: int = 1,
    pre_process: bool = True,
    post_process: bool = True,
    sequence_parallel: bool = False,
):
    """This rank's GPTModel (its pipeline stage's layers, its tensor-parallel shards; model-parallel groups must
    be initialised), with megatron's local (non-TransformerEngine) layers. With `sequence_parallel` the
    activations outside the attention and MLP blocks (norms, residuals, dropout) are split along the sequence
    over the TP ranks (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models")."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(hf_config, tp, pp, sequence_parallel)
    return GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(config),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        pre_process=pre_process,
        post_process=post_process,
    )


class RMSNorm:
    """torch's RMSNorm as megatron's local layers build a norm (WrappedTorchNorm, which refuses sequence
    parallelism: megatron expects apex's fused norm there). The weight carries megatron's `sequence_parallel`
    mark, so that with sequence parallelism, where each TP rank's norm sees only its part of the sequence,
    finalize_model_grads sums its gradient over the TP ranks."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]  # megatron's mark
        return norm


def _block_spec(config):
    """megatron's local (non-TransformerEngine) layer spec for this stage's layers, with RMSNorm above."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec()
    layer = dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] (HF, rows = heads x head_dim) -> megatron's per-group interleaving (weights or biases)."""
    qs, ks, vs = q.chunk(groups), k.chunk(groups), v.chunk(groups)
    return torch.cat([torch.cat([qs[g], ks[g], vs[g]]) for g in range(groups)])


def _split_qkv(fused: torch.Tensor, groups: int, q_rows: int, kv_rows: int):
    parts = fused.split([q_rows // groups + 2 * (kv_rows // groups)] * groups)
    qs, ks, vs = zip(*(p.split([q_rows // groups, kv_rows // groups, kv_rows // groups]) for p in parts))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs)


def stage_layers(hf_config, pp: int, stage: int) -> range:
    per = hf_config.num_hidden_layers // pp
    return range(stage * per, (stage + 1) * per)


def to_megatron(
    hf: dict[str, torch.Tensor], hf_config, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_stage: int = 0
) -> dict[str, torch.Tensor]:
    """The megatron state dict of tensor-parallel rank `tp_rank` of pipeline stage `pp_stage`."""
    _check(hf_config, tp, pp)
    groups = hf_config.num_key_value_heads
    out: dict[str, torch.Tensor] = {}

    def column(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp)[tp_rank].clone()

    def row(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[tp_rank].clone()

    for local, layer in enumerate(stage_layers(hf_config, pp, pp_stage)):
        h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = column(
            _fused_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], groups)
        )
        if a + "q_proj.bias" in hf:
            out[m + "self_attention.linear_qkv.bias"] = column(
                _fused_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], groups)
            )
        out[m + "self_attention.linear_proj.weight"] = row(hf[a + "o_proj.weight"])
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([column(gate), column(up)])
        out[m + "mlp.linear_fc2.weight"] = row(hf[h + "mlp.down_proj.weight"])
    first, last = pp_stage == 0, pp_stage == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = column(hf["model.embed_tokens.weight"])
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not hf_config.tie_word_embeddings:
            out["output_layer.weight"] = column(hf["lm_head.weight"])
        elif not first:  # the last stage's copy of the tied embedding
            out["output_layer.weight"] = column(hf["model.embed_tokens.weight"])
    return out


def layer_to_hf(shards: list[dict[str, torch.Tensor]], hf_config, local: int, layer: int) -> dict[str, torch.Tensor]:
    """HF decoder layer `layer` from its stage's tp shards (`shards[r]`), where it is layer `local`."""
    groups, d = hf_config.num_key_value_heads, _head_dim(hf_config)
    q_rows, kv_rows = hf_config.num_attention_heads * d, groups * d
    h, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
    a = h + "self_attn."

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    hf: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias"):
        if m + f"self_attention.linear_qkv.{kind}" in shards[0]:
            q, k, v = _split_qkv(cat(m + f"self_attention.linear_qkv.{kind}"), groups, q_rows, kv_rows)
            hf[a + f"q_proj.{kind}"], hf[a + f"k_proj.{kind}"], hf[a + f"v_proj.{kind}"] = q, k, v
    hf[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", dim=1)
    hf[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"].clone()
    hf[h + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"].clone()
    halves = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
    hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves])
    hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves])
    hf[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", dim=1)
    return hf


def ends_to_hf(shards: list[dict[str, torch.Tensor]], hf_config, first: bool, last: bool) -> dict[str, torch.Tensor]:
    """The embedding (first stage) and the final norm and output layer (last stage) from their tp shards."""
    hf: dict[str, torch.Tensor] = {}
    if first:
        hf["model.embed_tokens.weight"] = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    if last:
        hf["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
        if not hf_config.tie_word_embeddings:
            hf["lm_head.weight"] = torch.cat([s["output_layer.weight"] for s in shards])
    return hf


def to_hf(stages: list[list[dict[str, torch.Tensor]]], hf_config) -> dict[str, torch.Tensor]:
    """Every rank's megatron tensors (`stages[s][r]`: stage s, tensor-parallel rank r) merged into HF's."""
    pp, tp = len(stages), len(stages[0])
    _check(hf_config, tp, pp)
    hf: dict[str, torch.Tensor] = {}
    for stage, shards in enumerate(stages):
        for local, layer in enumerate(stage_layers(hf_config, pp, stage)):
            hf.update(layer_to_hf(shards, hf_config, local, layer))
        hf.update(ends_to_hf(shards, hf_config, stage == 0, stage == pp - 1))
    return hf

"""A ragged-batch forward pass over a Hugging Face Qwen2/Llama model's own modules, with a KV cache
per sequence: the core of the built-in engine's continuous batching.

One call runs any mix of sequences, each contributing its new tokens (a whole prompt, a chunk, or
one decode token). All token-wise work (projections, MLP, norms, lm_head) runs as one batched matmul
over every new token of every sequence; attention runs per sequence against that sequence's cache.
The model's modules and parameters are used in place, so a weight update loaded into the HF model
is what the next step computes with. Float32 results match the HF model's own forward within ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """One sequence's keys and values per layer: [kv_heads, capacity, head_dim], filled up to
    `length`. Capacity doubles when it runs out, so appending a token is O(1) amortised."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, n, head_dim] at positions start..start+n-1; return the filled views."""
        end = start + k.shape[1]
        if layer == len(self.keys):
            capacity = max(16, 2 * end)
            self.keys.append(k.new_empty(k.shape[0], capacity, k.shape[2]))
            self.values.append(v.new_empty(v.shape[0], capacity, v.shape[2]))
        elif end > self.keys[layer].shape[1]:
            capacity = 2 * end
            for store in (self.keys, self.values):
                grown = store[layer].new_empty(store[layer].shape[0], capacity, store[layer].shape[2])
                grown[:, :start] = store[layer][:, :start]
                store[layer] = grown
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RaggedDecoder:
    def __init__(self, hf_model):
        if hf_model.config.model_type not in ("qwen2", "llama"):
            raise ValueError(f"unsupported architecture {hf_model.config.model_type!r} (qwen2, llama)")
        self.hf = hf_model
        self.inner = hf_model.model
        cfg = hf_model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @torch.no_grad()
    def forward(self, new_tokens: list[torch.Tensor], caches: list[KVCache],
                all_logits: bool = False) -> list[torch.Tensor]:
        """new_tokens[i]: 1-D token ids appended to sequence i (whose cache is caches[i], updated in
        place). Returns per sequence the logits of its last new token [vocab], or of every new token
        [n_i, vocab] with all_logits."""
        lengths = [len(t) for t in new_tokens]
        starts = [c.length for c in caches]
        ids = torch.cat(new_tokens)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).unsqueeze(0)
        hidden = self.inner.embed_tokens(ids).unsqueeze(0)  # [1, T, hidden]
        cos, sin = self.inner.rotary_emb(hidden, positions)  # [1, T, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        total = ids.shape[0]
        for li, layer in enumerate(self.inner.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q = attn.q_proj(x).view(1, total, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, total, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, total, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            outputs = []
            offset = 0
            for i, n in enumerate(lengths):
                keys, values = caches[i].write(li, starts[i], k[0, :, offset:offset + n], v[0, :, offset:offset + n])
                outputs.append(self._attend(q[:, :, offset:offset + n], keys, values, starts[i]))
                offset += n
            o = torch.cat(outputs, dim=2).transpose(1, 2).reshape(1, total, self.heads * self.head_dim)
            hidden = residual + attn.o_proj(o)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for cache, start, n in zip(caches, starts, lengths):
            cache.length = start + n
        hidden = self.inner.norm(hidden)[0]
        ends = torch.tensor(lengths).cumsum(0)
        if all_logits:
            logits = self.hf.lm_head(hidden)
            return [logits[e - n:e] for e, n in zip(ends.tolist(), lengths)]
        logits = self.hf.lm_head(hidden[ends - 1])
        return list(logits)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int) -> torch.Tensor:
        """q [1, H, n, d] (positions past..past+n-1) against the whole cache [KV, past+n, d]."""
        k, v = keys.unsqueeze(0), values.unsqueeze(0)  # grouped-query heads shared, not copied
        gqa = self.heads != self.kv_heads
        n, total = q.shape[2], keys.shape[1]
        if n == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        mask = torch.arange(total)[None, :] <= (past + torch.arange(n))[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

"""One batched forward pass over any mix of prefill chunks and decode tokens, against the KV pool: the core
of the built-in engine.

A step's new tokens (a whole prompt, a chunk of one, or one decode token per sequence) are flattened into one
`[T, hidden]` batch, so every token-wise op (norms, projections, MLP, lm_head) is one call per layer for the
whole step; q/k/v and gate/up are fused into one matmul each. Attention is one call per layer for the decode
tokens (every decoding sequence at once, cache lengths masked) and one for the prefill chunks (padded to the
longest chunk, causally masked); neither loops over sequences in Python.

The fused weights are built once and the Hugging Face modules' parameters are turned into views of them, so a
weight update copied into the HF model's named parameters (as the engine's weight sync does) is what the next
step computes with. Float32 logits match the HF model's own forward within ~1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model.kv_pool import KVPool


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of several Linear layers and make each layer's parameters views
    of the result: one matmul replaces several, and in-place loads into the layers land in the fused copy."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    offset = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[offset:offset + n], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[offset:offset + n], requires_grad=False)
        offset += n
    return weight, bias


@dataclass
class _Group:
    """The sequences of one attention call: their slots, where their tokens sit in the flat batch, and the
    mask over key positions."""
    token_rows: torch.Tensor      # [tokens] rows of the flat batch, in group order
    pad_index: tuple | None       # (sequence, offset) of each token in the padded [seqs, longest] layout
    slots: torch.Tensor | slice   # which pool slots (a slice when consecutive: a view, no copy)
    bias: torch.Tensor            # [seqs * kv_heads, group_heads * longest, key_len]: 0 attend, -inf not
    seqs: int
    longest: int
    key_len: int


class BatchedDecoder:
    def __init__(self, hf_model, pool: KVPool):
        cfg = hf_model.config
        if cfg.model_type not in ("qwen2", "llama"):
            raise ValueError(f"unsupported architecture {cfg.model_type!r} (qwen2, llama)")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the built-in engine")
        self.hf, self.inner, self.pool = hf_model, hf_model.model, pool
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group_heads = self.heads // self.kv_heads
        self.layers = []
        for layer in self.inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append((layer.input_layernorm, qkv_w, qkv_b, attn.o_proj, layer.post_attention_layernorm,
                                gate_up, mlp.down_proj, mlp.act_fn, attn.scaling))
        positions = torch.arange(pool.slot_len, device=pool.keys.device)[None]
        probe = torch.zeros(1, 1, cfg.hidden_size, dtype=pool.keys.dtype, device=pool.keys.device)
        cos, sin = self.inner.rotary_emb(probe, positions)  # the model's own RoPE (scaling included)
        # rotate_half(x) * sin == x[..., swap] * signed_sin: one gather instead of two slices, a neg and a cat
        half = self.head_dim // 2
        self.swap = torch.cat([torch.arange(half, self.head_dim), torch.arange(half)]).to(probe.device)
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device=probe.device, dtype=sin.dtype)
        self.cos, self.signed_sin = cos[0], sin[0] * sign

    @torch.inference_mode()
    def forward(self, slots: list[int], new_tokens: list[list[int]],
                full_logits: list[bool] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Append `new_tokens[i]` to the sequence in `slots[i]` and run them.

        Returns the logits of each sequence's last new token `[len(slots), vocab]`, and for every i with
        `full_logits[i]` the logits of all its new tokens `[len(new_tokens[i]), vocab]`."""
        pool = self.pool
        lengths = [len(t) for t in new_tokens]
        starts = [pool.lengths[s] for s in slots]
        if any(s + n > pool.slot_len for s, n in zip(starts, lengths)):
            raise ValueError(f"a sequence would exceed the context length {pool.slot_len}")
        device = pool.keys.device
        flat = [t for tokens in new_tokens for t in tokens]
        ids = torch.tensor(flat, dtype=torch.long, device=device)
        positions = torch.tensor([p for s, n in zip(starts, lengths) for p in range(s, s + n)], device=device)
        token_slots = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], device=device)
        ends = torch.tensor(lengths).cumsum(0)
        groups = self._groups(slots, starts, lengths, ends.tolist())
        cos, sin = self.cos[positions][:, None, :], self.signed_sin[positions][:, None, :]
        hidden = F.embedding(ids, self.inner.embed_tokens.weight)
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, positions, token_slots, groups)
        for s, start, n in zip(slots, starts, lengths):
            pool.lengths[s] = start + n
        norm = self.inner.norm
        last = F.rms_norm(hidden[(ends - 1).to(device)], norm.weight.shape, norm.weight, norm.variance_epsilon)
        logits = F.linear(last, self.hf.lm_head.weight)
        full = {}
        for i, wanted in enumerate(full_logits or ()):
            if wanted:
                rows = F.rms_norm(hidden[int(ends[i]) - lengths[i]:int(ends[i])], norm.weight.shape, norm.weight,
                                  norm.variance_epsilon)
                full[i] = F.linear(rows, self.hf.lm_head.weight)
        return logits, full

    def _layer(self, index, layer, hidden, cos, sin, positions, token_slots, groups) -> torch.Tensor:
        norm_in, qkv_w, qkv_b, o_proj, norm_post, gate_up, down, act, scaling = layer
        x = F.rms_norm(hidden, norm_in.weight.shape, norm_in.weight, norm_in.variance_epsilon)
        qkv = F.linear(x, qkv_w, qkv_b).view(x.shape[0], self.heads + 2 * self.kv_heads, self.head_dim)
        rotated = self.heads + self.kv_heads  # RoPE on q and k together: one set of ops
        qk = qkv[:, :rotated]
        qk = torch.addcmul(qk * cos, qk[..., self.swap], sin)
        q, k, v = qk[:, :self.heads], qk[:, self.heads:], qkv[:, rotated:]
        self.pool.keys[index][token_slots, :, positions] = k
        self.pool.values[index][token_slots, :, positions] = v
        if len(groups) == 1:  # every token in one group, in flat order
            out = self._attend(index, q, groups[0], scaling)
        else:
            out = torch.empty(q.shape[0], self.heads * self.head_dim, dtype=q.dtype, device=q.device)
            for group in groups:
                out[group.token_rows] = self._attend(index, q[group.token_rows], group, scaling)
        hidden = hidden + F.linear(out, o_proj.weight, o_proj.bias)
        x = F.rms_norm(hidden, norm_post.weight.shape, norm_post.weight, norm_post.variance_epsilon)
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return hidden + F.linear(act(gate) * up, down.weight, down.bias)

    def _attend(self, index: int, q: torch.Tensor, group: _Group, scaling: float) -> torch.Tensor:
        """softmax(q k^T * scaling + bias) v for one group, as two batched matmuls over (sequence, KV head);
        grouped-query heads share their KV head (a view, not a copy).
        q: [tokens, heads, head_dim] -> [tokens, heads * head_dim]."""
        kv, gh, d, n = self.kv_heads, self.group_heads, self.head_dim, group.seqs
        keys = self.pool.keys[index][group.slots, :, :group.key_len].reshape(n * kv, group.key_len, d)
        values = self.pool.values[index][group.slots, :, :group.key_len].reshape(n * kv, group.key_len, d)
        if group.pad_index is None:  # one token per sequence: the flat rows are the batch
            padded = q.reshape(n * kv, gh, d)
        else:
            padded = q.new_zeros(n, group.longest, self.heads, d)
            padded[group.pad_index] = q
            padded = padded.view(n, group.longest, kv, gh, d).permute(0, 2, 3, 1, 4)
            padded = padded.reshape(n * kv, gh * group.longest, d)
        scores = torch.baddbmm(group.bias, padded, keys.transpose(1, 2), alpha=scaling)
        attended = torch.bmm(torch.softmax(scores, dim=-1), values)  # [n * kv, gh * longest, d]
        if group.pad_index is None:
            return attended.view(n, self.heads * d)
        attended = attended.view(n, kv, gh, group.longest, d).permute(0, 3, 1, 2, 4)
        return attended[group.pad_index].reshape(q.shape[0], self.heads * d)

    def _groups(self, slots, starts, lengths, ends) -> list[_Group]:
        """Decode tokens in one group, prefill chunks in another, each with its key mask."""
        device = self.pool.keys.device
        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefill = [i for i, n in enumerate(lengths) if n > 1]
        groups = []
        for members in (decode, prefill):
            if not members:
                continue
            member_slots = [slots[i] for i in members]
            first = member_slots[0]
            consecutive = member_slots == list(range(first, first + len(members)))
            longest = max(lengths[i] for i in members)
            key_len = max(starts[i] + lengths[i] for i in members)
            rows = [r for i in members for r in range(ends[i] - lengths[i], ends[i])]
            key_pos = torch.arange(key_len, device=device)
            start_t = torch.tensor([starts[i] for i in members], device=device)
            query_pos = start_t[:, None] + torch.arange(longest, device=device)[None, :]  # [seqs, longest]
            mask = key_pos[None, None, :] <= query_pos[:, :, None]                          # [seqs, longest, keys]
            bias = torch.zeros(mask.shape, dtype=self.pool.keys.dtype, device=device).masked_fill_(~mask, float("-inf"))
            bias = bias[:, None, None].expand(-1, self.kv_heads, self.group_heads, -1, -1)
            pad_index = None
            if longest > 1:
                pad_index = (torch.tensor([k for k, i in enumerate(members) for _ in range(lengths[i])], device=device),
                             torch.tensor([j for i in members for j in range(lengths[i])], device=device))
            groups.append(_Group(
                token_rows=torch.tensor(rows, device=device), pad_index=pad_index,
                slots=slice(first, first + len(members)) if consecutive else torch.tensor(member_slots, device=device),
                bias=bias.reshape(len(members) * self.kv_heads, self.group_heads * longest, key_len), seqs=len(members),
                longest=longest, key_len=key_len))
        return groups

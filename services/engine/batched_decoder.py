"""One batched forward pass over any mix of prefill chunks and decode tokens, against the KV pool: the core
of the built-in engine.

A step's new tokens (a whole prompt, a chunk of one, one decode token per sequence, or a decode token and its
speculative drafts) are flattened into one `[T, hidden]` batch, so every token-wise op (norms, projections,
MLP, lm_head) is one call per layer for the whole step; q/k/v and gate/up are fused into one matmul each.
Attention is one call per layer for the decode tokens and short inputs (every decoding sequence at once,
padded to the longest input, cache lengths and causality masked) and one for the prefill chunks (padded to the
longest chunk, causally masked); neither loops over sequences in Python. lm_head runs on just the rows whose
logits are wanted (each sequence's last, all of a sequence whose drafts are verified).

The fused weights are built once and the Hugging Face modules' parameters are turned into views of them, so a
weight update copied into the HF model's named parameters (as the engine's weight sync does) is what the next
step computes with. Float32 logits match the HF model's own forward within ~1e-5.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from services.engine.kv_pool import KVPool

SHORT_INPUT = 32  # inputs of at most this many tokens attend with the decode tokens, longer ones apart


def _fuse_transposed(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of several Linear layers concatenated and stored transposed, `[in, sum(out)]` contiguous,
    with each layer's parameters turned into views of it: one matmul replaces several, and in-place loads into
    the layers (the engine's weight sync) land in the fused copy. Transposed because `x @ w_t` with a
    contiguous `w_t` is 15-20% faster than `F.linear(x, w)` for the few rows of a decode step (measured on
    this project's CPU, MKL, 6 rows x 256 -> 1376)."""
    weight_t = torch.cat([m.weight.detach() for m in linears]).t().contiguous()
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    offset = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight_t[:, offset : offset + n].t(), requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return weight_t, bias


def _matmul(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight_t (+ bias) (+ residual): one BLAS call unless there are both."""
    if bias is None:
        return torch.mm(x, weight_t) if residual is None else torch.addmm(residual, x, weight_t)
    out = torch.addmm(bias, x, weight_t)
    return out if residual is None else residual + out


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


@dataclass
class _Layer:
    """One decoder layer's tensors, fused and transposed (views of them are the HF module's parameters)."""

    input_norm: torch.nn.Module
    qkv_t: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_t: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.nn.Module
    gate_up_t: torch.Tensor
    down_t: torch.Tensor
    down_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    scaling: float
    keys: torch.Tensor  # this layer's KV pool, [slots, kv_heads, slot_len, head_dim] (views) ...
    values: torch.Tensor
    key_rows: torch.Tensor  # ... and the same as [slots * kv_heads * slot_len, head_dim], for the writes
    value_rows: torch.Tensor


@dataclass
class _Group:
    """The sequences of one attention call: their slots, where their tokens sit in the flat batch, and the
    mask over key positions."""

    token_rows: torch.Tensor | None  # [tokens] rows of the flat batch, in group order (None: all, in order)
    pad_index: tuple | None  # (sequence, offset) of each token in the padded [seqs, longest] layout
    # (None: every sequence has `longest` tokens, the flat rows are that layout)
    slots: torch.Tensor | slice  # which pool slots (a slice when consecutive: a view, no copy)
    mask: torch.Tensor  # [seqs, 1, longest, key_len]: 0 attend, -inf not
    bias: torch.Tensor | None  # the same as [seqs * kv_heads, group_heads * longest, key_len] (short inputs)
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
        for p in hf_model.parameters():  # every weight in memory of its own, not a CPU model's safetensors mmap:
            if not p.untyped_storage().resizable():  # the engine frees and re-takes it in place (memory_occupation)
                p.data = p.data.clone()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group_heads = self.heads // self.kv_heads
        self.layers = [self._fused_layer(i, layer) for i, layer in enumerate(self.inner.layers)]
        tied = hf_model.lm_head.weight is self.inner.embed_tokens.weight
        # a tied head stays as it is: the embedding lookup wants rows of the same tensor
        self.lm_head_t = hf_model.lm_head.weight.t() if tied else _fuse_transposed([hf_model.lm_head])[0]
        positions = torch.arange(pool.slot_len, device=pool.keys.device)[None]
        probe = torch.zeros(1, 1, cfg.hidden_size, dtype=pool.keys.dtype, device=pool.keys.device)
        cos, sin = self.inner.rotary_emb(probe, positions)  # the model's own RoPE (scaling included)
        # rotate_half(x) * sin == roll(x, half) * signed_sin: one roll instead of two slices, a neg and a cat
        # (and 2-5x faster than the same swap as an index gather, measured here at 6-2048 tokens)
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device=probe.device, dtype=sin.dtype)
        self.cos, self.signed_sin = cos[0], sin[0] * sign
        self.kv_head_index = torch.arange(self.kv_heads, device=probe.device)
        self.key_positions = torch.arange(pool.slot_len, device=probe.device)

    def _fused_layer(self, index: int, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_t, qkv_b = _fuse_transposed([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up_t, _ = _fuse_transposed([mlp.gate_proj, mlp.up_proj])
        o_t, o_b = _fuse_transposed([attn.o_proj])
        down_t, down_b = _fuse_transposed([mlp.down_proj])
        keys, values = self.pool.keys[index], self.pool.values[index]
        return _Layer(
            layer.input_layernorm,
            qkv_t,
            qkv_b,
            o_t,
            o_b,
            layer.post_attention_layernorm,
            gate_up_t,
            down_t,
            down_b,
            mlp.act_fn,
            attn.scaling,
            keys,
            values,
            keys.view(-1, self.head_dim),
            values.view(-1, self.head_dim),
        )

    @torch.inference_mode()
    def forward(
        self, slots: list[int], new_tokens: list[list[int]], full_logits: list[bool] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Append `new_tokens[i]` to the sequence in `slots[i]` and run them.

        Returns the logits of each sequence's last new token `[len(slots), vocab]`, and for every i with
        `full_logits[i]` the logits of all its new tokens `[len(new_tokens[i]), vocab]`."""
        pool = self.pool
        lengths = [len(t) for t in new_tokens]
        starts = [pool.lengths[s] for s in slots]
        if any(s + n > pool.slot_len for s, n in zip(starts, lengths)):
            raise ValueError(f"a sequence would exceed the context length {pool.slot_len}")
        device = pool.keys.device
        decode_only = all(n == 1 for n in lengths)
        if decode_only:  # the common step: one token per sequence, no per-token expansion
            index = torch.tensor([[t[0] for t in new_tokens], starts, slots], dtype=torch.long, device=device)
        else:
            index = torch.tensor(
                [
                    [t for tokens in new_tokens for t in tokens],
                    [p for s, n in zip(starts, lengths) for p in range(s, s + n)],
                    [s for s, n in zip(slots, lengths) for _ in range(n)],
                ],
                dtype=torch.long,
                device=device,
            )
        ids, positions, token_slots = index
        ends = list(itertools.accumulate(lengths))
        groups = self._groups(slots, starts, lengths, ends, positions)
        # where each token's keys and values go in a layer's flat [slots * kv_heads * slot_len, head_dim] view
        kv_rows = (
            (token_slots[:, None] * self.kv_heads + self.kv_head_index) * pool.slot_len + positions[:, None]
        ).reshape(-1)
        cos, sin = self.cos[positions][:, None, :], self.signed_sin[positions][:, None, :]
        hidden = F.embedding(ids, self.inner.embed_tokens.weight)
        read = self._read_rows(slots, starts, lengths, ends, positions, full_logits)
        for layer in self.layers[:-1]:
            hidden = self._layer(layer, hidden, cos, sin, kv_rows, groups)
        for s, start, n in zip(slots, starts, lengths):
            pool.lengths[s] = start + n
        if read is None:
            hidden = self._layer(self.layers[-1], hidden, cos, sin, kv_rows, groups)
            return self._logits(hidden, lengths, ends, full_logits, decode_only)
        keep, read_groups, read_lengths, read_ends = read
        hidden = self._layer(self.layers[-1], hidden, cos, sin, kv_rows, read_groups, keep)
        return self._logits(hidden, read_lengths, read_ends, full_logits, all(n == 1 for n in read_lengths))

    def _read_rows(self, slots, starts, lengths, ends, positions, full_logits) -> tuple | None:
        """The rows whose last-layer output is read (each sequence's last token; every token of a sequence
        with full_logits), their attention groups, lengths and ends; None when that is every row.

        A prompt chunk's other tokens need only their keys and values from the last layer: its attention,
        o_proj and MLP run on the rows read (the same values for them). On the small preset (4 layers) that is
        ~20% of a prefill's matmul work, on tiny (2 layers) ~40%."""
        wanted = [n if full_logits and full_logits[i] else 1 for i, n in enumerate(lengths)]
        if sum(wanted) == ends[-1]:
            return None
        keep = torch.tensor([r for e, w in zip(ends, wanted) for r in range(e - w, e)], device=positions.device)
        read_starts = [s + n - w for s, n, w in zip(starts, lengths, wanted)]
        read_ends = list(itertools.accumulate(wanted))
        return keep, self._groups(slots, read_starts, wanted, read_ends, positions[keep]), wanted, read_ends

    def _logits(self, hidden, lengths, ends, full_logits, decode_only) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every sequence's last-token logits and, where `full_logits[i]`, all of sequence i's: one norm and
        one lm_head matmul over just the rows wanted."""
        norm = self.inner.norm
        if not any(full_logits or ()):
            last = hidden if decode_only else hidden[torch.tensor(ends, device=hidden.device) - 1]
            return torch.mm(_rms_norm(last, norm), self.lm_head_t), {}
        rows: list[int] = []
        last_at: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        for i, (end, n) in enumerate(zip(ends, lengths)):
            if full_logits[i]:
                spans[i] = (len(rows), n)
                rows.extend(range(end - n, end))
            else:
                rows.append(end - 1)
            last_at.append(len(rows) - 1)
        logits = torch.mm(_rms_norm(hidden[torch.tensor(rows, device=hidden.device)], norm), self.lm_head_t)
        return logits[torch.tensor(last_at, device=hidden.device)], {
            i: logits[o : o + n] for i, (o, n) in spans.items()
        }

    def _layer(
        self, layer: _Layer, hidden, cos, sin, kv_rows, groups, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One decoder layer: keys and values of every row into the pool; the rest for the rows in `keep`
        (all when None), whose queries `groups` describe."""
        x = _rms_norm(hidden, layer.input_norm)
        qkv = _matmul(x, layer.qkv_t, layer.qkv_bias).view(x.shape[0], self.heads + 2 * self.kv_heads, self.head_dim)
        rotated = self.heads + self.kv_heads  # RoPE on q and k together: one set of ops
        qk = qkv[:, :rotated]
        qk = torch.addcmul(qk * cos, torch.roll(qk, self.head_dim // 2, -1), sin)
        q = qk[:, : self.heads]
        layer.key_rows.index_copy_(0, kv_rows, qk[:, self.heads :].reshape(-1, self.head_dim))
        layer.value_rows.index_copy_(0, kv_rows, qkv[:, rotated:].reshape(-1, self.head_dim))
        if keep is not None:
            q, hidden = q[keep], hidden[keep]
        if len(groups) == 1:  # every token in one group, in flat order
            out = self._attend(layer, q, groups[0])
        else:
            out = torch.empty(q.shape[0], self.heads * self.head_dim, dtype=q.dtype, device=q.device)
            for group in groups:
                out[group.token_rows] = self._attend(layer, q[group.token_rows], group)
        hidden = _matmul(out, layer.o_t, layer.o_bias, residual=hidden)
        x = _rms_norm(hidden, layer.post_norm)
        gate, up = torch.mm(x, layer.gate_up_t).chunk(2, dim=-1)
        mlp = layer.act(gate).mul_(up)
        return _matmul(mlp, layer.down_t, layer.down_bias, residual=hidden)

    def _attend(self, layer: _Layer, q: torch.Tensor, group: _Group) -> torch.Tensor:
        """softmax(q k^T * scaling + bias) v for one group, as two batched matmuls over (sequence, KV head);
        grouped-query heads share their KV head (a view, not a copy).
        q: [tokens, heads, head_dim] -> [tokens, heads * head_dim]."""
        if group.bias is None:
            return self._attend_prefill(layer, q, group)
        kv, gh, d, n = self.kv_heads, self.group_heads, self.head_dim, group.seqs
        keys = layer.keys[group.slots, :, : group.key_len].reshape(n * kv, group.key_len, d)
        values = layer.values[group.slots, :, : group.key_len].reshape(n * kv, group.key_len, d)
        L = group.longest
        if group.pad_index is None:  # every sequence has `longest` tokens: the flat rows are already padded
            padded = q.view(n, L, kv, gh, d)
        else:
            padded = q.new_zeros(n, L, self.heads, d)
            padded[group.pad_index] = q
            padded = padded.view(n, L, kv, gh, d)
        padded = padded.permute(0, 2, 3, 1, 4).reshape(n * kv, gh * L, d)  # a view when L == 1
        scores = torch.baddbmm(group.bias, padded, keys.transpose(1, 2), alpha=layer.scaling)
        attended = torch.bmm(torch.softmax(scores, dim=-1), values)  # [n * kv, gh * longest, d]
        attended = attended.view(n, kv, gh, L, d).permute(0, 3, 1, 2, 4)
        if group.pad_index is None:
            return attended.reshape(q.shape[0], self.heads * d)
        return attended[group.pad_index].reshape(q.shape[0], self.heads * d)

    def _attend_prefill(self, layer: _Layer, q: torch.Tensor, group: _Group) -> torch.Tensor:
        """The same for a group of prompt chunks, with torch's fused attention over the padded layout: at a
        prefill's tens of tokens per sequence it takes half the time of the two batched matmuls (measured
        here: 40 chunks of up to 64 tokens, 3.3 vs 6.8 ms a layer), while for a decode step's one to a few
        tokens it is slower."""
        keys = layer.keys[group.slots, :, : group.key_len]  # [seqs, kv_heads, keys, head_dim]: a view
        values = layer.values[group.slots, :, : group.key_len]
        if group.pad_index is None:
            padded = q.view(group.seqs, group.longest, self.heads, self.head_dim)
        else:
            padded = q.new_zeros(group.seqs, group.longest, self.heads, self.head_dim)
            padded[group.pad_index] = q
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), keys, values, attn_mask=group.mask, scale=layer.scaling, enable_gqa=True
        ).transpose(1, 2)
        if group.pad_index is not None:
            out = out[group.pad_index]
        return out.reshape(q.shape[0], self.heads * self.head_dim)

    def _groups(self, slots, starts, lengths, ends, positions: torch.Tensor) -> list[_Group]:
        """Decode tokens and short inputs in one group, prefill chunks in another, each with its key mask. `positions`: every
        token's position (a decode token's is its sequence's start)."""
        device = self.pool.keys.device
        # decode tokens and short inputs (a decode token with its speculative drafts) together: their slots
        # stay consecutive, so their keys are a view of the pool; long prompt chunks apart, so the short
        # ones are not padded to a chunk's length
        short = [i for i, n in enumerate(lengths) if n <= SHORT_INPUT]
        prefill = [i for i, n in enumerate(lengths) if n > SHORT_INPUT]
        groups = []
        for members in (short, prefill):
            if not members:
                continue
            member_slots = [slots[i] for i in members]
            first = member_slots[0]
            consecutive = member_slots == list(range(first, first + len(members)))
            longest = max(lengths[i] for i in members)
            key_len = max(starts[i] + lengths[i] for i in members)
            key_pos = self.key_positions[:key_len]
            if len(members) == len(lengths) and longest == 1:  # a decode-only step: its positions are the starts
                query_pos = positions[:, None]
            else:
                start_t = torch.tensor([starts[i] for i in members], device=device)
                query_pos = start_t[:, None] + self.key_positions[None, :longest]  # [seqs, longest]
            hidden = key_pos > query_pos[:, :, None]  # [seqs, longest, keys]
            mask = torch.zeros(hidden.shape, dtype=self.pool.keys.dtype, device=device)
            mask.masked_fill_(hidden, float("-inf"))
            bias = None
            if longest <= SHORT_INPUT:  # the batched-matmul path wants the mask per (sequence, KV head)
                bias = (
                    mask[:, None, None]
                    .expand(-1, self.kv_heads, self.group_heads, -1, -1)
                    .reshape(len(members) * self.kv_heads, self.group_heads * longest, key_len)
                )
            pad_index = None
            if any(lengths[i] != longest for i in members):  # ragged: scatter into the padded layout
                pad_index = (
                    torch.tensor([k for k, i in enumerate(members) for _ in range(lengths[i])], device=device),
                    torch.tensor([j for i in members for j in range(lengths[i])], device=device),
                )
            rows = None
            if len(members) < len(lengths):  # the other group has tokens too: say which rows are ours
                rows = torch.tensor([r for i in members for r in range(ends[i] - lengths[i], ends[i])], device=device)
            groups.append(
                _Group(
                    token_rows=rows,
                    pad_index=pad_index,
                    slots=slice(first, first + len(members))
                    if consecutive
                    else torch.tensor(member_slots, device=device),
                    mask=mask[:, None],
                    bias=bias,
                    seqs=len(members),
                    longest=longest,
                    key_len=key_len,
                )
            )
        return groups

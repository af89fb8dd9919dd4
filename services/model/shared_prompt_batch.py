"""Samples that share a prompt, packed so that the prompt is run through the model once.

A GRPO group is n responses to one prompt. Right-padded one sample a row (ResponseBatch), the prompt's
tokens go through every layer n times; with short answers to long prompts that is most of the work. Here
the samples of each prompt become one row, the prompt followed by every response:

    row   = prompt p_1..p_P | response 1 | response 2 | ... | response n
    pos   = 0..P-1          | P..P+r_1-1 | P..P+r_2-1 | ...            (each response continues the prompt)
    query t may attend key s  iff  s <= t and (s is in the prompt or s, t are in the same response)

so each response sees exactly what it would see alone (same positions, same keys), and the logits that
predict response token j of sample i (at the last prompt position for j = 0, else at the response's own
token j - 1) equal the padded batch's up to float rounding; gradients flow to the shared prompt from all
n responses, as they do when the prompt is repeated. Only the rows whose logits are wanted go through the
vocabulary projection.

`build_response_batch` packs only when it pays: its cost model counts, per row of length L, L tokens of
dense work (the projections and MLP) plus L^2 / (6 h) token-equivalents of attention (h = hidden size:
a token's dense work is ~24 h^2 flops a layer, a query-key pair's ~4 h), and keeps the padded layout when
that is cheaper (long responses to short prompts, or samples that share nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from services.model.response_batch import ResponseBatch, ragged

PACK_GAIN = 0.8  # pack only when the packed layout costs at most this fraction of the padded one


@dataclass
class SharedPromptBatch:
    input_ids: torch.Tensor  # [R, L] one row per distinct prompt: the prompt, then each response
    position_ids: torch.Tensor  # [R, L]
    segments: torch.Tensor  # [R, L] 0 prompt, k > 0 the k-th response of the row, -1 padding
    rows: torch.Tensor  # [B, T] packed row of sample i
    columns: torch.Tensor  # [B, T] packed position predicting response token j of sample i
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    response_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1.0 on response tokens

    @property
    def token_count(self) -> int:
        return int((self.segments >= 0).sum())

    def to_device(self, device: str) -> "SharedPromptBatch":
        if device == "cpu":
            return self
        return SharedPromptBatch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.position_ids,
                    self.segments,
                    self.rows,
                    self.columns,
                    self.prompt_lengths,
                    self.response_lengths,
                    self.response_ids,
                    self.mask,
                )
            )
        )

    def attention_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, L, L] additive mask (0 where a query may attend a key, the dtype's minimum elsewhere);
        a padding query attends to itself only, so no softmax row is empty."""
        seg = self.segments
        idx = torch.arange(seg.shape[1], device=seg.device)
        causal = idx.view(1, -1, 1) >= idx.view(1, 1, -1)
        keys = seg.unsqueeze(1)
        allowed = causal & (keys >= 0) & ((keys == 0) | (keys == seg.unsqueeze(2)))
        allowed |= torch.eye(seg.shape[1], dtype=torch.bool, device=seg.device)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
        return bias.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)

    def logits(self, model) -> torch.Tensor:
        """[B, T, V] logits predicting each response token."""
        hidden = model.get_decoder()(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            attention_mask=self.attention_bias(model.dtype),
            use_cache=False,
        ).last_hidden_state
        return model.get_output_embeddings()(hidden[self.rows, self.columns])

    def to_ragged(self, values: torch.Tensor) -> list[torch.Tensor]:
        return ragged(values, self.response_lengths)


def _prompt_groups(tokens: Sequence[torch.Tensor], prompt_lengths: list[int]) -> list[list[int]]:
    """Sample indices grouped by identical prompt tokens, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tokens):
        groups.setdefault(tuple(torch.as_tensor(t[: prompt_lengths[i]]).tolist()), []).append(i)
    return list(groups.values())


def _cost(row_lengths: Sequence[int], width: int, hidden_size: int) -> float:
    """Dense work of every position of [rows, width] plus attention among them, in token-equivalents."""
    return len(row_lengths) * (width + width * width / (6.0 * hidden_size))


def build_response_batch(tokens: Sequence[torch.Tensor], prompt_lengths, response_lengths, hidden_size: int = 4096):
    """A SharedPromptBatch when samples share prompts and packing them is cheaper (see the module's cost
    model), else the padded ResponseBatch. Both answer `logits(model)`, `response_ids`, `mask`, `to_ragged`."""
    plain = ResponseBatch.build(tokens, prompt_lengths, response_lengths)
    pls, rls = plain.prompt_lengths.tolist(), plain.response_lengths.tolist()
    groups = _prompt_groups(tokens, pls)
    if len(groups) == len(pls):
        return plain
    packed_lengths = [pls[g[0]] + sum(rls[i] for i in g) for g in groups]
    padded = _cost(pls, plain.input_ids.shape[1], hidden_size)
    if _cost(packed_lengths, max(packed_lengths), hidden_size) > PACK_GAIN * padded:
        return plain
    return _pack(tokens, groups, packed_lengths, plain)


def _pack(tokens, groups: list[list[int]], packed_lengths: list[int], plain: ResponseBatch) -> SharedPromptBatch:
    B, T = plain.response_ids.shape
    width = max(packed_lengths)
    input_ids = torch.zeros((len(groups), width), dtype=torch.long)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    segments = torch.full((len(groups), width), -1, dtype=torch.long)
    rows = torch.zeros((B, T), dtype=torch.long)
    columns = torch.zeros((B, T), dtype=torch.long)
    for r, members in enumerate(groups):
        p = int(plain.prompt_lengths[members[0]])
        input_ids[r, :p] = torch.as_tensor(tokens[members[0]][:p])
        positions[r, :p] = torch.arange(p)
        segments[r, :p] = 0
        start = p
        for k, i in enumerate(members, start=1):
            n = int(plain.response_lengths[i])
            input_ids[r, start : start + n] = torch.as_tensor(tokens[i][p : p + n])
            positions[r, start : start + n] = torch.arange(p, p + n)
            segments[r, start : start + n] = k
            rows[i] = r
            # token 0 is predicted by the prompt's last position, token j by the response's token j - 1
            predicting = [p - 1] + list(range(start, start + n - 1))
            columns[i, : len(predicting)] = torch.tensor(predicting)
            start += n
    return SharedPromptBatch(
        input_ids,
        positions,
        segments,
        rows,
        columns,
        plain.prompt_lengths,
        plain.response_lengths,
        plain.response_ids,
        plain.mask,
    )

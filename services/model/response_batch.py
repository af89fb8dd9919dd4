"""Per-token quantities of responses under a causal LM, for a batch of (prompt + response) samples
of different lengths: what the forward roles write and what the trainer differentiates.

Samples are right-padded into one [B, L] batch with an attention mask. The log-prob of response
token j of sample i is read from the logits at position prompt_length_i + j - 1 (the position that
predicts it), so the results are [B, T] response-aligned (T = longest response) with a mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class ResponseBatch:
    input_ids: torch.Tensor  # [B, L] right-padded prompt + response
    attention_mask: torch.Tensor  # [B, L]
    prompt_lengths: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    response_ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1.0 on response tokens

    @classmethod
    def build(
        cls, tokens: Sequence[torch.Tensor], prompt_lengths, response_lengths, pad_id: int = 0
    ) -> "ResponseBatch":
        prompt_lengths = torch.as_tensor(prompt_lengths, dtype=torch.long)
        response_lengths = torch.as_tensor(response_lengths, dtype=torch.long)
        if not (len(tokens) == len(prompt_lengths) == len(response_lengths)) or not tokens:
            raise ValueError("tokens, prompt_lengths and response_lengths must be non-empty and the same length")
        for i, t in enumerate(tokens):
            if len(t) != int(prompt_lengths[i] + response_lengths[i]) or int(prompt_lengths[i]) < 1:
                raise ValueError(
                    f"sample {i}: {len(t)} tokens != prompt_length {int(prompt_lengths[i])} + "
                    f"response_length {int(response_lengths[i])} (prompt_length >= 1)"
                )
        width = max(len(t) for t in tokens)
        resp_width = max(1, int(response_lengths.max()))
        input_ids = torch.full((len(tokens), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(tokens), width), dtype=torch.long)
        response_ids = torch.full((len(tokens), resp_width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(tokens), resp_width), dtype=torch.float32)
        for i, t in enumerate(tokens):
            t = torch.as_tensor(t, dtype=torch.long)
            p, r = int(prompt_lengths[i]), int(response_lengths[i])
            input_ids[i, : len(t)] = t
            attention[i, : len(t)] = 1
            response_ids[i, :r] = t[p : p + r]
            mask[i, :r] = 1.0
        return cls(input_ids, attention, prompt_lengths, response_lengths, response_ids, mask)

    def to_device(self, device: str) -> "ResponseBatch":
        if device == "cpu":
            return self
        return ResponseBatch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.prompt_lengths,
                    self.response_lengths,
                    self.response_ids,
                    self.mask,
                )
            )
        )

    def response_positions(self) -> torch.Tensor:
        """[B, T] index of the position whose output predicts each response token (clamped on padding)."""
        steps = torch.arange(self.response_ids.shape[1], device=self.input_ids.device).unsqueeze(0)
        return (self.prompt_lengths.unsqueeze(1) - 1 + steps).clamp(max=self.input_ids.shape[1] - 1)

    @property
    def first_response_position(self) -> int:
        """The first position whose output predicts a response token, over the whole batch."""
        return int(self.prompt_lengths.min()) - 1

    def gather_response(self, per_position: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """[B, L - offset, ...] per-position values (positions offset.. of the batch) -> [B, T, ...] at the
        positions predicting response tokens."""
        index = self.response_positions() - offset
        if per_position.dim() == 3:
            index = index.unsqueeze(-1).expand(-1, -1, per_position.shape[-1])
        return torch.gather(per_position, 1, index)

    def to_ragged(self, values: torch.Tensor) -> list[torch.Tensor]:
        return ragged(values, self.response_lengths)

    @property
    def token_count(self) -> int:
        return int(self.attention_mask.sum())

    def logits(self, model) -> torch.Tensor:
        """[B, T, V] logits predicting each response token."""
        # lm_head only from the first position that predicts a response token (the prompts' own logits are not
        # needed): the vocabulary projection and its backward are the largest matmuls of a small model
        start = self.first_response_position
        out = model(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            use_cache=False,
            logits_to_keep=self.input_ids.shape[1] - start,
        )
        return self.gather_response(out.logits, offset=start)


def ragged(values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """[B, T] -> one 1-D tensor per sample, cut to its response length."""
    return [values[i, : int(n)].contiguous() for i, n in enumerate(lengths)]


class ResponseLogits(torch.nn.Module):
    """A causal LM as a module whose forward is `batch.logits(hf)`: what a trainer differentiates. A batch may
    call the decoder and the vocabulary projection separately (SharedPromptBatch); as one module call, a
    wrapper that hooks a module's forward (FSDP's gathering of the sharded parameters) sees the whole of it.
    Its parameters are the HF model's, named `hf.<HF name>`."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    @property
    def config(self):
        return self.hf.config

    def forward(self, batch) -> torch.Tensor:
        return batch.logits(self.hf)


def response_logits(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """[B, T, V] logits predicting each response token of a ResponseBatch or SharedPromptBatch, divided by
    the sampling temperature (so log-probs match what the engine sampled from), in float32. `model`: a causal
    LM or a ResponseLogits."""
    logits = model(batch) if isinstance(model, ResponseLogits) else batch.logits(model)
    # a bfloat16 model's (or autocast's) logits in float32 before the temperature and the log-softmax: bfloat16
    # keeps ~3 significant digits, too few for log-probs that PPO ratios and KL terms compare (a no-op in float32)
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for [B, T, V] logits and [B, T] ids, without materialising the
    full log-softmax twice: logit[token] - logsumexp(logits)."""
    picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits.float(), dim=-1)).float()


@torch.no_grad()
def response_log_probs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] log-probs of the response tokens (0 on padding)."""
    logits = response_logits(model, batch, temperature)
    return token_log_probs(logits, batch.response_ids) * batch.mask

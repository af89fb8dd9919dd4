"""An agent episode's model calls as training samples, token for token.

Every call the agent makes through its episode endpoint (services/rollout/agent_endpoint.py) is a `Turn`: the
prompt ids the engine saw, the ids it generated, their log-probs and the weight version of each. Turns are
strung into chains: a turn continues a chain when its prompt starts with the chain's whole context (its
first prompt, then every output and everything inserted between outputs); what its prompt adds after that
context (the end of the model's turn, tool results, the next user message) goes into the chain with loss
mask 0, its output with loss mask 1. A turn that continues no chain (the agent truncated, summarised or
rewrote the history) starts a new one: the sample is never mis-aligned, its tokens are exactly the ones the
engine saw and produced.

A chain becomes one training sample (an episode's last `rollout.agent_chains` chains, each with the episode's
reward; `untrained` copies pad an episode with fewer, so groups keep their size): tokens = its first prompt + response, where response = every token
after that prompt; loss_mask, rollout_log_probs and token_weight_versions are aligned to the response
(inserted tokens carry log-prob 0 and the version of the output that follows them; they are masked out of
the loss). Under decoupled PPO / TIS each model token keeps the version that produced it, so a weight update
in the middle of an episode is trained correctly (services/algorithms)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Turn:
    prompt_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]
    versions: list[int]  # per output token


@dataclass
class Chain:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extends(self, turn: Turn) -> bool:
        context = self.context
        return len(turn.prompt_ids) >= len(context) and turn.prompt_ids[: len(context)] == context

    def add(self, turn: Turn, inserted: list[int]) -> None:
        version = turn.versions[0] if turn.versions else (self.versions[-1] if self.versions else 0)
        self.response_ids += inserted + turn.output_ids
        self.loss_mask += [0.0] * len(inserted) + [1.0] * len(turn.output_ids)
        self.log_probs += [0.0] * len(inserted) + list(turn.log_probs)
        self.versions += [version] * len(inserted) + list(turn.versions)
        self.turns += 1

    def untrained(self) -> "Chain":
        """A copy that trains on nothing (loss mask 0 everywhere): a row that pads an episode's samples."""
        return Chain(
            list(self.prompt_ids),
            list(self.response_ids),
            [0.0] * len(self.loss_mask),
            list(self.log_probs),
            list(self.versions),
            self.turns,
        )

    @property
    def model_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def begin_version(self) -> int:
        return self.versions[0] if self.versions else 0


def chains(turns: list[Turn]) -> list[Chain]:
    """The turns strung into consistent chains, in the order they began; each turn joins the latest chain it
    continues, or starts a new one."""
    out: list[Chain] = []
    for turn in turns:
        for chain in reversed(out):
            if chain.extends(turn):
                chain.add(turn, turn.prompt_ids[len(chain.context) :])
                break
        else:
            chain = Chain(prompt_ids=list(turn.prompt_ids))
            chain.add(turn, [])
            out.append(chain)
    return out


def episode_columns(position: int, samples: list[Chain], rewards: list[float], step: int) -> dict:
    """A group of episode samples as TransferQueue columns (the registry's ROLLOUT_FIELDS as a plain group's,
    services/run_contract/sample_fields.py; each sample with its own prompt and loss mask)."""
    n = len(samples)
    return {
        "tokens": [torch.tensor(c.prompt_ids + c.response_ids, dtype=torch.int64) for c in samples],
        "prompt_length": torch.tensor([len(c.prompt_ids) for c in samples], dtype=torch.int64),
        "response_length": torch.tensor([len(c.response_ids) for c in samples], dtype=torch.int64),
        "loss_mask": [torch.tensor(c.loss_mask, dtype=torch.float32) for c in samples],
        "rollout_log_probs": [torch.tensor(c.log_probs, dtype=torch.float32) for c in samples],
        "reward": torch.tensor(rewards, dtype=torch.float32),
        "weight_version": torch.tensor([c.begin_version for c in samples], dtype=torch.int64),
        "token_weight_versions": [torch.tensor(c.versions, dtype=torch.int64) for c in samples],
        "prompt_position": torch.full((n,), position, dtype=torch.int64),
        "sample_index": torch.arange(n, dtype=torch.int64),
        "step": torch.full((n,), step, dtype=torch.int64),
    }

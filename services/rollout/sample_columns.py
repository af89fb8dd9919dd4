"""A generated group as the columns of its TransferQueue rows: one row per sample, the prompt's tokens followed by
the response's; the columns are the registry's ROLLOUT_FIELDS, with its dtypes and shapes
(services/run_contract/sample_fields.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.algorithms.overlong import overlong_penalty, truncated
from services.rollout.engine_pool import SampleOutput
from services.run_contract.prompt_source import PromptRecord
from services.run_contract.rollout_settings import RewardShaping


def shaped_rewards(
    rewards: list[float], samples: list[SampleOutput], shaping: RewardShaping, max_new_tokens: int
) -> list[float]:
    """The rewards with DAPO's soft overlong punishment added (services/algorithms/overlong.py), when on."""
    o = shaping.overlong
    if o is None:
        return rewards
    return [
        r + overlong_penalty(len(s.output_ids), max_new_tokens, o.buffer, o.penalty) for r, s in zip(rewards, samples)
    ]


def group_columns(
    position: int,
    prompt_ids: list[int],
    samples: list[SampleOutput],
    rewards: list[float],
    step: int,
    mask_truncated: bool = False,
) -> dict:
    """`mask_truncated`: DAPO's overlong filtering, a sample cut off at its length limit trains on nothing."""
    n = len(samples)
    prompt = torch.tensor(prompt_ids, dtype=torch.int64)
    return {
        "tokens": [torch.cat([prompt, torch.tensor(s.output_ids, dtype=torch.int64)]) for s in samples],
        "prompt_length": torch.full((n,), len(prompt_ids), dtype=torch.int64),
        "response_length": torch.tensor([len(s.output_ids) for s in samples], dtype=torch.int64),
        "loss_mask": [
            torch.full((len(s.output_ids),), 0.0 if mask_truncated and truncated(s.finish_reason) else 1.0)
            for s in samples
        ],
        "rollout_log_probs": [torch.tensor(s.log_probs, dtype=torch.float32) for s in samples],
        "reward": torch.tensor(rewards, dtype=torch.float32),
        "weight_version": torch.tensor([s.begin_version for s in samples], dtype=torch.int64),
        "token_weight_versions": [torch.tensor(s.token_versions(), dtype=torch.int64) for s in samples],
        "prompt_position": torch.full((n,), position, dtype=torch.int64),
        "sample_index": torch.arange(n, dtype=torch.int64),
        "step": torch.full((n,), step, dtype=torch.int64),
    }


@dataclass
class ScoredGroup:
    """A generated and scored group, ready to be written."""

    record: PromptRecord
    columns: dict
    rewards: list[float]
    begin_version: int  # the oldest version any of its samples began under
    tokens: int  # tokens the model generated for it
    resubmits: int = 0  # requests resumed after a weight update aborted them

    @classmethod
    def of_samples(
        cls,
        record,
        prompt_ids: list[int],
        samples: list[SampleOutput],
        rewards: list[float],
        step: int,
        mask_truncated: bool = False,
    ) -> "ScoredGroup":
        return cls(
            record,
            group_columns(record.position, prompt_ids, samples, rewards, step, mask_truncated),
            rewards,
            min(s.begin_version for s in samples),
            sum(len(s.output_ids) for s in samples),
            sum(s.resubmits for s in samples),
        )

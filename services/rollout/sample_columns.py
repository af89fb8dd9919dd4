"""A generated group as the columns of its TransferQueue rows (docs/transferqueue.md, the run's fields): one row
per sample, the prompt's tokens followed by the response's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.rollout.engine_pool import SampleOutput


def group_columns(position: int, prompt_ids: list[int], samples: list[SampleOutput], rewards: list[float],
                  step: int) -> dict:
    n = len(samples)
    prompt = torch.tensor(prompt_ids, dtype=torch.int64)
    return {
        "tokens": [torch.cat([prompt, torch.tensor(s.output_ids, dtype=torch.int64)]) for s in samples],
        "prompt_length": torch.full((n,), len(prompt_ids), dtype=torch.int64),
        "response_length": torch.tensor([len(s.output_ids) for s in samples], dtype=torch.int64),
        "loss_mask": [torch.ones(len(s.output_ids), dtype=torch.float32) for s in samples],
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

    record: object  # PromptRecord
    columns: dict
    rewards: list[float]
    begin_version: int  # the oldest version any of its samples began under
    tokens: int  # tokens the model generated for it
    resubmits: int = 0  # requests resumed after a weight update aborted them

    @classmethod
    def of_samples(cls, record, prompt_ids: list[int], samples: list[SampleOutput], rewards: list[float],
                   step: int) -> "ScoredGroup":
        return cls(record, group_columns(record.position, prompt_ids, samples, rewards, step), rewards,
                   min(s.begin_version for s in samples), sum(len(s.output_ids) for s in samples),
                   sum(s.resubmits for s in samples))

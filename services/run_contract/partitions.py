"""The data contract between roles: partition names and the fields each role writes.

train_<N> holds the samples trained at step N, group_size = n_samples_per_prompt. Per sample:
  rollout   tokens (int64, prompt + response), prompt_length, response_length (int64),
            loss_mask (float32, per response token), rollout_log_probs (float32, per response token),
            reward (float32), weight_version (int64: the version its generation began under),
            token_weight_versions (int64, per response token: the version that produced it),
            prompt_position (int64, the prompt's global position), sample_index (int64, 0..n-1), step (int64)
  actor_fwd log_probs       (float32, per response token)
  reference ref_log_probs   (float32, per response token)
  critic    values          (float32, per response token)
  advantage advantages, returns (float32, per response token)
"""

from __future__ import annotations

PREFIX = "train_"


def partition_name(step: int) -> str:
    return f"{PREFIX}{step}"


def step_of(partition: str) -> int | None:
    if not partition.startswith(PREFIX):
        return None
    try:
        return int(partition[len(PREFIX):])
    except ValueError:
        return None


def sample_id(prompt_position: int, sample_index: int) -> str:
    return f"{prompt_position}:{sample_index}"


SAMPLE_FIELDS = ["tokens", "prompt_length", "response_length"]

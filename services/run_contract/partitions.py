"""The data contract between roles: partition and task names and the fields each role writes.

Every name is scoped by the run: many runs share one TransferQueue, and a run's roles reach only its own
partitions and tasks. <run_id>/train_<N> holds the samples run <run_id> trains at step N, group_size =
RunConfig.group_rows (n_samples_per_prompt, times rollout.agent_chains for an agent's episodes); its tasks are <run_id>/<task> (TransferQueue applies a task named "<scope>/..." only
to partitions named "<scope>/...": docs/transferqueue.md). Per sample:
  rollout   tokens (int64, prompt + response), prompt_length, response_length (int64),
            loss_mask (float32, per response token), rollout_log_probs (float32, per response token),
            reward (float32), weight_version (int64: the version its generation began under),
            token_weight_versions (int64, per response token: the version that produced it),
            prompt_position (int64, the prompt's global position), sample_index (int64, 0..group_rows-1), step (int64)
  actor_fwd log_probs       (float32, per response token)
  reference ref_log_probs   (float32, per response token)
  critic    values          (float32, per response token)
  advantage advantages, returns (float32, per response token)
"""

from __future__ import annotations

PREFIX = "train_"
# the task whose consumption of a row means its sample was trained (the actor's): rows lost before it
# consumed them are generated again (services/rollout/lost_groups.py)
ACTOR_TRAIN_TASK = "actor_train"
SCOPE = "/"  # run ids cannot contain it (RunConfig.name), so "<run_id>/" never prefixes another run's names


def partition_prefix(run_id: str) -> str:
    """What every training partition of the run starts with (for list_partitions)."""
    return f"{run_id}{SCOPE}{PREFIX}"


def partition_name(run_id: str, step: int) -> str:
    return f"{partition_prefix(run_id)}{step}"


def step_of(partition: str) -> int | None:
    """The step of a run's training partition (<run_id>/train_<N>); None for any other name."""
    scope, sep, name = partition.rpartition(SCOPE)
    if not sep or not scope or not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX):])
    except ValueError:
        return None


def task_name(run_id: str, task: str) -> str:
    """The run's own TransferQueue task (e.g. <run_id>/actor_train)."""
    return f"{run_id}{SCOPE}{task}"


def sample_id(prompt_position: int, sample_index: int) -> str:
    return f"{prompt_position}:{sample_index}"


SAMPLE_FIELDS = ["tokens", "prompt_length", "response_length"]

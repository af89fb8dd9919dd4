"""The data contract between roles: partition and task names (the fields of a sample, each role's writes and
reads: services/run_contract/sample_fields.py).

Every name is scoped by the run: many runs share one TransferQueue, and a run's roles reach only its own
partitions and tasks. <run_id>/train_<N> holds the samples run <run_id> trains at step N, group_size =
RunConfig.group_rows (n_samples_per_prompt, times rollout.agent_chains for an agent's episodes); its tasks are <run_id>/<task> (TransferQueue applies a task named "<scope>/..." only
to partitions named "<scope>/...": docs/transferqueue.md)."""

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
        return int(name[len(PREFIX) :])
    except ValueError:
        return None


def task_name(run_id: str, task: str) -> str:
    """The run's own TransferQueue task (e.g. <run_id>/actor_train)."""
    return f"{run_id}{SCOPE}{task}"


def sample_id(prompt_position: int, sample_index: int) -> str:
    return f"{prompt_position}:{sample_index}"

"""Where a run's state lives in Redis: the namespace contract between the roles and the coordinator. The roles keep
theirs under `sluice:<run>:` (services/run_state: the prompt ledger, the trainer's progress and step records, eval
results); the coordinator keeps its own under `<prefix>:run:<run>:` (services/dcs/state.py; `<prefix>` is its
--key-prefix). Deleting a run (`DELETE /v1/runs/<run>`) deletes both, through `run_key_patterns`."""

from __future__ import annotations


def run_key(run_id: str, *parts: str) -> str:
    """A key of the roles' state of the run: `sluice:<run_id>:<part>:...`."""
    return ":".join(("sluice", run_id, *parts))


def coordinator_run_key(prefix: str, run_id: str) -> str:
    """The prefix of every key the coordinator keeps for the run (its weights, cursors, group, syncs, steps)."""
    return f"{prefix}:run:{run_id}"


def run_key_patterns(prefix: str, run_id: str) -> tuple[str, str]:
    """The SCAN patterns of everything kept for the run in Redis: the coordinator's keys and the roles'. (A run id
    is letters, digits and `_.-`, the pattern of RunConfig.name and of the coordinator's routes: no glob character.)"""
    return f"{coordinator_run_key(prefix, run_id)}:*", run_key(run_id, "*")

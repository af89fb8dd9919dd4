"""Run state that roles keep in Redis beside the data plane: the rollout's prompt ledger and the
trainer's progress. Keys live under `sluice:<run_id>:`."""


def run_key(run_id: str, *parts: str) -> str:
    return ":".join(("sluice", run_id, *parts))

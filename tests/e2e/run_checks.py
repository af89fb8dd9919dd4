"""What every whole run must show once it finished (tests/e2e)."""

from __future__ import annotations

import math
import time

import httpx

from services.launch.local_run import LocalRun
from services.run_contract.run_config import RunConfig
from services.run_state.prompt_ledger import skipped_prompts
from services.transferqueue.client.queue import TransferQueue


def finite_numbers(metrics: dict) -> list:
    return [v for v in metrics.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def assert_run_complete(
    lr: LocalRun, run: RunConfig, staleness_bounded: bool = True, engine_urls: list[str] | None = None
) -> dict[int, dict]:
    """`engine_urls`: the engines that must serve the last weights (default: the run's own); the stack's
    token (lr.token), when it has one, is sent to its services."""
    steps = lr.trained_steps()
    assert sorted(steps) == list(range(run.num_steps))
    # every sample of every prompt position trained exactly once: none repeated, none left out but the groups
    # dropped by reward_fallback skip_group, each of which took one spare position (services/run_state/prompt_ledger.py)
    with lr.redis_client() as r:
        skipped = skipped_prompts(r, run.name)
    trained = [i for rec in steps.values() for i in rec["samples"]]
    expected = {
        f"{p}:{k}"
        for p in range(run.num_steps * run.rollout_batch_size + len(skipped))
        if p not in skipped
        for k in range(run.group_rows)
    }
    assert len(trained) == len(set(trained)) and set(trained) == expected
    for rec in steps.values():
        m = rec["metrics"]
        assert len(rec["samples"]) == run.rows_per_step
        # staleness bound: trained at version <= the version generation began under + max_staleness
        violations = sum(n for s, n in m["staleness"].items() if int(s) > run.max_staleness)
        assert m["staleness_violations"] == violations  # reported as measured
        if staleness_bounded:
            assert violations == 0
        assert all(math.isfinite(v) for v in finite_numbers(m)), m
        assert m["tokens"] > 0
    versions = [steps[s]["metrics"]["weight_version"] for s in sorted(steps)]
    assert versions == sorted(set(versions)) and lr.progress().version == versions[-1]
    # every partition of the run was consumed by every task and cleared (the trainer clears one only then, and
    # only after the step's record: the last clear may still be under way when the last record is seen)
    with TransferQueue(lr.tq.controller_address, token=lr.token or None) as tq:
        deadline = time.monotonic() + 30
        while (left := tq.list_partitions(f"{run.name}/")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], [(p.name, p.rows, p.sealed, [(t.task, t.consumed) for t in p.tasks]) for p in left]
    # every engine serves the last published weights
    for url in lr.engine_urls if engine_urls is None else engine_urls:
        auth = {"authorization": f"Bearer {lr.token}"} if lr.token else {}
        assert httpx.get(url + "/weight_version", headers=auth).json()["weight_version"] == str(versions[-1])
    return steps

"""A reward that fails on some samples, against the rollout role with the in-memory fakes (tests/fakes/): the
rollout goes on, the run's reward_fallback is applied, the failures are counted, and under skip_group every
prompt position is either trained once or recorded as skipped. A failure in Sluice's own code still stops it."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from prometheus_client import REGISTRY

from services.rollout import rollout_parts
from services.rollout.rewards import RewardFunction
from services.rollout.scoring import FAILED_GROUPS_LIMIT, RewardBroken
from services.run_contract.partitions import partition_name
from tests.fakes import InMemoryLedger
from tests.rollout.rollout_harness import N, PROMPTS, Rollout, expected_response, make_run

MODULE = "import:tests.rollout.test_reward_fallback"


def fails_on(text: str) -> bool:
    return len(text) % 3 == 0


def flaky(response, fields, prompt):
    """Raises on some responses (fails_on); else the row's label plus one per sample character."""
    if fails_on(response):
        raise ZeroDivisionError("a bug in the user's verifier")
    return float(fields["label"]) + len(response)


def refuses_label_one(response, fields, prompt):
    """Raises on every sample of the prompts with label 1 ("Name a colour.")."""
    if fields["label"] == 1:
        raise KeyError("colour")
    return float(fields["label"]) + len(response)


def label_only(response, fields, prompt):
    return float(fields["label"])


def always_raises(response, fields, prompt):
    raise ValueError("verifier not configured")


async def sleeps(response, fields, prompt):
    await asyncio.sleep(60)


def counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def run_with(model_dir, prompts, reward: str, num_steps: int = 2, groups_per_step: int = 2, **rollout) -> Rollout:
    run = make_run(model_dir, prompts, groups_per_step, num_steps=num_steps, max_staleness=1)
    run = run.model_copy(update={"rollout": run.rollout.model_copy(update={"reward": reward, **rollout})})
    return Rollout(run)


def test_zero_fallback_scores_the_failing_samples_zero_and_goes_on(model_dir, prompts, tokenizer):
    before = counter("sluice_rollout_reward_failures_total", reason="exception")
    r = run_with(model_dir, prompts, f"{MODULE}:flaky").go()

    groups = r.groups()
    assert sorted(groups) == [0, 1, 2, 3]  # every group written, none dropped
    failed = 0
    for position, rows in groups.items():
        for k, row in enumerate(rows):
            _, response = expected_response(position, k)
            text = tokenizer.decode(response, skip_special_tokens=True)
            expected = 0.0 if fails_on(text) else position % len(PROMPTS) + len(text)
            failed += fails_on(text)
            assert float(row["reward"]) == expected
    assert 0 < failed < len(groups) * N  # the reward failed on some samples, not all
    assert counter("sluice_rollout_reward_failures_total", reason="exception") - before == failed
    status = r.service.status.snapshot()
    assert status["reward_failures"] == {"exception": failed, "timeout": 0} and status["skipped_groups"] == 0


def test_skip_group_replaces_the_prompt_and_keeps_every_position_once(model_dir, prompts):
    before = counter("sluice_rollout_skipped_groups_total")
    r = run_with(model_dir, prompts, f"{MODULE}:refuses_label_one", reward_fallback="skip_group").go()

    # slot 1 held prompt 1 (label 1): dropped; spare 4 is row 1 again: dropped; spare 5 (row 2) took the slot
    assert r.ledger.replaced == {1: 5} and sorted(r.ledger.skipped) == [1, 4]
    assert "KeyError" in r.ledger.skipped[1]
    groups = r.groups()
    assert sorted(groups) == [0, 2, 3, 5]
    assert {p: rows[0]["partition"] for p, rows in groups.items()} == {
        0: partition_name("r", 0),
        5: partition_name("r", 0),
        2: partition_name("r", 1),
        3: partition_name("r", 1),
    }
    trained = {(p, int(row["sample_index"])) for p, rows in groups.items() for row in rows}
    assert len(trained) == sum(len(rows) for rows in groups.values()) == 4 * N  # no sample twice
    # exactly once: every position below slots + spares used is trained or skipped, never both
    assert set(groups) | set(r.ledger.skipped) == set(range(4 + 2)) and not set(groups) & set(r.ledger.skipped)
    assert all(r.sealed(step) for step in range(2)) and r.ledger.frontier == 4
    assert counter("sluice_rollout_skipped_groups_total") - before == 2


def test_a_restarted_rollout_counts_a_spare_prompts_rows_for_its_slot(model_dir, prompts):
    """The previous rollout gave slot 1 spare prompt 5 and wrote it, but died before marking slot 1."""
    ledger = InMemoryLedger(frontier=1, steps={0: {0}})
    ledger.replaced, ledger.skipped = {1: 5}, {1: "KeyError", 4: "KeyError"}
    r = run_with(model_dir, prompts, f"{MODULE}:refuses_label_one", reward_fallback="skip_group")
    r.ledger = ledger
    r.plane.create_partition("r/train_0", group_size=N)
    for position in (0, 5):
        r.plane.put("r/train_0", {"prompt_position": torch.tensor([position] * N), "sample_index": torch.arange(N)})
    r.go()

    assert sorted(r.begun_under()) == [2, 3]  # slot 1 is done: its spare's rows were found
    assert r.ledger.marks[:2] == [0, 1] and r.ledger.frontier == 4 and r.sealed(0)


def test_groups_whose_samples_all_score_the_same_are_counted(model_dir, prompts, caplog):
    before = counter("sluice_rollout_zero_variance_groups_total")
    with caplog.at_level(logging.WARNING, logger="services.rollout.scoring"):
        r = run_with(model_dir, prompts, f"{MODULE}:label_only").go()

    assert len(r.groups()) == 4
    assert counter("sluice_rollout_zero_variance_groups_total") - before == 4
    assert r.service.status.snapshot()["zero_variance_groups"] == 4
    warned = [rec.zero_variance_groups for rec in caplog.records if rec.getMessage().startswith("zero-variance")]
    assert warned == [1, 2, 4]  # warned at the 1st, 2nd and 4th, not at every group


def test_a_reward_that_times_out_is_counted_as_a_timeout(model_dir, prompts):
    before = counter("sluice_rollout_reward_failures_total", reason="timeout")
    r = run_with(model_dir, prompts, f"{MODULE}:sleeps", num_steps=1, groups_per_step=1, reward_timeout_s=0.01).go()

    assert [float(row["reward"]) for row in r.groups()[0]] == [0.0] * N
    assert counter("sluice_rollout_reward_failures_total", reason="timeout") - before == N


def test_a_reward_that_always_fails_stops_the_rollout_loudly(model_dir, prompts):
    r = run_with(model_dir, prompts, f"{MODULE}:always_raises", num_steps=FAILED_GROUPS_LIMIT)
    with pytest.raises(RewardBroken, match="verifier not configured"):
        r.go()


class BuggyReward(RewardFunction):
    """Stands in for a bug in Sluice's own reward code: an exception that is not a RewardError."""

    async def score(self, record, response):
        raise AttributeError("'NoneType' object has no attribute 'fields'")


def test_a_bug_in_sluices_own_code_is_not_swallowed(model_dir, prompts, monkeypatch):
    monkeypatch.setattr(rollout_parts, "build_reward", lambda *a, **k: BuggyReward())
    r = run_with(model_dir, prompts, f"{MODULE}:flaky")
    with pytest.raises(AttributeError, match="NoneType"):
        r.go()
    assert not any(p.rows for p in r.plane.partitions.values())  # nothing was written

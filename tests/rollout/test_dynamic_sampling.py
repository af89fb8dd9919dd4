"""Dynamic sampling (rollout.filter_groups) against the rollout role with the in-memory fakes (tests/fakes/): a
filtered group is not written, its slot takes the next spare prompt, every step still gets its groups, every
prompt position is written once or recorded as dropped (never both), each filtered group is counted for its
step; rewards that never vary fail the run at max_filter_ratio instead of generating for ever."""

from __future__ import annotations

import pytest

from services.algorithms.group_filter import reward_std
from services.rollout.group_filtering import FilteredTooMuch
from tests.rollout.test_reward_fallback import counter, run_with

MODULE = "import:tests.rollout.test_dynamic_sampling"


def only_label_one_varies(response, fields, prompt):
    """Label 1's samples score their length; the other prompts' samples all score 0 (zero variance)."""
    return float(len(response)) if fields["label"] == 1 else 0.0


def test_filtered_groups_are_replaced_counted_and_never_trained(model_dir, prompts):
    before = counter("sluice_rollout_filtered_groups_total")
    r = run_with(model_dir, prompts, f"{MODULE}:only_label_one_varies", filter_groups="zero_variance").go()

    groups = r.groups()
    assert len(groups) == 4 and all(r.sealed(step) for step in range(2))  # 2 steps x 2 groups, all kept
    for rows in groups.values():  # every written group teaches something
        assert reward_std([float(row["reward"]) for row in rows]) > 0
    filtered = {p: why for p, why in r.ledger.skipped.items() if why.startswith("filter_groups zero_variance")}
    assert filtered and filtered == r.ledger.skipped  # dropped only by the filter, each with its reason
    assert sum(r.ledger.filtered_by_step.values()) == len(filtered)  # counted for their steps
    # exactly once: every position below the slots + spares used is written or dropped, never both
    assert set(groups) | set(filtered) == set(range(4 + len(filtered))) and not set(groups) & set(filtered)
    assert r.service.status.snapshot()["filtered_groups"] == len(filtered)
    assert counter("sluice_rollout_filtered_groups_total") - before == len(filtered)


def label_only(response, fields, prompt):
    return float(fields["label"])


def test_rewards_that_never_vary_fail_the_run_at_the_cap(model_dir, prompts):
    # 2 groups a step, max_filter_ratio 0.5: f / (f + 2) > 0.5 from the 3rd filtered group of a step on
    r = run_with(model_dir, prompts, f"{MODULE}:label_only", filter_groups="zero_variance", max_filter_ratio=0.5)
    with pytest.raises(FilteredTooMuch, match=r"groups of step \d were filtered by filter_groups zero_variance"):
        r.go()
    assert r.groups() == {}  # nothing was written
    assert max(r.ledger.filtered_by_step.values()) >= 3  # (groups filtered at once may pass the cap together)

"""DAPO's overlong handling in the rollout role, against the in-memory fakes (tests/fakes/engines.py: sample s has
3 + s % 4 tokens, cut at max_new_tokens with finish "length"): the soft punishment is added to each sample's
reward by its length, and with overlong_filter a cut-off sample is written with an all-zero loss mask."""

from __future__ import annotations

from services.run_contract.rollout_settings import RewardShaping
from tests.fakes.engines import sample_length
from tests.rollout.rollout_harness import PROMPTS, Rollout, make_run

MAX_NEW = 5


def test_cut_off_samples_are_punished_by_length_and_masked_out(model_dir, prompts, tokenizer):
    run = make_run(model_dir, prompts, num_steps=2, max_staleness=1)
    shaping = RewardShaping(overlong={"buffer": 2, "penalty": 1.0}, overlong_filter=True)
    run = run.model_copy(
        update={"rollout": run.rollout.model_copy(update={"max_new_tokens": MAX_NEW}), "reward_shaping": shaping}
    )
    r = Rollout(run).go()
    seen_cut = seen_whole = 0
    for position, rows in r.groups().items():
        for row in rows:
            seed = position * 4099 + int(row["sample_index"])
            length = min(sample_length(seed), MAX_NEW)
            assert int(row["response_length"]) == length
            text = tokenizer.decode(row["tokens"][-length:].tolist(), skip_special_tokens=True)
            base = float(position % len(PROMPTS)) + len(text) / 1000  # the harness's reward (rollout_harness.score)
            penalty = {3: 0.0, 4: -0.5, 5: -1.0}[length]  # (L_max - L_cache - |y|) / L_cache, L_max 5, L_cache 2
            assert float(row["reward"]) == pytest_approx(base + penalty)
            cut = sample_length(seed) > MAX_NEW
            assert row["loss_mask"].tolist() == [0.0 if cut else 1.0] * length
            seen_cut += cut
            seen_whole += not cut
    assert seen_cut and seen_whole


def pytest_approx(value: float):
    import pytest

    return pytest.approx(value, abs=1e-5)

"""A prompt's group in TransferQueue: n_samples_per_prompt rows, or n x rollout.agent_chains when an agent writes
each episode as several rows; the step's and the global batch's sizes are checked against it."""

import pytest
from pydantic import ValidationError

from services.run_contract.run_config import RunConfig

AGENT = {"agent": "import:my_agents:solve"}


def test_an_agents_episodes_are_chains_rows_each_and_a_plain_run_ignores_the_setting():
    run = RunConfig(
        name="r",
        model="m",
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=16,
        rollout={**AGENT, "agent_chains": 2},
    )
    assert (run.chains_per_episode, run.group_rows, run.rows_per_step) == (2, 8, 16)
    plain = RunConfig(
        name="r",
        model="m",
        n_samples_per_prompt=4,
        rollout_batch_size=2,
        global_batch_size=8,
        rollout={"agent_chains": 2},
    )
    assert (plain.chains_per_episode, plain.group_rows, plain.rows_per_step) == (1, 4, 8)


def test_a_global_batch_that_splits_an_episodes_group_is_refused_naming_the_setting():
    with pytest.raises(ValidationError, match="agent_chains"):
        RunConfig(
            name="r",
            model="m",
            n_samples_per_prompt=4,
            rollout_batch_size=2,
            global_batch_size=4,
            rollout={**AGENT, "agent_chains": 2},
        )
    with pytest.raises(ValidationError, match="agent_chains"):
        RunConfig(
            name="r",
            model="m",
            n_samples_per_prompt=4,
            rollout_batch_size=2,
            global_batch_size=8,
            rollout={**AGENT, "agent_chains": 3},
        )

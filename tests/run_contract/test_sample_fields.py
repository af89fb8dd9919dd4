"""The sample-field registry (services/run_contract/sample_fields.py) against what the roles write and read: the
rollout's columns are exactly its set with the declared dtypes and shapes, every read of a run names only fields
the run's producers write, and docs/services.md shows the registry's table."""

from __future__ import annotations

import pathlib

import pytest
import torch

from services.advantage.service import AdvantageService
from services.advantage.config import AdvantageConfig
from services.rollout.engine_pool import SampleOutput
from services.rollout.episodes import Turn, chains, episode_columns
from services.rollout.sample_columns import group_columns
from services.run_contract.run_config import RunConfig
from services.run_contract.sample_fields import (
    BY_NAME,
    FIELDS,
    ROLLOUT_FIELDS,
    column_problems,
    consumers,
    fields_table,
    producers,
    writes,
    written_fields,
)
from services.role.role_service import RoleStatus
from services.transferqueue.codec import Batch

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "services.md"
SIZES = dict(
    name="r", model="/m", n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4, micro_batch_size=2
)
CONFIGS = {
    "grpo": {},
    "ppo with critic": {"estimator": "ppo"},
    "decoupled": {"decoupled": True},
    "tis": {"tis_clip": 2.0},
    "reference, KL as a loss term": {"kl_coef": 0.1},
    "reference, KL in the reward": {"kl_coef": 0.1, "kl_in_reward": True},
    "everything": {"estimator": "ppo", "decoupled": True, "kl_coef": 0.1, "kl_in_reward": True},
    "reinforce_pp, decoupled, KL loss": {"estimator": "reinforce_pp", "decoupled": True, "kl_coef": 0.1},
}


def _samples() -> list[SampleOutput]:
    return [
        SampleOutput([7, 8, 9], [-0.1, -0.2, -0.3], [(2, 0, 1), (3, 1, 3)], "stop"),
        SampleOutput([5], [-1.0], [(3, 0, 1)], "length"),
    ]


def test_a_plain_groups_columns_are_exactly_the_rollout_set_as_declared():
    for mask_truncated in (False, True):
        columns = group_columns(4, [1, 2], _samples(), [1.0, 0.0], step=1, mask_truncated=mask_truncated)
        assert tuple(columns) == ROLLOUT_FIELDS
        assert column_problems(columns) == []


def test_an_agents_episode_columns_are_exactly_the_rollout_set_as_declared():
    turns = [Turn([1, 2], [3, 4], [-0.5, -0.6], [1, 1]), Turn([1, 2, 3, 4, 9], [5], [-0.7], [2])]
    one = chains(turns)[0]
    columns = episode_columns(3, [one, one.untrained()], [1.0, 1.0], step=0)
    assert tuple(columns) == ROLLOUT_FIELDS
    assert column_problems(columns) == []


def test_the_column_check_names_each_disagreement():
    columns = group_columns(0, [1, 2], _samples(), [1.0, 0.0], step=0)
    columns["reward"] = columns["reward"].double()
    columns["loss_mask"] = [m[:-1] for m in columns["loss_mask"]]
    columns["tokens"] = columns["tokens"][:1]
    columns["extra"] = torch.zeros(2)
    problems = column_problems(columns)
    assert "extra: not a sample field" in problems
    assert any(p.startswith("reward: float64 (2,), the registry says float32") for p in problems)
    assert any(p.startswith("loss_mask[0]: float32 (2,), the registry says float32 (3,)") for p in problems)
    assert "tokens: not a list of 2 tensors (one per sample)" in problems
    assert len(problems) == 5


def test_the_registry_names_each_field_once_with_a_known_writer_and_dtype():
    assert len(BY_NAME) == len(FIELDS)
    assert {f.writer for f in FIELDS} == {"rollout", "actor_fwd", "reference", "critic", "advantage"}
    assert {f.dtype for f in FIELDS} <= {"int64", "float32"}


@pytest.mark.parametrize("algorithm", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_read_of_a_run_names_only_fields_its_producers_write(algorithm):
    run = RunConfig(**SIZES, algorithm=algorithm)
    written = written_fields(run)
    for reader, fields in consumers(run).items():
        assert set(fields) <= written, (reader, set(fields) - written)
        assert len(set(fields)) == len(fields), reader
        assert not set(fields) & set(producers(run).get(reader, ())), f"{reader} would wait on its own writes"
    writers = [w for fields in producers(run).values() for w in fields]
    assert len(writers) == len(set(writers))  # no field has two writers


def test_each_optional_role_produces_and_is_read_only_in_the_runs_that_use_it():
    grpo = RunConfig(**SIZES)
    assert set(producers(grpo)) == {"rollout", "advantage"}
    assert {"values", "log_probs", "ref_log_probs"}.isdisjoint(written_fields(grpo))
    ppo = RunConfig(**SIZES, algorithm={"estimator": "ppo"})
    assert "values" in consumers(ppo)["advantage"] and "returns" in consumers(ppo)["critic_train"]
    decoupled = RunConfig(**SIZES, algorithm={"decoupled": True, "kl_coef": 0.1, "kl_in_reward": True})
    assert {"log_probs", "ref_log_probs"} <= set(consumers(decoupled)["advantage"])
    assert "ref_log_probs" not in consumers(decoupled)["actor_train"]  # the KL is in the reward, not the loss
    kl_loss = RunConfig(**SIZES, algorithm={"kl_coef": 0.1})
    assert "ref_log_probs" in consumers(kl_loss)["actor_train"]
    assert "rollout_log_probs" in consumers(kl_loss)["actor_train"] and "log_probs" not in written_fields(kl_loss)


def test_the_advantage_role_writes_exactly_its_registry_set():
    run = RunConfig(**SIZES, algorithm={"estimator": "ppo"})
    lengths = [3, 1, 2, 2]
    batch = Batch(
        "r/train_0",
        [0, 1, 2, 3],
        {
            "reward": torch.tensor([1.0, 0.0, 0.5, 0.0]),
            "response_length": torch.tensor(lengths),
            "loss_mask": [torch.ones(n) for n in lengths],
            "values": [torch.zeros(n) for n in lengths],
        },
    )
    out = AdvantageService(AdvantageConfig(), RoleStatus("advantage")).compute(batch, run)
    assert tuple(out) == writes("advantage")
    assert (
        column_problems({**out, "prompt_length": torch.tensor([1] * 4), "response_length": torch.tensor(lengths)}) == []
    )


def test_the_services_doc_shows_the_registrys_table():
    assert fields_table() in DOC.read_text(), (
        "docs/services.md's table of sample fields is stale: paste `python -m services.run_contract.sample_fields`"
    )

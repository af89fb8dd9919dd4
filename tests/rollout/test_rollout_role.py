"""The rollout role against in-memory fakes of its seams (tests/rollout/rollout_harness.py): what it writes,
admission under the staleness bound, partial rollout across a weight update, restart."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.service import RECOVER_TASK
from services.run_contract.partitions import ACTOR_TRAIN_TASK, partition_name, task_name
from services.run_state.trainer_progress import TrainerProgress
from tests.fakes import InMemoryLedger
from tests.fakes.engines import log_prob
from tests.rollout.rollout_harness import N, PROMPTS, Rollout, expected_response, make_run


def test_writes_every_group_once_with_the_fields_of_its_samples(model_dir, prompts, tokenizer):
    r = Rollout(make_run(model_dir, prompts, num_steps=2, max_staleness=1)).go()

    groups = r.groups()
    assert sorted(groups) == [0, 1, 2, 3]  # every group of the run, none twice
    begun = r.begun_under()
    for position, rows in groups.items():
        assert [int(row["sample_index"]) for row in rows] == list(range(N))
        prompt = tokenizer.encode(PROMPTS[position % len(PROMPTS)], add_special_tokens=False)
        version = begun[position]
        for k, row in enumerate(rows):
            seed, response = expected_response(position, k)
            assert row["partition"] == partition_name("r", position // 2) and int(row["step"]) == position // 2
            assert row["tokens"].tolist() == prompt + response
            assert int(row["prompt_length"]) == len(prompt) and int(row["response_length"]) == len(response)
            assert row["loss_mask"].tolist() == [1.0] * len(response)
            assert int(row["weight_version"]) == version
            assert row["token_weight_versions"].tolist() == [version] * len(response)
            torch.testing.assert_close(
                row["rollout_log_probs"], torch.tensor([log_prob(version, j) for j in range(len(response))])
            )
            text = tokenizer.decode(response, skip_special_tokens=True)
            assert float(row["reward"]) == pytest.approx(position % len(PROMPTS) + len(text) / 1000)
    assert all(r.sealed(step) for step in range(2))
    # one request per group: its samples together, each the group's prompt
    assert sorted(int(q.rids[0].split("-")[1]) for q in r.engines.requests) == [0, 1, 2, 3]
    assert all(
        q.inputs == [q.inputs[0]] * N and len({rid.rsplit("-", 1)[0] for rid in q.rids}) == 1
        for q in r.engines.requests
    )
    assert (r.ledger.frontier, r.ledger.written, sorted(r.ledger.marks)) == (4, set(), [0, 1, 2, 3])
    membership = r.memberships[0]
    assert membership.registration.role == "rollout" and sorted(membership.steps) == [0, 0, 1, 1]
    assert membership.closed and all(c.closed for c in r.engines.clients)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_admission_never_starts_a_group_beyond_the_staleness_bound(model_dir, prompts, max_staleness):
    r = Rollout(make_run(model_dir, prompts, num_steps=4, max_staleness=max_staleness)).go()

    begun = r.begun_under()
    assert sorted(begun) == list(range(8)) and sorted(r.groups()) == list(range(8))
    for position, version in begun.items():
        assert position // 2 <= version + max_staleness  # step N is trained at version N
    step_one = {begun[2], begun[3]}
    if max_staleness == 0:
        assert all(version == position // 2 for position, version in begun.items())  # on-policy
    else:
        assert step_one == {0}  # ran ahead: step 1 generated before step 0 was trained


def test_a_weight_update_mid_generation_resumes_the_samples_under_the_new_version(model_dir, prompts, tokenizer):
    r = Rollout(make_run(model_dir, prompts, groups_per_step=1, num_steps=1, max_staleness=0))
    r.engines.abort_next(after_tokens=2)
    r.go()

    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    first, resumed = r.engines.requests
    assert (first.version, resumed.version) == (0, 1)
    rows = r.plane.partitions["r/train_0"].rows
    for k, row in enumerate(rows):
        seed, response = expected_response(0, k)
        assert resumed.inputs[k] == prompt + response[:2]  # prompt + the partial output, continued
        assert row["tokens"].tolist() == prompt + response
        assert int(row["weight_version"]) == 0  # the version its generation began under
        assert row["token_weight_versions"].tolist() == [0, 0] + [1] * (len(response) - 2)
        torch.testing.assert_close(
            row["rollout_log_probs"],
            torch.tensor([log_prob(0, 0), log_prob(0, 1)] + [log_prob(1, j) for j in range(2, len(response))]),
        )
    assert r.pools[0].resubmits == N


def test_a_restarted_rollout_neither_skips_nor_repeats_a_group(model_dir, prompts):
    """The previous rollout wrote groups 0 and 1 of step 0 but died before marking group 1 in the ledger."""
    r = Rollout(
        make_run(model_dir, prompts, num_steps=2, max_staleness=1), ledger=InMemoryLedger(frontier=1, steps={0: {0}})
    )
    r.plane.create_partition("r/train_0", group_size=N)
    for position in (0, 1):
        r.plane.put("r/train_0", {"prompt_position": torch.tensor([position] * N), "sample_index": torch.arange(N)})
    r.go()

    assert sorted(r.begun_under()) == [2, 3]  # only the groups not yet written were generated
    assert r.sealed(0) and len(r.plane.partitions["r/train_0"].rows) == 2 * N  # recovery sealed step 0 as it was
    assert sorted({int(row["prompt_position"]) for row in r.plane.partitions["r/train_1"].rows}) == [2, 3]
    assert r.plane.tasks["r/" + RECOVER_TASK] == ["prompt_position"] and not r.plane.leases  # its read was released
    assert r.ledger.frontier == 4 and r.ledger.marks[:2] == [0, 1]  # group 1 marked from the partition first


def test_groups_lost_before_the_trainer_consumed_them_are_generated_again(model_dir, prompts):
    r = Rollout(make_run(model_dir, prompts, num_steps=2, max_staleness=1))
    actor = task_name("r", ACTOR_TRAIN_TASK)
    r.plane.register_task(actor, ["tokens"], group_size=N)

    async def trainer():  # as the harness's, consuming each step through the actor's task
        for step in range(2):
            name = partition_name("r", step)
            while not r.sealed(step):
                await asyncio.sleep(0.005)
            if step == 0:
                r.plane.lose(name, [2])  # group 1, before the trainer consumed it: unsealed until replaced
                while not r.sealed(step):
                    await asyncio.sleep(0.005)
            r.plane.ack(r.plane.claim(name, actor, 2 * N))
            if step == 1:
                r.plane.lose(name, [0])  # consumed already: nothing to generate again, only sealed again
                while not r.sealed(step):
                    await asyncio.sleep(0.005)
            r.engines.set_version(step + 1)
            r.progress.value = TrainerProgress(next_step=step + 1, version=step + 1)

    r.play_trainer = trainer
    r.go()

    first = r.plane.partitions[partition_name("r", 0)]
    positions = [int(row["prompt_position"]) for row in first.rows]
    assert len(positions) == 6 and positions[4:] == [positions[2]] * 2  # the lost group, written again
    trained = sorted(positions[row] for row in r.plane.acked_rows(partition_name("r", 0), actor))
    assert trained == [0, 0, 1, 1]  # every slot's group trained once
    assert len(r.plane.partitions[partition_name("r", 1)].rows) == 4 and r.sealed(1)
    assert sorted(r.ledger.marks) == sorted([0, 1, 2, 3, positions[2]])


def test_groups_lost_under_the_trainers_lease_are_generated_again_only_if_it_gives_them_back(model_dir, prompts):
    r = Rollout(make_run(model_dir, prompts, num_steps=2, max_staleness=1))
    actor = task_name("r", ACTOR_TRAIN_TASK)
    r.plane.register_task(actor, ["tokens"], group_size=N)

    async def trainer():
        for step in range(2):
            name = partition_name("r", step)
            while not r.sealed(step):
                await asyncio.sleep(0.005)
            held = r.plane.claim(name, actor, 2 * N)
            r.plane.lose(name, [2])  # group 1, which the trainer holds (and, at step 0, has read)
            await asyncio.sleep(0.1)  # the rollout's checks look at the loss meanwhile
            if step == 0:
                r.plane.ack(held)  # trained: nothing to generate again
            else:
                r.plane.release(held)  # given back unread: lost now, generated again
                await asyncio.sleep(0.01)
                while not r.sealed(step):
                    await asyncio.sleep(0.005)
                r.plane.ack(r.plane.claim(name, actor, 2 * N))
            r.engines.set_version(step + 1)
            r.progress.value = TrainerProgress(next_step=step + 1, version=step + 1)

    r.play_trainer = trainer
    r.go()

    assert len(r.plane.partitions[partition_name("r", 0)].rows) == 2 * N and r.sealed(0)
    second = r.plane.partitions[partition_name("r", 1)]
    positions = [int(row["prompt_position"]) for row in second.rows]
    assert len(positions) == 3 * N and positions[2 * N :] == [positions[N]] * N  # group 1, written again
    trained = sorted(positions[row] for row in r.plane.acked_rows(partition_name("r", 1), actor))
    assert trained == sorted([positions[0]] * N + [positions[N]] * N)  # each slot's group trained once

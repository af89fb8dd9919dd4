"""One prompt group, from its slot to its partition (the rollout's admission starts one per slot: service.py):

prepare     the slot's prompt (a spare one if the slot's group was dropped), encoded; its step's partition
generate    n samples in one request (prefilled once), or the agent's episodes
score       the reward (its fallback when it fails: scoring.py); a dropped group's slot takes a spare prompt
write       put into train_<step> (beside groups finishing meanwhile: put_coalescing.py), mark it in the
            ledger; the step's last group seals the partition
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Histogram

from services.rollout.config import RolloutConfig
from services.rollout.rollout_parts import RolloutParts
from services.rollout.sample_columns import ScoredGroup, shaped_rewards
from services.role.role_service import RoleStatus
from services.role.session import RunSession
from services.run_contract.partitions import partition_name
from services.run_contract.prompt_source import PromptRecord
from services.run_state.seams import Membership
from services.runtime.spans import span

log = logging.getLogger(__name__)
GROUPS = Counter("sluice_rollout_groups_total", "prompt groups written to TransferQueue")
SAMPLES_TOKENS = Counter("sluice_rollout_response_tokens_total", "response tokens generated")
RESUBMITS = Counter("sluice_rollout_resubmits_total", "requests resumed after a weight update aborted them")
REWARD = Histogram("sluice_rollout_reward", "sample rewards", buckets=(-1, 0, 0.25, 0.5, 0.75, 1, 2))


class GroupWriter:
    def __init__(
        self,
        config: RolloutConfig,
        status: RoleStatus,
        session: RunSession,
        parts: RolloutParts,
        memberships: list[Membership],
    ):
        self.config, self.status, self.parts, self.memberships = config, status, parts, memberships
        self.run, self.tq, self.ledger = session.run, session.atq, session.ledger
        self.source_rewards = session.source_rewards  # reward per data source and step, for tracking
        self.groups_per_step = self.run.rollout_batch_size
        self.total_groups = self.run.num_steps * self.groups_per_step
        self.replaced: dict[int, int] = {}  # slot -> the spare prompt position it holds (skip_group)
        self._prepared: dict[int, tuple[PromptRecord, list[int]]] = {}  # prompt position -> record, its ids
        self._partitions: set[int] = set()

    async def prepare(self, slot: int) -> tuple[PromptRecord, list[int]]:
        """The slot's prompt, encoded, and its step's partition, made once (ahead of admission when the
        rollout waits for it)."""
        position = self.replaced.get(slot, slot)
        if position not in self._prepared:
            record = self.parts.source.record(position)
            self._prepared[position] = (record, self.parts.encode(record.prompt))
        await self._ensure_partition(slot // self.groups_per_step)
        return self._prepared[position]

    async def _scored_group(self, slot: int, step: int) -> ScoredGroup:
        """The slot's prompt, its samples and their rewards; a group the reward (or the agent) fails on is
        dropped under reward_fallback skip_group (an agent's, always), and so is one dynamic sampling filters
        (rollout.filter_groups: services/rollout/group_filtering.py); the slot then takes the next spare prompt."""
        while True:
            record, prompt_ids = await self.prepare(slot)
            self._prepared.pop(record.position, None)
            scored = await self._generate_and_score(record, prompt_ids, step)
            if scored is not None and self.parts.filtering.keeps(scored.rewards):
                return scored
            filtered = scored is not None  # kept out by dynamic sampling, not by a failed reward
            why = self.parts.filtering.reason(scored.rewards) if scored is not None else self.parts.scorer.last_error
            self.replaced[slot] = await self.ledger.skip(
                slot, record.position, why, self.total_groups, filtered_step=step if filtered else None
            )
            if filtered:
                self.parts.filtering.counted(step, await self.ledger.filtered(step))
            log.info(
                "group dropped; its slot takes a spare prompt",
                extra={"slot": slot, "position": record.position, "spare": self.replaced[slot], "why": why[:200]},
            )

    async def _generate_and_score(self, record: PromptRecord, prompt_ids: list[int], step: int) -> ScoredGroup | None:
        """The group of `record`: generated (or played by the agent) and scored; None when the reward failed
        under reward_fallback skip_group (or the agent's episode failed)."""
        run, n = self.run, self.run.n_samples_per_prompt
        seed = run.optim.seed * 1_000_003 + record.position * 4099
        version, rid = self.parts.pool.serving_version, f"{self.config.run_id}-{record.position}"
        if self.parts.agents is not None:
            with span("generate", step, version):  # the agent's reward calls included
                scored = await self.parts.agents.scored_group(record, n, rid, step)
            if scored is None:
                self.parts.scorer.last_error = self.parts.agents.last_error
            return scored
        with span("generate", step, version):
            samples = await self.parts.pool.generate_group(  # one request per group: the prompt is prefilled once
                prompt_ids,
                [{**self.parts.sampling, "sampling_seed": seed + k} for k in range(n)],
                run.rollout.max_new_tokens,
                [f"{rid}-{k}" for k in range(n)],
            )
        with span("reward", step, version):
            texts = [self.parts.decode(s.output_ids) for s in samples]
            rewards = await self.parts.scorer.score(record, texts)
        if rewards is None:
            return None
        rewards = shaped_rewards(rewards, samples, run.reward_shaping, run.rollout.max_new_tokens)
        return ScoredGroup.of_samples(record, prompt_ids, samples, rewards, step, run.reward_shaping.overlong_filter)

    async def write(self, position: int) -> None:
        """Generate, score and write the group of slot `position`."""
        run = self.run
        step = position // self.groups_per_step
        partition = partition_name(run.name, step)
        self.parts.writes.expect(partition)  # its put waits a moment for this group (put_coalescing.py)
        try:
            scored = await self._scored_group(position, step)
        except BaseException:
            self.parts.writes.abandon(partition)
            raise
        record, rewards = scored.record, scored.rewards
        with span("put", step, scored.begin_version):
            rows = await self.parts.writes.put(partition, scored.columns)  # with the step's groups finishing meanwhile
        source = record.fields.get(run.rollout.source_field)
        if self.source_rewards is not None and source is not None:
            await self.source_rewards.add(step, str(source), rewards)
        written = await self.ledger.mark_written(position, step, rows or ())
        self.parts.lost.written(position)
        if written >= self.groups_per_step:
            await self.tq.seal_partition(partition)
            log.info("step written", extra={"step": step})
        GROUPS.inc()
        SAMPLES_TOKENS.inc(scored.tokens)
        RESUBMITS.inc(scored.resubmits)
        for r in rewards:
            REWARD.observe(r)
        self.status.update(last_position=position, step=step, **self.parts.scorer.counts())
        for m in self.memberships[:1]:
            m.progress(step=step)

    async def _ensure_partition(self, step: int) -> None:
        if step not in self._partitions:
            await self.tq.create_partition(
                partition_name(self.run.name, step), group_size=self.run.group_rows, exist_ok=True
            )
            self._partitions.add(step)

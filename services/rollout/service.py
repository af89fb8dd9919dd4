"""The rollout role's loop: admit prompt groups up to the staleness bound, generate, score, write.

    recover()                 the ledger + what open partitions already hold -> positions still to do
    loop:
        admit group at `position` while may_admit(...)  (services/rollout/admission.py)
            generate n samples (engine pool; aborted requests resume under new weights)
            score them (reward function; a failing reward falls back: services/rollout/scoring.py)
            put the whole group into train_<step>, mark it written
            the step's last group seals its partition
        otherwise wait for a group to finish or the engines' weight version to move
    beside it: the eval task (services/rollout/evaluation.py) when the run has eval.prompts

`position` in the loop is a group slot (the ledger's position): slot g belongs to step g // rollout_batch_size
and holds prompt g, unless the group was dropped (reward_fallback skip_group) and the slot moved on to a spare
prompt (services/run_state/prompt_ledger.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import torch
from prometheus_client import Counter, Gauge, Histogram

from services.model.chat_format import render_chat
from services.rollout.admission import may_admit, version_offset
from services.rollout.config import RolloutConfig
from services.rollout.connections import engine_pool, registration
from services.rollout.engine_fleet import EngineFleet
from services.rollout.engine_pool import Engines
from services.rollout.evaluation import Evaluator
from services.rollout.lost_groups import LostGroups
from services.rollout.put_coalescing import PutCoalescer
from services.rollout.recovery import recover_positions
from services.rollout.agent_endpoint import Episodes
from services.rollout.agents import agent_runner
from services.rollout.sample_columns import ScoredGroup, shaped_rewards
from services.run_contract.prompt_source import DEMO_TASKS, PromptRecord, open_prompt_source
from services.rollout.rewards import build_reward
from services.rollout.rewards.model_judge import JudgeClient
from services.rollout.group_filtering import GroupFiltering
from services.rollout.scoring import GroupScorer
from services.run_contract.partitions import partition_name, task_name
from services.run_contract.sample_fields import RECOVERY_INPUTS
from services.role.role_service import RoleStatus, serve_role
from services.role.session import RunSession
from services.run_state.seams import Membership
from services.runtime.spans import span
from services.sglang_protocol.client import SGLangClient

log = logging.getLogger(__name__)
GROUPS = Counter("sluice_rollout_groups_total", "prompt groups written to TransferQueue")
SAMPLES_TOKENS = Counter("sluice_rollout_response_tokens_total", "response tokens generated")
RESUBMITS = Counter("sluice_rollout_resubmits_total", "requests resumed after a weight update aborted them")
IN_FLIGHT = Gauge("sluice_rollout_groups_in_flight", "prompt groups generating")
BLOCKED = Counter("sluice_rollout_admission_blocked_seconds_total",
                  "time admission was held (by the staleness bound or the in-flight cap)")
REWARD = Histogram("sluice_rollout_reward", "sample rewards", buckets=(-1, 0, 0.25, 0.5, 0.75, 1, 2))
RECOVER_TASK = "rollout_recover"


class RolloutService:
    """Run by the role host (services/role/role_service.py) with the run's session; `engines` (the engine pool:
    services/rollout/connections.py) and `judge_client` are its own seams. Tests pass in-memory fakes."""

    def __init__(self, config: RolloutConfig, status: RoleStatus,
                 engines: Callable[[RolloutConfig], Engines] = engine_pool,
                 judge_client: Callable[..., JudgeClient] = SGLangClient):
        self.config = config
        self.judge_client = judge_client  # a model:... reward's client to its engine
        self.status = status
        self.engines = engines
        self.memberships: list[Membership] = []
        self.episodes = Episodes()  # agent episodes' endpoints (served by the role's HTTP server)

    # ------------------------------------------------------------------ setup

    def _setup(self, session: RunSession) -> None:
        from services.model.loading import load_tokenizer  # an error naming the model directory and file

        self.session = session
        self.dcs, self.tq, self.ledger, self.progress = session.dcs, session.atq, session.ledger, session.progress
        self.run = run = session.run
        r = run.rollout
        self.tokenizer = load_tokenizer(run.model)
        self.source = open_prompt_source(r.prompts, r.prompt_field, r.shuffle_seed)
        task = r.prompts.removeprefix("demo:")
        spec = r.reward or (DEMO_TASKS[task].reward if r.prompts.startswith("demo:") and task in DEMO_TASKS else None)
        if spec is None and not r.agent:
            raise ValueError("rollout.reward is required unless prompts is a demo task (or an agent scores them)")
        self.reward = build_reward(
            spec, label_field=r.label_field, timeout_s=r.reward_timeout_s, retries=r.reward_retries,
            token=self.config.reward_token or None, judge=r.judge, judge_urls=self.config.judge_url_map,
            engine_key=self.config.auth_token or None, judge_client=self.judge_client) if spec else None
        self.scorer = GroupScorer(self.reward, r.reward_fallback)
        self.filtering = GroupFiltering(r.filter_groups, r.max_filter_ratio, run.rollout_batch_size)
        self.pool = self.engines(self.config)
        self.pool.adapters = run.name if run.trainer.lora is not None else None  # SGLang engines apply it by name
        self.fleet = EngineFleet(self.config, self.pool, session.dcs,
                                 lambda dcs, registration: session.join(registration), session.dcs)
        self.writes = PutCoalescer(self.tq.put, linger_s=self.config.put_linger_s)
        self.lost = LostGroups(self.tq, self.ledger, run.name, run.rollout_batch_size, self.progress)
        self.evaluator = None
        if run.eval.prompts is not None:
            if session.evaluations is None:
                raise ValueError("the run has eval.prompts but the rollout was given nowhere to record evaluations")
            self.evaluator = Evaluator(run, self.pool, self.reward, session.evaluations, self.encode,
                                       lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                                       lambda: bool(self.memberships and self.memberships[0].paused))
        self.source_rewards = session.source_rewards  # reward per data source and step, for tracking
        self.groups_per_step = run.rollout_batch_size
        self.total_groups = run.num_steps * run.rollout_batch_size
        self.cap = r.max_groups_in_flight or 2 * run.rollout_batch_size
        self.version_moved = asyncio.Event()  # wakes admission the moment the engines' version moves
        self.sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}
        self.agents = agent_runner(self.config, run, self.episodes, self.pool.generate, self.tokenizer, self.sampling,
                                   self.reward)
        self._partitions: set[int] = set()
        self._prepared: dict[int, tuple[PromptRecord, list[int]]] = {}  # prompt position -> record, its ids
        self.replaced: dict[int, int] = {}  # slot -> the spare prompt position it holds (skip_group)

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str) and not self.run.rollout.apply_chat_template:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return render_chat(self.tokenizer, messages)

    # ------------------------------------------------------------------ the loop

    async def run_loop(self, session: RunSession, stop: asyncio.Event) -> None:
        self._setup(session)
        run = session.run
        self.memberships.append(await asyncio.to_thread(session.join, registration(self.config)))
        try:
            await self.fleet.start()
            await self.tq.register_task(task_name(run.name, RECOVER_TASK), RECOVERY_INPUTS,
                                        group_size=run.group_rows)
            todo = await self.recover()
            self.status.running()
            poller = asyncio.create_task(self._poll_versions(stop))
            lost = asyncio.create_task(self.lost.watch(self.config.lost_check_s, self.version_moved.set))
            evals = asyncio.create_task(self.evaluator.run_loop(max(self.config.version_poll_s, 0.1))) \
                if self.evaluator else None
            try:
                await self.generate(todo, stop)
                # keep the engines registered (so they receive the last weights) until training is done
                while not stop.is_set() and (progress := await self.progress()).next_step < run.num_steps:
                    if self.lost.redo:  # rows lost with a shard: their slots again
                        await self.generate(iter(()), stop)
                    self.status.update(state="generated everything; waiting for the trainer")
                    if self.memberships[0].paused:
                        await self._paused()
                    await asyncio.sleep(self.config.version_poll_s)
                if evals is not None and not stop.is_set():
                    evals.cancel()  # an eval of an older version in flight is dropped for the last one
                    await asyncio.gather(evals, return_exceptions=True)
                    self.status.update(state="evaluating the last version")
                    await self.evaluator.finish(progress.version, wait_s=60.0)
            finally:
                poller.cancel()
                lost.cancel()
                if evals is not None:
                    evals.cancel()
        finally:
            await self._close()

    async def generate(self, todo, stop: asyncio.Event) -> None:
        pending: set[asyncio.Task] = set()
        try:
            await self._admit(todo, stop, pending)
        except BaseException:
            # a group failed: the others are abandoned, their errors retrieved (one failure, reported once;
            # an unretrieved task error would be logged later from the garbage collector)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            raise

    async def _admit(self, todo, stop: asyncio.Event, pending: set[asyncio.Task]) -> None:
        position = next(todo, None)
        blocked_since = None
        while not stop.is_set():
            if self.memberships and self.memberships[0].paused:  # stop admitting; ack once drained
                if pending:
                    await asyncio.wait(pending)
                    self._reap(pending)
                    continue
                await self._paused()
                continue
            if self.lost.redo and len(pending) < self.cap:  # the trainer waits for these: first
                pending.add(asyncio.create_task(self.group(self.lost.take())))
                continue
            if position is None or position >= self.total_groups:
                if not pending:
                    break
            elif len(pending) < self.cap and await self._admissible(position):
                if blocked_since is not None:
                    BLOCKED.inc(time.monotonic() - blocked_since)
                    blocked_since = None
                pending.add(asyncio.create_task(self.group(position)))
                IN_FLIGHT.set(len(pending))
                position = next(todo, None)
                continue
            elif blocked_since is None:
                blocked_since = time.monotonic()
                if position is not None and position < self.total_groups:
                    await self._prepare(position)  # the wait is idle time: the next group starts sooner
            self.version_moved.clear()
            moved = asyncio.ensure_future(self.version_moved.wait())
            await asyncio.wait(pending | {moved}, timeout=self.config.version_poll_s,
                               return_when=asyncio.FIRST_COMPLETED)
            moved.cancel()
            self._reap(pending)
        if pending:  # stopping: let what is generating finish, so nothing admitted is lost
            await asyncio.wait(pending)
            self._reap(pending)

    async def _paused(self) -> None:
        """Nothing is generating: acknowledge the pause for the rollout and its engines and wait until
        the run resumes."""
        if self.evaluator is not None:
            await self.evaluator.drained()
        def engines_idle_too() -> None:  # each engine's membership learns of the pause on its own beat
            self.fleet.acknowledge_pause()
            time.sleep(0.2)
        await asyncio.to_thread(self.memberships[0].safe_point, None, engines_idle_too)

    def _reap(self, pending: set[asyncio.Task]) -> None:
        for task in [t for t in pending if t.done()]:
            pending.discard(task)
            task.result()  # a failed group takes the service down (restart-safe: it is regenerated)
        IN_FLIGHT.set(len(pending))

    async def _admissible(self, position: int) -> bool:
        progress = await self.progress()
        serving = self.pool.serving_version
        return may_admit(position, self.run.max_staleness, serving,
                         version_offset(progress.version, progress.next_step, serving), self.groups_per_step)

    async def _poll_versions(self, stop: asyncio.Event) -> None:
        """Engine versions as they move (admission wakes at once), the run's engine set followed, and this
        rollout's progress reports."""
        def moved() -> None:
            self.version_moved.set()
            self._report_versions()
        tasks = [asyncio.create_task(self.pool.watch_versions(
            self.config.version_wait_s, self.config.version_poll_s, moved)),
            asyncio.create_task(self.fleet.follow(self.config.engine_poll_s))]
        try:
            while not stop.is_set():
                for task in tasks:
                    if task.done():
                        task.result()  # neither ends on its own: surface its error
                self._report_versions()
                await asyncio.sleep(max(self.config.version_poll_s, 0.25))
        finally:
            for task in tasks:
                task.cancel()

    def _report_versions(self) -> None:
        version = self.pool.serving_version
        self.memberships[0].progress(weight_version=version)
        self.fleet.report()  # each engine its own version; a dead one drops out of the next weight sync
        self.status.update(engine_version=version, requests=self.pool.requests, resubmits=self.pool.resubmits,
                           engines=self.pool.describe(), filtered_groups=self.filtering.filtered_groups,
                           **self.scorer.counts())

    # ------------------------------------------------------------------ one group

    async def _prepare(self, slot: int) -> tuple[PromptRecord, list[int]]:
        """The slot's prompt, encoded, and its step's partition, made once (ahead of admission when the
        rollout waits for it)."""
        position = self.replaced.get(slot, slot)
        if position not in self._prepared:
            record = self.source.record(position)
            self._prepared[position] = (record, self.encode(record.prompt))
        await self._ensure_partition(slot // self.groups_per_step)
        return self._prepared[position]

    async def _scored_group(self, slot: int, step: int) -> ScoredGroup:
        """The slot's prompt, its samples and their rewards; a group the reward (or the agent) fails on is
        dropped under reward_fallback skip_group (an agent's, always), and so is one dynamic sampling filters
        (rollout.filter_groups: services/rollout/group_filtering.py); the slot then takes the next spare prompt."""
        while True:
            record, prompt_ids = await self._prepare(slot)
            self._prepared.pop(record.position, None)
            scored = await self._generate_and_score(record, prompt_ids, step)
            filtered = scored is not None and not self.filtering.keeps(scored.rewards)
            if scored is not None and not filtered:
                return scored
            why = self.filtering.reason(scored.rewards) if filtered else self.scorer.last_error
            self.replaced[slot] = await self.ledger.skip(slot, record.position, why, self.total_groups,
                                                         filtered_step=step if filtered else None)
            if filtered:
                self.filtering.counted(step, await self.ledger.filtered(step))
            log.info("group dropped; its slot takes a spare prompt", extra={
                "slot": slot, "position": record.position, "spare": self.replaced[slot], "why": why[:200]})

    async def _generate_and_score(self, record: PromptRecord, prompt_ids: list[int], step: int) -> ScoredGroup | None:
        """The group of `record`: generated (or played by the agent) and scored; None when the reward failed
        under reward_fallback skip_group (or the agent's episode failed)."""
        run, n = self.run, self.run.n_samples_per_prompt
        seed = run.optim.seed * 1_000_003 + record.position * 4099
        version, rid = self.pool.serving_version, f"{self.config.run_id}-{record.position}"
        if self.agents is not None:
            with span("generate", step, version):  # the agent's reward calls included
                scored = await self.agents.scored_group(record, n, rid, step)
            if scored is None:
                self.scorer.last_error = self.agents.last_error
            return scored
        with span("generate", step, version):
            samples = await self.pool.generate_group(  # one request per group: the prompt is prefilled once
                prompt_ids, [{**self.sampling, "sampling_seed": seed + k} for k in range(n)],
                run.rollout.max_new_tokens, [f"{rid}-{k}" for k in range(n)])
        with span("reward", step, version):
            texts = [self.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in samples]
            rewards = await self.scorer.score(record, texts)
        if rewards is None:
            return None
        rewards = shaped_rewards(rewards, samples, run.reward_shaping, run.rollout.max_new_tokens)
        return ScoredGroup.of_samples(record, prompt_ids, samples, rewards, step, run.reward_shaping.overlong_filter)

    async def group(self, position: int) -> None:
        """Generate, score and write the group of slot `position`."""
        run = self.run
        step = position // self.groups_per_step
        partition = partition_name(run.name, step)
        self.writes.expect(partition)  # its put waits a moment for this group (services/rollout/put_coalescing.py)
        try:
            scored = await self._scored_group(position, step)
        except BaseException:
            self.writes.abandon(partition)
            raise
        record, rewards = scored.record, scored.rewards
        with span("put", step, scored.begin_version):
            rows = await self.writes.put(partition, scored.columns)  # with the step's groups finishing meanwhile
        source = record.fields.get(run.rollout.source_field)
        if self.source_rewards is not None and source is not None:
            await self.source_rewards.add(step, str(source), rewards)
        written = await self.ledger.mark_written(position, step, rows or ())
        self.lost.written(position)
        if written >= self.groups_per_step:
            await self.tq.seal_partition(partition)
            log.info("step written", extra={"step": step})
        GROUPS.inc()
        SAMPLES_TOKENS.inc(scored.tokens)
        RESUBMITS.inc(scored.resubmits)
        for r in rewards:
            REWARD.observe(r)
        self.status.update(last_position=position, step=step, **self.scorer.counts())
        for m in self.memberships[:1]:
            m.progress(step=step)

    async def _ensure_partition(self, step: int) -> None:
        if step not in self._partitions:
            await self.tq.create_partition(partition_name(self.run.name, step),
                                           group_size=self.run.group_rows, exist_ok=True)
            self._partitions.add(step)

    # ------------------------------------------------------------------ restart

    async def recover(self):
        """Slots still to generate, in order (services/rollout/recovery.py)."""
        self.replaced = await self.ledger.replacements()
        return await recover_positions(self.tq, self.ledger, self.run, self.replaced, RECOVER_TASK)

    async def _close(self) -> None:
        """What the rollout opened itself (the session's clients are the host's to close)."""
        for m in self.memberships:
            await asyncio.to_thread(m.close)
        await self.fleet.close()
        closers = [self.pool.aclose()] + ([self.reward.aclose()] if self.reward else []) + \
            ([self.agents.play.aclose()] if self.agents else [])
        for closer in closers:
            try:
                await closer
            except Exception as exc:
                log.warning("close failed", extra={"error": str(exc)})


async def serve(config: RolloutConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(1)
    status = RoleStatus("rollout")
    service = RolloutService(config, status)
    await serve_role(config, stop, status, aloop=service.run_loop, routers=[service.episodes.router()])

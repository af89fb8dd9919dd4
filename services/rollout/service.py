"""The rollout role's schedule: admit prompt groups up to the staleness bound, generate, score, write.

    build its parts from the run (rollout_parts.py: tokenizer, prompts, reward, engines, writer, evaluation)
    join the run; take in the run's engine set
    recover()                 the ledger + what open partitions already hold -> slots still to do
    admit, one decision a turn (Rollout._admit):
        paused: let what is generating finish, then acknowledge the pause and wait
        a slot whose rows were lost with a shard: start it first (the trainer waits for it)
        the next slot, while may_admit(...) (admission.py) and the in-flight cap allow: start its group
            (group_writing.py: generate n samples, score them, put the group into train_<step>, mark it written;
            the step's last group seals its partition)
        otherwise prepare that slot and wait for a group to finish or the engines' weight version to move
    until training is done: keep the engines registered (they receive the last weights); lost slots again
    the last version's evaluation
    beside it all: the engines' versions followed (admission wakes when they move), the watch for lost rows,
        and the eval task (evaluation.py) when the run has eval.prompts

A slot is a group position in the ledger: slot g belongs to step g // rollout_batch_size and holds prompt g,
unless the group was dropped (reward_fallback skip_group, dynamic sampling) and the slot moved on to a spare
prompt (services/run_state/prompt_ledger.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import torch
from prometheus_client import Counter, Gauge

from services.rollout.admission import may_admit, version_offset
from services.rollout.agent_endpoint import Episodes
from services.rollout.config import RolloutConfig
from services.rollout.connections import engine_pool, registration
from services.rollout.engine_pool import Engines
from services.rollout.group_writing import GroupWriter
from services.rollout.recovery import recover_positions
from services.rollout.rewards.model_judge import JudgeClient
from services.rollout.rollout_parts import RolloutParts
from services.role.role_service import RoleStatus, serve_role
from services.role.session import RunSession
from services.run_contract.partitions import task_name
from services.run_contract.sample_fields import RECOVERY_INPUTS
from services.run_state.seams import Membership
from services.run_state.trainer_progress import TrainerProgress
from services.sglang_protocol.client import SGLangClient

log = logging.getLogger(__name__)
IN_FLIGHT = Gauge("sluice_rollout_groups_in_flight", "prompt groups generating")
BLOCKED = Counter(
    "sluice_rollout_admission_blocked_seconds_total",
    "time admission was held (by the staleness bound or the in-flight cap)",
)
RECOVER_TASK = "rollout_recover"


class RolloutService:
    """Run by the role host (services/role/role_service.py) with the run's session; `engines` (the engine pool:
    services/rollout/connections.py) and `judge_client` are its own seams. Tests pass in-memory fakes."""

    def __init__(
        self,
        config: RolloutConfig,
        status: RoleStatus,
        engines: Callable[[RolloutConfig], Engines] = engine_pool,
        judge_client: Callable[..., JudgeClient] = SGLangClient,
    ):
        self.config = config
        self.judge_client = judge_client  # a model:... reward's client to its engine
        self.status = status
        self.engines = engines
        self.episodes = Episodes()  # agent episodes' endpoints (served by the role's HTTP server)

    async def run_loop(self, session: RunSession, stop: asyncio.Event) -> None:
        memberships: list[Membership] = []  # the rollout's own (its engines' are the fleet's)
        parts = RolloutParts(
            self.config,
            session,
            self.engines,
            self.judge_client,
            self.episodes,
            paused=lambda: bool(memberships and memberships[0].paused),
        )
        await Rollout(self.config, self.status, session, parts, memberships).schedule(stop)


class BlockedClock:
    """How long admission is held (BLOCKED): from the first turn that could not admit to the next admission."""

    def __init__(self) -> None:
        self.since: float | None = None

    def began(self) -> bool:
        """Admission is held; True on the turn the hold began."""
        if self.since is not None:
            return False
        self.since = time.monotonic()
        return True

    def ended(self) -> None:
        if self.since is not None:
            BLOCKED.inc(time.monotonic() - self.since)
            self.since = None


class Rollout:
    """The rollout on one run (the schedule above)."""

    def __init__(
        self,
        config: RolloutConfig,
        status: RoleStatus,
        session: RunSession,
        parts: RolloutParts,
        memberships: list[Membership],
    ):
        self.config, self.status, self.session, self.parts = config, status, session, parts
        self.run = session.run
        self.memberships = memberships
        self.groups = GroupWriter(config, status, session, parts, memberships)
        self.cap = self.run.rollout.max_groups_in_flight or 2 * self.run.rollout_batch_size
        self.version_moved = asyncio.Event()  # wakes admission the moment the engines' version moves

    async def schedule(self, stop: asyncio.Event) -> None:
        run, parts = self.run, self.parts
        self.memberships.append(await asyncio.to_thread(self.session.join, registration(self.config)))
        try:
            await parts.fleet.start()
            await self.session.atq.register_task(
                task_name(run.name, RECOVER_TASK), RECOVERY_INPUTS, group_size=run.group_rows
            )
            todo = await self.recover()
            self.status.running()
            beside = [
                asyncio.create_task(self._poll_versions(stop)),
                asyncio.create_task(parts.lost.watch(self.config.lost_check_s, self.version_moved.set)),
            ]
            evaluator = parts.evaluator
            evals = (
                asyncio.create_task(evaluator.run_loop(max(self.config.version_poll_s, 0.1)))
                if evaluator is not None
                else None
            )
            try:
                await self.generate(todo, stop)
                trained = await self.until_trained(stop)
                if evaluator is not None and evals is not None and trained is not None and not stop.is_set():
                    evals.cancel()  # an eval of an older version in flight is dropped for the last one
                    await asyncio.gather(evals, return_exceptions=True)
                    self.status.update(state="evaluating the last version")
                    await evaluator.finish(trained.version, wait_s=60.0)
            finally:
                for task in beside + ([evals] if evals is not None else []):
                    task.cancel()
        finally:
            await self.close()

    async def until_trained(self, stop: asyncio.Event) -> TrainerProgress | None:
        """Keep the engines registered (so they receive the last weights) until training is done, generating
        slots whose rows were lost with a shard meanwhile. The trainer's progress then; None if stopped first."""
        while not stop.is_set():
            progress = await self.session.progress()
            if progress.next_step >= self.run.num_steps:
                return progress
            if self.parts.lost.redo:  # rows lost with a shard: their slots again
                await self.generate(iter(()), stop)
            self.status.update(state="generated everything; waiting for the trainer")
            if self.memberships[0].paused:
                await self._paused()
            await asyncio.sleep(self.config.version_poll_s)
        return None

    # ------------------------------------------------------------------ admission

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
        """One decision a turn, the first that applies (the schedule above), until every slot of `todo` is
        written or `stop`; what is generating then finishes, so nothing admitted is lost."""
        position = next(todo, None)
        blocked = BlockedClock()
        while not stop.is_set():
            if self.memberships[0].paused:
                await self._hold_for_pause(pending)
            elif self.parts.lost.redo and len(pending) < self.cap:  # the trainer waits for these: first
                self._start(self.parts.lost.take(), pending)
            elif position is None or position >= self.groups.total_groups:
                if not pending:
                    break
                await self._wait_for_change(pending)
            elif len(pending) < self.cap and await self._admissible(position):
                blocked.ended()
                self._start(position, pending)
                position = next(todo, None)
            else:
                if blocked.began():
                    await self.groups.prepare(position)  # the wait is idle time: the next group starts sooner
                await self._wait_for_change(pending)
        await self._finish(pending)

    def _start(self, slot: int, pending: set[asyncio.Task]) -> None:
        pending.add(asyncio.create_task(self.groups.write(slot)))
        IN_FLIGHT.set(len(pending))

    async def _admissible(self, position: int) -> bool:
        progress = await self.session.progress()
        serving = self.parts.pool.serving_version
        return may_admit(
            position,
            self.run.max_staleness,
            serving,
            version_offset(progress.version, progress.next_step, serving),
            self.groups.groups_per_step,
        )

    async def _hold_for_pause(self, pending: set[asyncio.Task]) -> None:
        """Paused: admit nothing; once what is generating has finished, acknowledge the pause and wait."""
        if pending:
            await self._finish(pending)
        else:
            await self._paused()

    async def _wait_for_change(self, pending: set[asyncio.Task]) -> None:
        """Until a group finishes, the engines' version moves, or version_poll_s passes."""
        self.version_moved.clear()
        moved = asyncio.ensure_future(self.version_moved.wait())
        await asyncio.wait(pending | {moved}, timeout=self.config.version_poll_s, return_when=asyncio.FIRST_COMPLETED)
        moved.cancel()
        self._reap(pending)

    async def _finish(self, pending: set[asyncio.Task]) -> None:
        if pending:
            await asyncio.wait(pending)
            self._reap(pending)

    async def _paused(self) -> None:
        """Nothing is generating: acknowledge the pause for the rollout and its engines and wait until
        the run resumes."""
        if self.parts.evaluator is not None:
            await self.parts.evaluator.drained()

        def engines_idle_too() -> None:  # each engine's membership learns of the pause on its own beat
            self.parts.fleet.acknowledge_pause()
            time.sleep(0.2)

        await asyncio.to_thread(self.memberships[0].safe_point, None, engines_idle_too)

    def _reap(self, pending: set[asyncio.Task]) -> None:
        for task in [t for t in pending if t.done()]:
            pending.discard(task)
            task.result()  # a failed group takes the service down (restart-safe: it is regenerated)
        IN_FLIGHT.set(len(pending))

    # ------------------------------------------------------------------ beside admission

    async def _poll_versions(self, stop: asyncio.Event) -> None:
        """Engine versions as they move (admission wakes at once), the run's engine set followed, and this
        rollout's progress reports."""

        def moved() -> None:
            self.version_moved.set()
            self._report_versions()

        tasks = [
            asyncio.create_task(
                self.parts.pool.watch_versions(self.config.version_wait_s, self.config.version_poll_s, moved)
            ),
            asyncio.create_task(self.parts.fleet.follow(self.config.engine_poll_s)),
        ]
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
        pool = self.parts.pool
        version = pool.serving_version
        self.memberships[0].progress(weight_version=version)
        self.parts.fleet.report()  # each engine its own version; a dead one drops out of the next weight sync
        self.status.update(
            engine_version=version,
            requests=pool.requests,
            resubmits=pool.resubmits,
            engines=pool.describe(),
            filtered_groups=self.parts.filtering.filtered_groups,
            **self.parts.scorer.counts(),
        )

    # ------------------------------------------------------------------ restart, close

    async def recover(self):
        """Slots still to generate, in order (services/rollout/recovery.py)."""
        self.groups.replaced = await self.session.ledger.replacements()
        return await recover_positions(
            self.session.atq, self.session.ledger, self.run, self.groups.replaced, RECOVER_TASK
        )

    async def close(self) -> None:
        """What the rollout opened itself (the session's clients are the host's to close)."""
        for m in self.memberships:
            await asyncio.to_thread(m.close)
        await self.parts.aclose()


async def serve(config: RolloutConfig, stop: asyncio.Event) -> None:
    torch.set_num_threads(1)
    status = RoleStatus("rollout")
    service = RolloutService(config, status)
    await serve_role(config, stop, status, aloop=service.run_loop, routers=[service.episodes.router()])

"""Evaluation during training (RunConfig.eval): the rollout's own asyncio task. It generates the held-out prompts
through the same engines as training, eval.concurrency prompts at a time in one batch request, scores them
with the run's reward (a failing sample scores 0.0) and records an Evaluation per weight version
(services/run_state/evaluations.py). Eval samples never enter TransferQueue or training.

When: version 0 (the baseline; if that eval fails, the next version), the first version at or past each multiple of every_n_versions (versions may
jump), and the last version of the run (`finish`). A failed eval is logged and tried again once the version
moves; it never stops the rollout. Sample k of prompt i uses sampling_seed eval_seed(seed, i, k), the same at
every version, so a greedy eval (temperature 0) of the same weights gives the same result."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from services.rollout.engine_pool import Engines
from services.run_contract.prompt_source import PromptRecord, open_eval_source
from services.rollout.rewards import RewardError, RewardFunction
from services.run_contract.run_config import RunConfig
from services.run_state.evaluations import Evaluation
from services.run_state.seams import Evaluations

log = logging.getLogger(__name__)


def eval_seed(seed: int, prompt: int, k: int) -> int:
    return seed * 1_000_003 + 7_919 * prompt + k + (1 << 40)  # + 2^40: away from the training seeds


class Evaluator:
    def __init__(
        self,
        run: RunConfig,
        engines: Engines,
        reward: RewardFunction,
        store: Evaluations,
        encode: Callable,
        decode: Callable[[list[int]], str],
        paused: Callable[[], bool],
    ):
        e = run.eval
        self.run, self.settings, self.engines, self.reward, self.store = run, e, engines, reward, store
        self.encode, self.decode, self.paused = encode, decode, paused
        assert e.prompts is not None  # the rollout builds an Evaluator only for a run with eval prompts
        source = open_eval_source(e.prompts, run.rollout.prompt_field)
        self.records = [source.record(i) for i in range(min(e.max_prompts, len(source)))]
        self.max_new_tokens = e.max_new_tokens or run.rollout.max_new_tokens
        self.done: set[int] = set()  # versions evaluated
        self.in_flight = 0  # eval prompts generating (a pause waits for them)

    def due(self, version: int) -> bool:
        """The first eval (the baseline: version 0 unless it failed), or the first version at or past a multiple
        of every_n_versions not evaluated yet."""
        if version in self.done:
            return False
        if not self.done:
            return True
        multiple = version // self.settings.every_n_versions * self.settings.every_n_versions
        return multiple > 0 and max(self.done, default=-1) < multiple

    async def run_loop(self, poll_s: float) -> None:
        """Evaluate each due version until cancelled."""
        try:
            self.done = {e.version for e in await self.store.all()}  # a restarted rollout does not redo them
        except Exception as exc:  # unread, a version may be evaluated again (its result is replaced): harmless
            log.warning("reading earlier evaluations failed", extra={"error": f"{type(exc).__name__}: {exc}"})
        failed_at = None
        while True:
            version = self.engines.serving_version
            if version != failed_at and self.due(version):
                failed_at = None if await self.evaluate_safely(version) else version
            await asyncio.sleep(poll_s)

    async def finish(self, version: int, wait_s: float) -> None:
        """The run's last version: evaluated once the engines serve it (waiting up to wait_s)."""
        deadline = time.monotonic() + wait_s
        while self.engines.serving_version < version and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        version = self.engines.serving_version
        if version not in self.done:
            await self.evaluate_safely(version)

    async def evaluate_safely(self, version: int) -> bool:
        try:
            await self.evaluate(version)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never fatal: an eval is a measurement, training goes on
            log.warning(
                "eval failed; tried again when the weight version moves",
                extra={"version": version, "error": f"{type(exc).__name__}: {str(exc)[:500]}"},
            )
            return False

    async def evaluate(self, version: int) -> Evaluation:
        began = time.monotonic()
        results = []
        size = self.settings.concurrency
        for start in range(0, len(self.records), size):
            results += await self._batch(version, start, self.records[start : start + size])
        rewards = [r for prompt_rewards, _, _ in results for r in prompt_rewards]
        passed = sum(max(prompt_rewards) >= self.settings.pass_threshold for prompt_rewards, _, _ in results)
        evaluation = Evaluation(
            version=version,
            mean_reward=sum(rewards) / len(rewards),
            pass_at_k=passed / len(results),
            k=self.settings.n_samples,
            n_prompts=len(results),
            reward_failures=sum(f for _, f, _ in results),
            newest_token_version=max(v for _, _, v in results),
            wall_s=time.monotonic() - began,
            finished_at=time.time(),
        )
        await self.store.record(evaluation)
        self.done.add(version)
        log.info("eval", extra=evaluation.model_dump())
        return evaluation

    async def _batch(self, version: int, first: int, records: list[PromptRecord]) -> list[tuple[list[float], int, int]]:
        """Prompts first.. in one request: per prompt (rewards of its k samples, how many failed, the newest
        version that produced a token)."""
        while self.paused():  # a paused run generates nothing new
            await asyncio.sleep(0.1)
        n, prompts, samplings, rids = self.settings.n_samples, [], [], []
        for i, record in enumerate(records, start=first):
            encoded = self.encode(record.prompt)
            for k in range(n):
                prompts.append(encoded)
                samplings.append(
                    {"temperature": self.settings.temperature, "sampling_seed": eval_seed(self.run.optim.seed, i, k)}
                )
                rids.append(f"{self.run.name}-eval{version}-{i}-{k}")
        self.in_flight += len(records)
        try:
            samples = await self.engines.generate_samples(prompts, samplings, self.max_new_tokens, rids)
        finally:
            self.in_flight -= len(records)
        out = []
        for j, record in enumerate(records):
            mine = samples[j * n : (j + 1) * n]
            scores = [await self._score(record, self.decode(s.output_ids)) for s in mine]
            newest = max((v for s in mine for v, _, _ in s.spans), default=version)
            out.append(([s if s is not None else 0.0 for s in scores], scores.count(None), newest))
        return out

    async def _score(self, record: PromptRecord, text: str) -> float | None:
        try:
            return await self.reward.score(record, text)
        except RewardError as e:
            log.warning("eval reward failed; scored 0.0", extra={"position": record.position, "error": str(e)[:500]})
            return None

    async def drained(self) -> None:
        """Returns once no eval request is generating (the rollout acknowledges a pause only then)."""
        while self.in_flight:
            await asyncio.sleep(0.05)

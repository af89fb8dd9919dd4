"""What the rollout builds from its run before it generates, in one place: the tokenizer and the prompt source, the
reward and what judges a group by it (reward fallback, dynamic sampling), the engines and the run's engine set,
the coalescing writer of partitions, the watch for rows lost with a shard, evaluation and agents."""

from __future__ import annotations

import logging
from typing import Any, Callable

from services.model.chat_format import render_chat
from services.rollout.agent_endpoint import Episodes
from services.rollout.agents import agent_runner
from services.rollout.config import RolloutConfig
from services.rollout.engine_fleet import EngineFleet
from services.rollout.engine_pool import Engines
from services.rollout.evaluation import Evaluator
from services.rollout.group_filtering import GroupFiltering
from services.rollout.lost_groups import LostGroups
from services.rollout.put_coalescing import PutCoalescer
from services.rollout.rewards import RewardFunction, build_reward
from services.rollout.rewards.model_judge import JudgeClient
from services.rollout.scoring import GroupScorer
from services.role.session import RunSession
from services.run_contract.prompt_source import DEMO_TASKS, open_prompt_source

log = logging.getLogger(__name__)


class RolloutParts:
    """Built once the run is known (RolloutService.run_loop); everything here lives as long as the loop."""

    def __init__(
        self,
        config: RolloutConfig,
        session: RunSession,
        engines: Callable[[RolloutConfig], Engines],
        judge_client: Callable[..., JudgeClient],
        episodes: Episodes,
        paused: Callable[[], bool],
    ):
        """`paused`: whether the run is paused (evaluation waits while it is)."""
        from services.model.loading import load_tokenizer  # an error naming the model directory and file

        run, r = session.run, session.run.rollout
        self.run = run
        self.tokenizer: Any = load_tokenizer(run.model)
        self.source = open_prompt_source(r.prompts, r.prompt_field, r.shuffle_seed)
        self.reward = self._reward(config, judge_client)
        self.scorer = GroupScorer(self.reward, r.reward_fallback)
        self.filtering = GroupFiltering(r.filter_groups, r.max_filter_ratio, run.rollout_batch_size)
        self.pool = engines(config)
        self.pool.adapters = run.name if run.trainer.lora is not None else None  # SGLang engines apply it by name
        self.fleet = EngineFleet(
            config, self.pool, session.dcs, lambda dcs, registration: session.join(registration), session.dcs
        )
        self.writes = PutCoalescer(session.atq.put, linger_s=config.put_linger_s)
        self.lost = LostGroups(session.atq, session.ledger, run.name, run.rollout_batch_size, session.progress)
        self.evaluator: Evaluator | None = None
        if run.eval.prompts is not None:
            if session.evaluations is None:
                raise ValueError("the run has eval.prompts but the rollout was given nowhere to record evaluations")
            if self.reward is None:
                raise ValueError(
                    "eval.prompts are scored by rollout.reward, and the run has none (its agent scores "
                    "only its own episodes)"
                )
            self.evaluator = Evaluator(
                run, self.pool, self.reward, session.evaluations, self.encode, self.decode, paused
            )
        self.sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k}
        self.agents = agent_runner(
            config, run, episodes, self.pool.generate, self.tokenizer, self.sampling, self.reward
        )

    def _reward(self, config: RolloutConfig, judge_client: Callable[..., JudgeClient]) -> RewardFunction | None:
        """The run's reward (a demo task's own, when the run names none); None when an agent scores the groups."""
        r = self.run.rollout
        task = r.prompts.removeprefix("demo:")
        spec = r.reward or (DEMO_TASKS[task].reward if r.prompts.startswith("demo:") and task in DEMO_TASKS else None)
        if spec is None and not r.agent:
            raise ValueError("rollout.reward is required unless prompts is a demo task (or an agent scores them)")
        return (
            build_reward(
                spec,
                label_field=r.label_field,
                timeout_s=r.reward_timeout_s,
                retries=r.reward_retries,
                token=config.reward_token or None,
                judge=r.judge,
                judge_urls=config.judge_url_map,
                engine_key=config.auth_token or None,
                judge_client=judge_client,
            )
            if spec
            else None
        )

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str) and not self.run.rollout.apply_chat_template:
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return render_chat(self.tokenizer, messages)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def aclose(self) -> None:
        """What the rollout opened itself (the session's clients are the host's to close): its engines' and agents'
        registrations and clients, the reward's."""
        await self.fleet.close()
        closers = (
            [self.pool.aclose()]
            + ([self.reward.aclose()] if self.reward else [])
            + ([self.agents.play.aclose()] if self.agents else [])
        )
        for closer in closers:
            try:
                await closer
            except Exception as exc:
                log.warning("close failed", extra={"error": str(exc)})

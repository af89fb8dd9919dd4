"""AgentRunner's episode policy (services/rollout/agents.py) with a fake agent that records its model calls
straight into the episode: a reward returned after a limit the agent caught counts, failures are tried again
as fresh episodes, and a run of failures (or a reward that is not a finite number) fails the episode."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.rollout.agent_endpoint import Episodes
from services.rollout.agents import EPISODES, AgentFailed, AgentRunner
from services.rollout.episodes import Turn
from services.run_contract.prompt_source import PromptRecord

RECORD = PromptRecord(position=3, epoch=0, index=3, prompt="q", fields={"label": "1"})


class FakeAgent:
    """Each try runs the next behaviour: "call" (one model call, reward 1.0), "limit" (a call, then the turn limit,
    caught: reward 0.5), "raise", "silent" (no call), or a value to return after one call."""

    def __init__(self, episodes: Episodes, behaviours: list):
        self.episodes, self.behaviours, self.samples = episodes, list(behaviours), []

    async def __call__(self, sample, base_url, key):
        self.samples.append(sample)
        episode = next(e for e in self.episodes.live.values() if e.key == key)
        assert base_url.endswith(f"/episodes/{episode.id}/v1")
        behaviour = self.behaviours.pop(0)
        if behaviour == "raise":
            raise RuntimeError("the tool broke")
        if behaviour == "silent":
            return 1.0
        episode.turns.append(Turn([1, 2], [3, 4], [-0.1, -0.2], [7, 7]))
        if behaviour in ("tool_hangs", "hangs"):
            if behaviour == "tool_hangs":  # as the endpoint marks an answer with tool calls
                episode.tool_wait_since = time.monotonic()
            await asyncio.sleep(30)
        if behaviour == "limit":
            episode.outcome = "turn_limit"
            return 0.5
        return 1.0 if behaviour == "call" else behaviour

    async def aclose(self):
        pass


def run(behaviours: list, retries: int = 1, chains: int = 1, timeout_s: float = 5, tool_timeout_s: float = 5):
    episodes = Episodes()
    agent = FakeAgent(episodes, behaviours)
    runner = AgentRunner(
        agent,
        episodes,
        "http://127.0.0.1:1",
        reward=None,
        timeout_s=timeout_s,
        retries=retries,
        chains_per_episode=chains,
        tool_timeout_s=tool_timeout_s,
    )
    try:
        return asyncio.run(runner.episode(RECORD, 1, "r-3-1")), agent
    finally:
        assert not episodes.live  # every try's episode was closed


def test_a_reward_after_a_caught_limit_counts_with_that_outcome():
    result, agent = run(["limit"])
    assert (result.reward, result.outcome, result.turns) == (0.5, "turn_limit", 1)
    assert result.samples[0].response_ids == [3, 4] and result.samples[0].begin_version == 7
    assert agent.samples == [{"prompt": "q", "fields": {"label": "1"}, "position": 3, "index": 1}]


def test_failed_tries_are_played_again_as_fresh_episodes():
    result, agent = run(["raise", "call"])
    assert result.reward == 1.0 and len(agent.samples) == 2
    result, _ = run(["silent", "call"])  # returned without calling the model: tried again
    assert result.turns == 1


@pytest.mark.parametrize("behaviours", [["raise", "raise"], ["silent", "silent"], [float("nan")], [True]])
def test_an_episode_fails_after_its_tries_or_on_a_reward_that_is_not_a_number(behaviours):
    with pytest.raises(AgentFailed):
        run(behaviours)


def test_an_episode_with_fewer_chains_than_its_rows_is_padded_with_copies_that_train_on_nothing():
    result, _ = run(["call"], chains=3)
    real, *padding = result.samples
    assert real.loss_mask == [1.0, 1.0] and len(padding) == 2
    for row in padding:
        assert (row.prompt_ids, row.response_ids, row.versions) == (real.prompt_ids, real.response_ids, real.versions)
        assert row.loss_mask == [0.0, 0.0] and row.model_tokens == 0


def _outcomes() -> dict:
    return {s.labels["outcome"]: s.value for m in EPISODES.collect() for s in m.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("hang,outcome,timeout_s", [("tool_hangs", "tool_timeout", 10.0), ("hangs", "timeout", 1.5)])
def test_a_tool_or_an_episode_past_its_limit_ends_the_try_with_that_outcome(hang, outcome, timeout_s):
    before = _outcomes().get(outcome, 0.0)  # (the tool's 0.3 s limit well inside the episode's: a late watchdog)
    result, agent = run([hang, "call"], timeout_s=timeout_s, tool_timeout_s=0.3)
    assert result.reward == 1.0 and len(agent.samples) == 2  # the second try
    assert _outcomes()[outcome] == before + 1  # a hung tool: its own limit, not the episode's

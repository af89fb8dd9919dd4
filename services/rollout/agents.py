"""Agent rollouts: the user's agent function plays each sample's episode against the model.

`rollout.agent: import:my_pkg.agents:solve` names a function called as (an http(s) URL names an environment
service instead: EnvironmentService)

    solve(sample, client) -> reward or None

    sample  dict: prompt (text or chat messages), fields (the row's other columns), position, index
    client  an `openai` client (AsyncOpenAI for an `async def`, OpenAI for a plain function, which runs in a
            worker thread) whose base URL is the episode's own endpoint of the rollout service
            (services/rollout/agent_endpoint.py); it talks to the model as often as it likes and runs its
            tools itself

It returns the episode's reward, or None to leave it to the run's reward function, which then scores the
model's last reply with the whole conversation as the prompt. The episode's calls become its training samples
(services/rollout/episodes.py): its last `rollout.agent_chains` consistent chains (an agent that rewrites its
history makes several), each sharing the episode's reward, padded with copies of the last that train on
nothing when it made fewer, so every group has n_samples_per_prompt x agent_chains rows; older chains are
counted in sluice_rollout_agent_chains_dropped_total. An episode is bounded by its limits
(turns, context tokens: the endpoint refuses a call past them), by `agent_timeout_s` of wall time and by
`agent_tool_timeout_s` for its tools (from an answer with tool calls to its next model call); one that
fails (raises, times out, or never calls the model) is tried again up to `agent_retries` times, each try a
fresh episode; a sample whose tries all failed fails its group, which the rollout then handles as a reward
failure (rollout.reward_fallback: the group is dropped and recorded, its slot takes a spare prompt)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client import Counter

from services.rollout.agent_endpoint import EpisodeLimits, Episodes
from services.rollout.episodes import Chain, chains, episode_columns
from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards import RewardError, RewardFunction
from services.rollout.sample_columns import ScoredGroup
from services.run_contract.agent_spec import load_agent

log = logging.getLogger(__name__)
EPISODES = Counter("sluice_rollout_agent_episodes_total", "agent episodes, by outcome", ["outcome"])
DROPPED_CHAINS = Counter(
    "sluice_rollout_agent_chains_dropped_total",
    "consistent chains of an episode left untrained because the agent rewrote its history",
)


class AgentFailed(RewardError):
    """Every try of an episode failed (the message says how the last one did)."""


class EpisodeTimeout(Exception):
    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome


@dataclass
class EpisodeResult:
    samples: list[Chain]  # its rows: chains_per_episode of them
    reward: float
    turns: int
    outcome: str


def agent_runner(config, run, episodes: Episodes, generate, tokenizer, sampling: dict, reward: RewardFunction | None):
    """The run's AgentRunner (None without rollout.agent), its episodes' endpoints attached to the engines. The
    agent reaches them on this rollout's own HTTP server (config: a RoleSettings)."""
    r = run.rollout
    if not r.agent:
        return None
    episodes.attach(generate, tokenizer, sampling, EpisodeLimits(r.agent_max_turns, r.agent_max_tokens), run.model)
    remote = r.agent.startswith(("http://", "https://"))
    # an agent in this process reaches the endpoint on loopback; an environment service at the advertised address
    host = (
        config.advertise_host if remote else (config.host if config.host not in ("", "0.0.0.0", "::") else "127.0.0.1")
    )
    scheme = "https" if getattr(config, "tls_cert_file", "") else "http"
    play = (
        EnvironmentService(r.agent, getattr(config, "reward_token", ""), r.agent_timeout_s)
        if remote
        else PythonAgent(r.agent)
    )
    return AgentRunner(
        play,
        episodes,
        f"{scheme}://{host}:{config.port}",
        reward,
        r.agent_timeout_s,
        r.agent_retries,
        run.chains_per_episode,
        r.agent_tool_timeout_s,
    )


class PythonAgent:
    """The user's function, called with the sample and an `openai` client on the episode's endpoint."""

    def __init__(self, spec: str):
        import openai  # ~0.5 s of imports: paid by a run with an agent only, and at set-up, not in an episode

        self.openai = openai
        self._threads = ThreadPoolExecutor(max_workers=256, thread_name_prefix="agent-episode")
        self.fn = load_agent(spec.removeprefix("import:"))
        self.is_async = inspect.iscoroutinefunction(self.fn)

    async def __call__(self, sample: dict, base_url: str, key: str):
        if self.is_async:
            async with self.openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
                return await self.fn(sample, client)

        def run():
            with self.openai.OpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
                return self.fn(sample, client)

        # its own threads: episodes blocked on the model must not hold the threads the rollout's other calls need
        return await asyncio.get_running_loop().run_in_executor(self._threads, run)

    async def aclose(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


class EnvironmentService:
    """An agent in any language, behind HTTP: each episode is one POST of {"sample", "base_url", "api_key"} (the
    episode's OpenAI endpoint and its key), answered {"reward": number or null} once the episode is over. The
    rollout's reward_token, if set, goes as its bearer token (never the stack's)."""

    def __init__(self, url: str, token: str, timeout_s: float):
        self.url = url
        self.http = httpx.AsyncClient(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"} if token else {})

    async def __call__(self, sample: dict, base_url: str, key: str):
        response = await self.http.post(self.url, json={"sample": sample, "base_url": base_url, "api_key": key})
        response.raise_for_status()
        body = response.json()
        if not isinstance(body, dict) or "reward" not in body:
            raise ValueError(f'the environment service answered {str(body)[:200]!r}, not {{"reward": ...}}')
        return body["reward"]

    async def aclose(self) -> None:
        await self.http.aclose()


class AgentRunner:
    def __init__(
        self,
        play,
        episodes: Episodes,
        base_url: str,
        reward: RewardFunction | None,
        timeout_s: float,
        retries: int,
        chains_per_episode: int = 1,
        tool_timeout_s: float = 120.0,
    ):
        self.play, self.episodes, self.base_url = play, episodes, base_url.rstrip("/")
        self.reward, self.timeout_s, self.retries = reward, timeout_s, retries
        self.chains_per_episode, self.tool_timeout_s = chains_per_episode, tool_timeout_s
        self.last_error = ""

    async def scored_group(self, record: PromptRecord, n: int, prefix: str, step: int) -> ScoredGroup | None:
        """The n episodes of one prompt, played concurrently, as a group to write; None if one of them failed
        every try (`last_error` says why)."""
        try:
            results = await asyncio.gather(*(self.episode(record, k, f"{prefix}-{k}") for k in range(n)))
        except RewardError as exc:
            self.last_error = str(exc)
            return None
        samples = [chain for r in results for chain in r.samples]
        rewards = [r.reward for r in results for _ in r.samples]  # every chain has its episode's reward
        return ScoredGroup(
            record,
            episode_columns(record.position, samples, rewards, step),
            rewards,
            min(s.begin_version for s in samples),
            sum(s.model_tokens for s in samples),
        )

    async def episode(self, record: PromptRecord, index: int, prefix: str) -> EpisodeResult:
        error = ""
        for attempt in range(self.retries + 1):
            episode = self.episodes.open(f"{prefix}-a{attempt}")
            sample = {
                "prompt": copy.deepcopy(record.prompt),
                "fields": copy.deepcopy(record.fields),
                "position": record.position,
                "index": index,
            }
            returned, value = False, None
            try:
                value = await self._play(sample, episode)
                returned = True  # also after a limit the agent caught: its episode counts, with that outcome
            except EpisodeTimeout as exc:
                episode.outcome, error = exc.outcome, str(exc)
            except Exception as exc:  # the agent's (or its tools') failure: counted, tried again
                if episode.outcome == "running":
                    episode.outcome = "error"
                error = f"the agent raised {type(exc).__name__}: {exc}"
            finally:
                self.episodes.close(episode)
            EPISODES.labels(episode.outcome).inc()
            found = chains(episode.turns)
            if returned and not found:
                error = "the agent returned without calling the model"
            elif returned:
                kept = found[-self.chains_per_episode :]
                DROPPED_CHAINS.inc(len(found) - len(kept))
                reward = await self._reward(value, record, episode, kept[-1])
                padding = [kept[-1].untrained() for _ in range(self.chains_per_episode - len(kept))]
                return EpisodeResult(kept + padding, reward, len(episode.turns), episode.outcome)
            log.warning("agent episode failed", extra={"episode": episode.id, "attempt": attempt, "error": error})
        raise AgentFailed(f"agent episode {prefix} failed {self.retries + 1} times; the last: {error}")

    async def _play(self, sample: dict, episode):
        """The agent's episode, ended (EpisodeTimeout) past agent_timeout_s of wall time, or past
        agent_tool_timeout_s after an answer with tool calls without the agent's next call. Checked at least
        once a second: the endpoint that starts a tool wait may serve on another thread's loop."""
        task = asyncio.ensure_future(self.play(sample, f"{self.base_url}/episodes/{episode.id}/v1", episode.key))
        started = time.monotonic()
        try:
            while not task.done():
                now, since = time.monotonic(), episode.tool_wait_since
                if now - started >= self.timeout_s:
                    raise EpisodeTimeout("timeout", f"the agent did not finish within {self.timeout_s:g} s")
                if since is not None and now - since >= self.tool_timeout_s:
                    raise EpisodeTimeout(
                        "tool_timeout",
                        f"the agent's tools ran past {self.tool_timeout_s:g} s after the model called them",
                    )
                left = min(started + self.timeout_s, (since or now) + self.tool_timeout_s) - now
                await asyncio.wait({task}, timeout=max(0.0, min(1.0, left)))
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    async def _reward(self, value, record: PromptRecord, episode, sample: Chain) -> float:
        if value is not None:
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value != value
                or value in (float("inf"), float("-inf"))
            ):
                raise AgentFailed(f"the agent returned {value!r}; a reward must be a finite number or None")
            return float(value)
        if self.reward is None:
            raise AgentFailed("the agent returned no reward and the run has no rollout.reward to score it")
        conversation = dataclasses.replace(record, prompt=episode.messages[:-1])
        reply = (episode.messages[-1].get("content") or "") if episode.messages else ""
        return await self.reward.score(conversation, reply)

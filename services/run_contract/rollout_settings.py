"""The run's `rollout:` and `reward_shaping:` sections: what the rollout generates (prompts, sampling, agents)
and how it scores it (the reward, its failures, dynamic sampling, overlong shaping)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from services.algorithms.group_filter import FILTER_PATTERN, keeps_group
from services.run_contract.config_section import SEED_MAX, ConfigSection
from services.run_contract.judge_settings import JudgeSettings


class RolloutSettings(ConfigSection):
    prompts: str = Field(
        "demo:letters", min_length=1, max_length=1024, description="a .jsonl or .parquet file, or demo:<task>"
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        max_length=128,
        description="the prompts file's column holding the prompt (text or chat messages)",
    )
    shuffle_seed: int | None = Field(
        None, ge=0, le=SEED_MAX, description="shuffle each epoch with this seed; None = file order"
    )
    reward: str | None = Field(
        None,
        max_length=1024,
        description=(
            "exact_match | math_answer | arith | letters | import:module:function | http(s)://url | "
            "model:<engine url or name> (a judge model, see judge); None = the demo task's own verifier"
        ),
    )
    judge: JudgeSettings = Field(
        default_factory=JudgeSettings,
        description=("the judge's prompt, answer parser and limits when reward is model:... (docs/rewards.md)"),
    )
    label_field: str = Field(
        "label", min_length=1, max_length=128, description="the column the built-in rewards compare the response with"
    )
    source_field: str = Field(
        "data_source",
        min_length=1,
        max_length=128,
        description=(
            "the column naming a row's data source: rows that have it get their reward tracked per source and step "
            "(reward_by_source/<source>)"
        ),
    )
    reward_timeout_s: float = Field(30.0, gt=0, le=86400, description="time limit of one reward call, seconds")
    reward_retries: int = Field(3, ge=0, le=20, description="retries of a failed HTTP reward call")
    apply_chat_template: bool = Field(True, description="wrap text prompts as one user message")
    max_new_tokens: int = Field(64, ge=1, le=1 << 20, description="most tokens generated per sample")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature of rollout generation")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest token set of this mass")
    top_k: int = Field(-1, ge=-1, le=1 << 24, description="sample among the k likeliest tokens; -1 = all")
    max_groups_in_flight: int = Field(
        0, ge=0, le=1 << 20, description="cap on prompt groups generating at once; 0 = 2 steps' worth"
    )
    agent: str | None = Field(
        None,
        max_length=1024,
        description=(
            "import:module:function: an agent that plays each sample's episode, talking to the model through an "
            "OpenAI client (docs/agents.md); None = one completion per sample"
        ),
    )
    agent_max_turns: int = Field(16, ge=1, le=4096, description="most model calls of one agent episode")
    agent_max_tokens: int = Field(
        8192,
        ge=1,
        le=1 << 24,
        description="most tokens (prompt + output) of one call of an agent episode: the conversation's length",
    )
    agent_timeout_s: float = Field(600.0, gt=0, le=86400, description="wall-time limit of one agent episode")
    agent_tool_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description=(
            "limit on the agent's tools: from a model answer with tool calls to the agent's next model call (or its "
            "return); past it the episode ends with outcome tool_timeout"
        ),
    )
    agent_retries: int = Field(1, ge=0, le=20, description="fresh tries of an agent episode that failed")
    agent_chains: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "samples each agent episode writes: its last agent_chains consistent chains (an agent that rewrites its "
            "history makes several), sharing the episode's reward; an episode with fewer fills the rest with copies "
            "of its last chain that train on nothing (loss mask 0), so groups keep a fixed size; older chains are "
            "counted as dropped (docs/agents.md)"
        ),
    )
    reward_fallback: Literal["zero", "skip_group"] = Field(
        "zero",
        description=(
            "when the reward fails on a sample (raises, or times out after reward_retries): zero = that sample gets "
            "reward 0.0; skip_group = its whole group is dropped and the next spare prompt takes its place "
            "(docs/rewards.md)"
        ),
    )
    filter_groups: str = Field(
        "none",
        pattern=FILTER_PATTERN,
        description=(
            "dynamic sampling (DAPO): none; zero_variance = a group whose rewards are all equal is not trained and "
            "the next spare prompt takes its place; std_below:X = likewise for a group whose reward std is below X"
        ),
    )
    max_filter_ratio: float = Field(
        0.9,
        gt=0,
        lt=1,
        description=(
            "with filter_groups: the run fails once a step's filtered groups f make f / (f + rollout_batch_size) "
            "exceed this: rewards that never vary would otherwise keep the rollout generating for ever"
        ),
    )

    @field_validator("filter_groups")
    @classmethod
    def _filter_threshold(cls, spec: str) -> str:
        keeps_group([0.0, 1.0], spec)  # a threshold of 0 is refused, naming the forms
        return spec


class OverlongShaping(ConfigSection):
    buffer: int = Field(
        ge=1,
        le=1 << 20,
        description="L_cache: the last tokens before rollout.max_new_tokens over "
        "which the penalty grows from 0 to `penalty`",
    )
    penalty: float = Field(1.0, ge=0, le=1e6, description="the penalty at max_new_tokens (subtracted from the reward)")


class RewardShaping(ConfigSection):
    overlong: OverlongShaping | None = Field(
        None,
        description=(
            "DAPO's soft overlong punishment (docs/rewards.md): answers longer than max_new_tokens - buffer lose up to "
            "`penalty` reward; None = off"
        ),
    )
    overlong_filter: bool = Field(
        False,
        description=(
            "DAPO's overlong filtering: a sample cut off at max_new_tokens trains on nothing (loss mask 0); its reward "
            "still counts in its group's advantages"
        ),
    )

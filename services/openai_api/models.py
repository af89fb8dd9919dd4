"""The engine's OpenAI-compatible bodies: the shapes of OpenAI's `/v1/completions` and `/v1/chat/completions`
(an `openai` client works against them unchanged) plus SGLang's extensions for RL, under SGLang's names:
`return_token_ids` (completions) and `return_prompt_token_ids` / `return_meta_info` (chat) return the exact
prompt and completion token ids and the meta info of /generate (weight version, per-token version spans,
log-probs), and SGLang's sampling extras (top_k, min_p, stop_token_ids, ignore_eos). Unknown fields are
refused (400 naming them), as the engine's other bodies are."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 16  # stop strings per request (OpenAI allows 4; SGLang more)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """What both routes accept besides their input."""

    model: str = Field("default", max_length=512, description="any name: the engine serves one model")
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=1 << 31, description="SGLang's extra: -1 = no limit")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=(1 << 63) - 1, description="the n samples take seed, seed + 1, ...")
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOPS} strings")
    stop_token_ids: list[int] | None = Field(None, max_length=256)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=512)
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="accepted only at 0 (not implemented)")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="accepted only at 0 (not implemented)")
    return_meta_info: bool = Field(
        False,
        description="SGLang's extra: each choice's meta_info as /generate "
        "gives it (weight_version, weight_versions spans, output log-probs)",
    )
    rid: str | None = Field(None, max_length=256, description="request id (aborts by prefix reach every sample)")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="top log-probs per token")
    echo: bool = Field(False, description="accepted only as false")
    return_token_ids: bool = Field(False, description="SGLang's extra: token_ids and prompt_token_ids per choice")


class FunctionSpec(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object, as a string")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_calls(prefix: str, calls: list[tuple[str, str]]) -> list[ToolCall] | None:
    """The parsed (name, arguments) calls of one reply as OpenAI tool calls, ids `call_<prefix>_<k>`; None if none."""
    return [
        ToolCall(id=f"call_{prefix}_{k}", function=FunctionCall(name=name, arguments=args))
        for k, (name, args) in enumerate(calls)
    ] or None


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send more (name, refusal, audio: null); kept for the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    meta_info: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    matched_stop: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    meta_info: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

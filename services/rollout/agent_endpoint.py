"""Per-episode OpenAI endpoints of the rollout service: `/episodes/<id>/v1/chat/completions` (and `/models`).

An agent's client has the episode's base URL; each call is rendered with the model's chat template, generated
token-in-token-out through the rollout's engine pool (least loaded engine; a request a weight update aborts
resumes under the new weights, so one call may span versions) and recorded as a Turn (services/rollout/
episodes.py) before the answer goes back in OpenAI's shape, tool calls parsed as the engine's own route
parses them. Sampling is the run's (temperature, top_p, top_k: the trainer's loss assumes them); a call
chooses only max_tokens, stop strings and `n` (its n completions are n turns; the next call continues
whichever of them the agent sent back). `stream: true` gets the answer as server-sent events once it is whole
(services/openai_api/chunks.py). Limits per episode (turns, context tokens) answer 400 naming the limit,
and the episode records the outcome. Each episode has its own key, the agent's bearer token: an agent
(or an environment service elsewhere) is given that, never the stack's token, and reaches nothing else."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse

from services.model.chat_format import ChatFormatError, render_chat_text, turn_end_ids
from services.model.tool_call_formats import parse_tool_calls, tool_call_format
from services.openai_api.chunks import chat_chunks, sse_lines
from services.openai_api.models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    tool_calls,
)
from services.rollout.episodes import Turn
from services.runtime.http_auth import bearer_matches

Generate = Callable[[list[int], dict, int, str], Awaitable]  # EnginePool.generate: -> SampleOutput


@dataclass
class Episode:
    id: str
    key: str = field(default_factory=lambda: secrets.token_urlsafe(24))  # the agent's bearer token for it
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the last call's conversation, with the model's reply
    outcome: str = "running"  # running | done | turn_limit | token_limit | timeout | tool_timeout | error
    tool_wait_since: float | None = None  # time.monotonic() of an answer with tool calls the agent is running
    contexts: list[tuple[str, list[int]]] = field(default_factory=list)  # the last call's prompt + each output

    def prompt_ids(self, text: str, tokenizer) -> list[int]:
        """The ids of a call's rendered prompt `text`. When it continues the last call's prompt + one of its
        outputs as text (the agent sent the model's reply back, and more after it), they are the last call's
        ids, the output's exactly as the engine produced them, followed by the rest tokenized: re-tokenizing
        the model's text could give other ids (BPE is not unique), and the sample would no longer be the
        tokens the engine saw."""
        continued = [(t, ids) for t, ids in self.contexts if text.startswith(t)]
        if continued:
            done, ids = max(continued, key=lambda c: len(c[0]))
            return ids + tokenizer.encode(text[len(done) :], add_special_tokens=False)
        return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class EpisodeLimits:
    max_turns: int = 16
    max_tokens: int = 8192  # prompt + output of the episode's longest call


class Episodes:
    """The live episodes by id, and the router that serves their endpoints (attached to the engines once the
    rollout has set up)."""

    def __init__(self, limits: EpisodeLimits | None = None):
        self.limits = limits or EpisodeLimits()
        self.live: dict[str, Episode] = {}
        self._ids = itertools.count()
        self._generate: Generate | None = None

    def attach(self, generate: Generate, tokenizer, sampling: dict, limits: EpisodeLimits, model_name: str) -> None:
        self._generate, self.tokenizer, self.sampling = generate, tokenizer, dict(sampling)
        self.limits, self.model_name = limits, model_name
        self.stop_ids = turn_end_ids(tokenizer)
        self.tool_format = tool_call_format(tokenizer)

    def open(self, prefix: str) -> Episode:
        episode = Episode(id=f"{prefix}-e{next(self._ids)}")
        self.live[episode.id] = episode
        return episode

    def close(self, episode: Episode) -> None:
        self.live.pop(episode.id, None)
        if episode.outcome == "running":
            episode.outcome = "done"

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/episodes/{episode_id}/v1", tags=["agent episodes"])
        # each episode's own key, not the stack's token (services/role/role_service.py)
        router.own_gate = "/episodes/"  # type: ignore[attr-defined]  # an attribute of ours on the router

        @router.get("/models", response_model=ModelList)
        async def models(episode_id: str, request: Request):
            self._episode(episode_id, request)
            return ModelList(data=[ModelCard(id=self.model_name, created=0)])

        @router.post(
            "/chat/completions",
            response_model=ChatCompletionResponse,
            responses={
                200: {
                    "content": {"text/event-stream": {}},
                    "description": "the completion, or with stream: true its chunks",
                },
                400: {"description": "a limit of the episode, or a body it cannot serve"},
                404: {"description": "no such live episode"},
            },
        )
        async def chat(episode_id: str, req: ChatCompletionRequest, request: Request):
            """One model call of the episode (its n completions), each recorded token for token."""
            response = await self._chat(self._episode(episode_id, request), req)
            if not req.stream:
                return response
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse_lines(chat_chunks(response, usage)), media_type="text/event-stream")

        return router

    def _episode(self, episode_id: str, request: Request) -> Episode:
        """The live episode whose key the request carries (401 otherwise, whether or not it exists)."""
        episode = self.live.get(episode_id)
        sent = request.headers.get("authorization", "")
        if episode is None or not bearer_matches(sent, episode.key):
            raise HTTPException(401, "no live episode with this id and key", headers={"WWW-Authenticate": "Bearer"})
        if self._generate is None:
            raise HTTPException(503, "the rollout is not set up yet")
        return episode

    def _prompt(self, episode: Episode, req: ChatCompletionRequest) -> tuple[str, list[int], int]:
        if len(episode.turns) + req.n > self.limits.max_turns:
            episode.outcome = "turn_limit"
            raise HTTPException(
                400,
                f"turn_limit: the episode made {len(episode.turns)} of its "
                f"{self.limits.max_turns} completions; this call asks for {req.n} more",
            )
        tools = (
            [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        )
        if tools and self.tool_format is None:
            raise HTTPException(400, "tools: the model's chat template defines no tool-call format")
        try:
            text = render_chat_text(
                self.tokenizer,
                [m.model_dump(exclude_none=True) for m in req.messages],
                tools,
                **(req.chat_template_kwargs or {}),
            )
        except ChatFormatError as exc:
            raise HTTPException(400, str(exc)) from None
        prompt = episode.prompt_ids(text, self.tokenizer)
        room = self.limits.max_tokens - len(prompt)
        if room <= 0:
            episode.outcome = "token_limit"
            raise HTTPException(
                400,
                f"token_limit: the conversation is {len(prompt)} tokens; the episode allows {self.limits.max_tokens}",
            )
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return text, prompt, min(room, asked) if asked is not None else room

    async def _chat(self, episode: Episode, req: ChatCompletionRequest) -> ChatCompletionResponse:
        episode.tool_wait_since = None  # the agent is back from its tools
        text, prompt, max_new = self._prompt(episode, req)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        sampling = {**self.sampling, "stop_token_ids": self.stop_ids + list(req.stop_token_ids or [])}
        if stops:
            sampling["stop"] = stops
        rid = f"{episode.id}-t{len(episode.turns)}"
        generate = self._generate
        assert generate is not None  # _episode refuses a call before setup
        outs = await asyncio.gather(
            *(generate(prompt, sampling, max_new, rid if req.n == 1 else f"{rid}-{i}") for i in range(req.n))
        )
        first = len(episode.turns)
        choices = [self._choice(episode, req, prompt, stops, out, i, first + i) for i, out in enumerate(outs)]
        episode.contexts = [
            (text + self.tokenizer.decode(out.output_ids), prompt + list(out.output_ids)) for out in outs
        ]
        episode.messages = [m.model_dump(exclude_none=True) for m in req.messages] + [
            choices[0].message.model_dump(exclude_none=True)
        ]
        if any(c.message.tool_calls for c in choices):
            episode.tool_wait_since = time.monotonic()
        completion = sum(len(out.output_ids) for out in outs)
        return ChatCompletionResponse(
            id=f"chatcmpl-{episode.id}-{first}",
            created=int(time.time()),
            model=req.model,
            choices=choices,
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=completion, total_tokens=len(prompt) + completion),
        )

    def _choice(
        self,
        episode: Episode,
        req: ChatCompletionRequest,
        prompt: list[int],
        stops: list[str],
        out,
        index: int,
        turn: int,
    ) -> ChatChoice:
        """Completion `index` of the call, recorded as the episode's turn `turn`, in OpenAI's shape."""
        episode.turns.append(Turn(prompt, list(out.output_ids), list(out.log_probs), out.token_versions()))
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        for stop in stops:
            text = text.split(stop, 1)[0] if stop else text
        tools = bool(req.tools) and req.tool_choice != "none"
        content, calls = parse_tool_calls(text, self.tool_format) if tools else (text, [])
        reply = AssistantMessage(content=content, tool_calls=tool_calls(f"{episode.id}_{turn}", calls))
        reason = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        spans = [{"version": str(v), "start": s, "end": e} for v, s, e in out.spans]
        return ChatChoice(
            index=index,
            message=reply,
            finish_reason=reason,
            prompt_token_ids=prompt,
            token_ids=list(out.output_ids),
            meta_info={
                "weight_version": str(out.begin_version),
                "weight_versions": spans,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(out.log_probs, out.output_ids)],
            },
        )

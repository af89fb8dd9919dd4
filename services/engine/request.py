"""One generation request inside the engine: its prompt, what it has produced, and where its KV lives."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from services.engine.sampling import SamplingParams
from services.engine.speculation import NgramDrafter


@dataclass
class Generation:
    rid: str
    prompt: list[int]
    params: SamplingParams
    on_update: Callable[["Generation"], None]
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    wants_logprobs: bool = False  # return_logprob: its answer carries output (and top) log-probs
    top_logprobs_num: int = 0
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    logprob_start_len: int = -1  # >= 0: report prompt log-probs from this position
    input_logprobs: list[float | None] | None = None
    spans: list[dict] = field(default_factory=list)
    finish_reason: dict | None = None
    text: str = ""
    slot: int | None = None  # KV pool slot while admitted
    cached: int = 0  # positions of prompt + output whose KV is in the slot
    cached_tokens: int = 0  # prompt tokens copied from a sibling instead of computed
    # sampling_params.n > 1: the first sample prefills the shared prompt; its siblings wait for the copy
    followers: list["Generation"] = field(default_factory=list)
    leader: "Generation | None" = None
    drafter: NgramDrafter | None = None  # n-gram index of prompt + output (greedy speculative decoding)
    draft: list[int] = field(default_factory=list)  # this step's draft tokens, verified after its forward

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def pending(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt (+ output after a retract) at first, then the last one."""
        if self.output and self.cached == len(self.prompt) + len(self.output) - 1:
            return self.output[-1:]  # decoding: no copy of prompt + output every step
        return self.tokens[self.cached :]

    def stop_reason(
        self, token: int, eos_ids: set[int], context_len: int, decode: Callable[[list[int]], str]
    ) -> dict | None:
        """Why the request stops after taking `token` (its finish_reason), None while it goes on. With stop
        strings, `text` becomes its output decoded so far, cut before a matched one."""
        p = self.params
        stops = p.stop_strings()
        if stops:  # decoding every step costs O(n) per token: only when stop strings need it
            self.text = decode(self.output)
        if len(self.output) >= p.min_new_tokens:
            if not p.ignore_eos and token in eos_ids:
                return {"type": "stop", "matched": token}
            if p.stop_token_ids and token in p.stop_token_ids:
                return {"type": "stop", "matched": token}
            for stop in stops:
                at = self.text.find(stop)
                if stop and at >= 0:
                    self.text = self.text[:at]
                    return {"type": "stop", "matched": stop}
        if len(self.output) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(self.prompt) + len(self.output) >= context_len:  # the context is full
            return {"type": "length", "length": len(self.output)}
        return None

    def kv_slot(self) -> int:
        """The KV slot of a request the scheduler admitted; RuntimeError when it holds none (a scheduler bug)."""
        if self.slot is None:
            raise RuntimeError(f"request {self.rid} runs without a KV slot")
        return self.slot

    @property
    def awaiting_prefix(self) -> bool:
        return self.leader is not None

    def set_prompt_logprobs(self, rows: torch.Tensor) -> None:
        """From the logits of the prompt's positions: log p(prompt[i] | prompt[:i]) for i >= logprob_start_len
        (the first token has none)."""
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        self.input_logprobs = [
            None if i == 0 else float(logprobs[i - 1, self.prompt[i]])
            for i in range(self.logprob_start_len, len(self.prompt))
        ]

    def note_version(self, version: str) -> None:
        index = len(self.output) - 1
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = index + 1
        else:
            self.spans.append({"version": version, "start": index, "end": index + 1})


def still_waiting(req: Generation) -> list[Generation]:
    """A queued request, or in place of an aborted leader its unfinished siblings, each on its own now."""
    if not req.finished:
        return [req]
    for f in req.followers:
        f.leader = None
    return [f for f in req.followers if not f.finished]


def share_prompts(requests: list[Generation]) -> list[list[Generation]]:
    """Requests with the same prompt (the n samples of one, or a batch that repeats it, as a rollout sends
    a GRPO group) become one group: the first leads (prefills the prompt), the others follow (copy its KV).
    Returns the groups, each leader first, in order of first appearance."""
    groups: dict[tuple[int, ...], list[Generation]] = {}
    for req in requests:
        groups.setdefault(tuple(req.prompt), []).append(req)
    for leader, *followers in groups.values():
        leader.followers = followers
        for follower in followers:
            follower.leader = leader
    return list(groups.values())


_rid_counter = itertools.count()


def new_rid() -> str:
    return f"req-{int(time.time() * 1000)}-{next(_rid_counter)}"

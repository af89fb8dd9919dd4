"""The scheduler's side of n-gram speculative decoding (speculation.py): which of a step's decoding requests
draft, how many tokens each drafts, and what the forward pass accepted of their drafts, counted for the
engine's metrics. The scheduler appends the drafts to those requests' inputs and takes the accepted tokens."""

from __future__ import annotations

import torch

from services.engine.request import Generation
from services.engine.sampling import GREEDY_BELOW
from services.engine.speculation import DraftSources, NgramDrafter, SharedNgrams, accept_greedy, draft_sizes


class GreedyDrafting:
    def __init__(self, num_draft_tokens: int = 0, draft_budget: int = 64):
        """At most `num_draft_tokens` drafts per request (0: none drafts) and `draft_budget` per step."""
        self.num_draft_tokens, self.draft_budget = num_draft_tokens, draft_budget
        self.drafted = self.accepted = 0  # draft tokens verified, and of them accepted, since start
        self.ngrams = SharedNgrams()  # every drafted request's n-grams (speculation.py)
        self.sources = DraftSources()  # how often each kind of n-gram match is accepted

    def drafter(self, req: Generation) -> NgramDrafter | None:
        """Greedy requests without per-token alternatives or EOS bans are drafted: their drafter, its index
        brought up to date here; None for the others, which decode one token a step."""
        p = req.params
        if (
            not self.num_draft_tokens
            or p.temperature >= GREEDY_BELOW
            or req.top_logprobs_num
            or len(req.output) < p.min_new_tokens
        ):
            return None
        if req.drafter is None:
            req.drafter = NgramDrafter(shared=self.ngrams, sources=self.sources)
            req.drafter.extend(req.prompt)
        req.drafter.extend(req.output[len(req.drafter.tokens) - len(req.prompt) :])
        return req.drafter

    def draft(self, drafting: list[tuple[Generation, NgramDrafter]], slot_len: int) -> None:
        """Each drafting request's draft for this step (`req.draft`): its share of the step's budget, within what
        its max_new_tokens and its KV slot of `slot_len` tokens leave."""
        size = draft_sizes(len(drafting), self.num_draft_tokens, self.draft_budget)
        for req, drafter in drafting:
            room = min(req.params.max_new_tokens - len(req.output), slot_len - len(req.prompt) - len(req.output)) - 1
            req.draft = drafter.draft(min(size, room))

    def accept(self, reqs: list[Generation], logits: list[torch.Tensor]) -> list[tuple[list[int], list[float]]]:
        """What each request takes of its draft (speculation.accept_greedy: the accepted drafts and the bonus
        token, with their log-probs); its draft is cleared and its drafter told."""
        drafts = [req.draft for req in reqs]
        taken = accept_greedy(logits, drafts)
        for req, draft, (tokens, _) in zip(reqs, drafts, taken):
            req.draft = []
            self.drafted += len(draft)
            self.accepted += len(tokens) - 1
            if req.drafter is None:  # only a drafted request (drafter()) has a draft to verify
                raise RuntimeError(f"request {req.rid} has a draft but no drafter")
            req.drafter.verified(len(draft), len(tokens) - 1)
        return taken

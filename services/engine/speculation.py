"""N-gram speculative decoding for greedy requests: draft tokens from the request's own context, verify them
in one forward pass.

Drafting (prompt lookup decoding, Saxena 2023; SGLang's and vLLM's `ngram` speculative algorithm): find the
most recent earlier occurrence of the sequence's last n tokens (n from `max_ngram` down to 1) and propose the
k tokens that followed it. The copy may run into the tokens it proposes (`full[e + j]` with `full` = the
context followed by the draft so far), so a sequence that repeats with period p gets a whole draft of its
cycle, not the at most p tokens left after the match.

Verifying (speculative decoding, Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"): the forward pass appends [last, d_1 .. d_k] and gives logits l_0 .. l_k at those positions.
For a greedy request the accepted prefix is the longest with d_{j+1} = argmax l_j; the request then takes
those tokens and the bonus token argmax l_a after them: a + 1 tokens, each exactly the one plain greedy
decoding picks from the same logits, with log-prob log_softmax(l_j)[token]. The keys and values written for
rejected drafts lie beyond the sequence's new length: masked out, then overwritten.

Drafts come from the request's own context first and else from every greedy request's (`SharedNgrams`, as
SGLang's NGRAM cache and suffix decoding share theirs across requests): samples of one prompt, and sequences
that fall into the same phrases, draft from each other. Measured on the engine benchmark's tiny workload
(64 greedy requests): the long tail's tokens were predicted by the last three tokens 59% of the time from
their own context, 79% with the other requests' too. /flush_cache empties the shared index. A kind of match
that is rarely accepted stops drafting (`DraftSources`).

Only greedy requests are drafted: for them acceptance is a comparison and the output is the same as
without speculation (up to float rounding of the wider forward). Sampled requests decode one token a step.
"""

from __future__ import annotations

import torch


class SharedNgrams:
    """Every drafted request's n-grams: each maps to the context (a drafter's token list, which only grows)
    and end of its most recent occurrence. Emptied whole when it passes `max_entries`, so its memory (and
    the finished requests' token lists it keeps alive) stays bounded."""

    def __init__(self, max_entries: int = 1 << 18):
        self.max_entries = max_entries
        self.grams: dict[int, tuple[list[int], int]] = {}  # gram key (NgramDrafter.extend) -> occurrence

    def clear(self) -> None:
        self.grams.clear()


class DraftSources:
    """How often each source's drafts are accepted: a source is the request's own context or another
    request's (`SharedNgrams`), at the n-gram length that matched. Accepted and drafted tokens are kept as
    moving sums (each verify decays them by 1 - ALPHA); a source whose acceptance is under MIN_ACCEPTANCE
    drafts only on every RETRY_EVERY-th chance, so it is noticed if it improves.

    Why: a draft token costs a forward row whether it is accepted or not. Per source, over one round of the
    engine benchmark's workload: with the small preset (compute-bound) drafts from another request's context
    matched on one token were accepted 1 time in 177 in the wide part of the batch and 0 in 116 in its long
    tail, ~5% of the round's rows, while the request's own 3-gram matches were accepted 84-85% of the time;
    with the tiny preset the same source was accepted 14-21% of the time (rows there are cheap, steps are
    not), so the cut-off is a low one and learnt per engine rather than a fixed list of sources."""

    MIN_ACCEPTANCE, RETRY_EVERY, ALPHA = 0.1, 8, 0.1

    def __init__(self):
        self._sums: dict[tuple[str, int], list[float]] = {}  # source -> [accepted, drafted], decayed
        self._declined: dict[tuple[str, int], int] = {}

    def allow(self, source: tuple[str, int]) -> bool:
        rate = self.acceptance(source)
        if rate is None or rate >= self.MIN_ACCEPTANCE:
            return True
        self._declined[source] = n = self._declined.get(source, 0) + 1
        return n % self.RETRY_EVERY == 0

    def record(self, source: tuple[str, int], drafted: int, accepted: int) -> None:
        sums = self._sums.setdefault(source, [0.0, 0.0])
        sums[0] = (1 - self.ALPHA) * sums[0] + accepted
        sums[1] = (1 - self.ALPHA) * sums[1] + drafted

    def acceptance(self, source: tuple[str, int]) -> float | None:
        sums = self._sums.get(source)
        return sums[0] / sums[1] if sums and sums[1] else None


class NgramDrafter:
    """The n-gram index of one request's context (prompt + output), extended as tokens are accepted.

    `_seen[n]` maps each n-gram to the end (exclusive) of its most recent occurrence; `_previous[n]` is,
    for the context's current last n-gram, the end of the occurrence before it (None if there is none), and
    `_elsewhere[n]` its most recent occurrence in another request's context (`shared`, None if none).
    Appending a token is O(max_ngram) dict operations, drafting O(k): no scan of the context."""

    def __init__(self, max_ngram: int = 3, shared: SharedNgrams | None = None, sources: DraftSources | None = None):
        if not 1 <= max_ngram <= 15:  # a gram's length is kept in 4 bits of its SharedNgrams key
            raise ValueError(f"max_ngram must be in [1, 15], got {max_ngram}")
        self.max_ngram = max_ngram
        self.shared, self.sources = shared, sources
        self.source: tuple[str, int] | None = None  # where the last draft came from
        self.tokens: list[int] = []
        self._seen: list[dict[int, int]] = [{} for _ in range(max_ngram + 1)]
        self._previous: list[int | None] = [None] * (max_ngram + 1)
        self._elsewhere: list[tuple[list[int], int] | None] = [None] * (max_ngram + 1)

    def extend(self, tokens) -> None:
        # the engine thread's hottest Python (a prompt and every accepted token, at each of max_ngram
        # lengths): a gram is keyed by an int, its token ids in 32-bit fields, which hashes several times
        # faster than a tuple (SharedNgrams' keys also carry the length in their low 4 bits)
        own, seen, previous, elsewhere = self.tokens, self._seen, self._previous, self._elsewhere
        shared = self.shared
        grams = shared.grams if shared is not None else None
        max_entries = shared.max_entries if shared is not None else 0  # read once: this loop is hot
        for token in tokens:
            own.append(token)
            end = len(own)
            key = 0
            for n in range(1, min(self.max_ngram, end) + 1):
                key |= own[end - n] << (32 * (n - 1))
                index = seen[n]
                previous[n] = index.get(key)
                index[key] = end
                if grams is not None:
                    if len(grams) >= max_entries:
                        grams.clear()
                    tagged = key << 4 | n
                    before = grams.get(tagged)
                    grams[tagged] = (own, end)
                    elsewhere[n] = before if before is not None and before[0] is not own else None

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the context's tail ([] if none, or if
        `sources` finds that kind of match rarely accepted); at one length a match in the request's own
        context goes first."""
        self.source = None
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(self.tokens)), 0, -1):
            start = self._previous[n]
            elsewhere = self._elsewhere[n]
            if start is None and (elsewhere is None or elsewhere[1] >= len(elsewhere[0])):
                continue
            self.source = ("own" if start is not None else "shared", n)
            if self.sources is not None and not self.sources.allow(self.source):
                self.source = None
                return []
            if start is None:
                assert elsewhere is not None  # a match elsewhere, or the loop went on above
                context, end = elsewhere
                return context[end : end + k]
            full = self.tokens
            draft: list[int] = []
            for j in range(k):
                at = start + j
                draft.append(full[at] if at < len(full) else draft[at - len(full)])
            return draft
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        """How many of the last draft's tokens the verify accepted (for `sources`)."""
        if self.sources is not None and self.source is not None and drafted:
            self.sources.record(self.source, drafted, accepted)


def draft_sizes(eligible: int, max_draft: int, budget: int) -> int:
    """Draft tokens per eligible request this step: the step's extra rows are capped at `budget` (a verify
    row costs a decode row's compute: a wide batch gains little from long drafts, a narrow one, the long
    tail of a batch, gains most), at most `max_draft` each."""
    if eligible <= 0:
        return 0
    return max(1, min(max_draft, budget // eligible))


def accept_greedy(logits: list[torch.Tensor], drafts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """The tokens each greedy request takes from one verify pass and their log-probs (one argmax and one
    log-softmax for all requests of the step).

    logits[i]: [len(drafts[i]) + 1, vocab], the logits after request i's last accepted token and after each
    of its draft tokens. Returns per request its accepted drafts followed by the bonus token (at least one
    token), and log_softmax(l_j)[token_j] for each."""
    stacked = torch.cat(logits).float()
    best = stacked.argmax(dim=-1)
    logprobs = torch.log_softmax(stacked, dim=-1).gather(-1, best[:, None])[:, 0].tolist()
    picks = best.tolist()
    out, at = [], 0
    for draft in drafts:
        accepted = 0
        while accepted < len(draft) and draft[accepted] == picks[at + accepted]:
            accepted += 1
        out.append((picks[at : at + accepted + 1], logprobs[at : at + accepted + 1]))
        at += len(draft) + 1
    return out

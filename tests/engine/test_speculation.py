"""N-gram speculative decoding: the drafter, greedy acceptance, and a scheduler with speculation giving exactly
what plain greedy decoding gives, in fewer steps."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.request import Generation
from services.engine.sampling import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.speculation import DraftSources, NgramDrafter, SharedNgrams, accept_greedy, draft_sizes
from services.engine.batched_decoder import BatchedDecoder
from services.engine.kv_pool import KVPool
from services.model.loading import load_causal_lm


def test_drafter_copies_what_followed_the_latest_longest_match():
    d = NgramDrafter(max_ngram=3)
    d.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert d.draft(2) == [7, 5]  # the latest earlier [1, 2, 3] was followed by 7, 5
    assert d.draft(0) == []
    d.extend([4])  # [2, 3, 4], [3, 4] and [4] never occurred before
    assert d.draft(3) == []
    d.extend([8, 3])  # no earlier [4, 8, 3] or [8, 3]; the latest earlier [3] was followed by 4, 8
    assert d.draft(2) == [4, 8]


def test_grams_of_different_lengths_and_large_ids_are_told_apart():
    """Grams are keyed by their ids packed into an int: a gram with id 0 in front is not the shorter gram,
    and ids up to 2**32 - 1 do not run into each other."""
    big = (1 << 32) - 1
    d = NgramDrafter(max_ngram=2)
    d.extend([0, 5, 11, big, 5, 12, 7, 0, 5])
    assert d.draft(1) == [11]  # the latest earlier [0, 5] was followed by 11, though [5] last by 12
    d.extend([big])
    assert d.draft(1) == [5]  # [5, big] never occurred (only [11, big]); the earlier [big] was followed by 5
    shared = SharedNgrams()
    a, b = NgramDrafter(max_ngram=2, shared=shared), NgramDrafter(max_ngram=2, shared=shared)
    a.extend([3, 0, 4, 8])
    b.extend([9, 4])  # [9, 4] is nowhere; [4] is in a's context, followed by 8
    assert b.draft(1) == [8] and b.source == ("shared", 1)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramDrafter(max_ngram=16)


def test_drafter_runs_into_its_own_draft_on_a_cycle():
    d = NgramDrafter()
    d.extend([5, 6, 5, 6])
    # the match [5, 6] ends two tokens back: the copy continues through the draft itself
    assert d.draft(5) == [5, 6, 5, 6, 5]
    d2 = NgramDrafter()
    d2.extend([7, 7, 7])
    assert d2.draft(4) == [7, 7, 7, 7]


def test_drafter_falls_back_to_another_requests_context():
    shared = SharedNgrams()
    a, b = NgramDrafter(shared=shared), NgramDrafter(shared=shared)
    a.extend([1, 2, 3, 4, 5, 6])
    b.extend([9, 2, 3])
    assert b.draft(3) == [4, 5, 6]  # [2, 3] never occurred in b before: a's continuation
    assert b.draft(9) == [4, 5, 6]  # a foreign copy stops at the end of that context
    b.extend([8, 9])
    assert b.draft(2) == [2, 3]  # b's own earlier [9] goes before a's nothing
    a.extend([9, 2, 3, 7])
    b.extend([2, 3])
    assert b.draft(1) == [8]  # own [9, 2, 3] (followed by 8) before a's later [9, 2, 3] (followed by 7)
    c = NgramDrafter()  # not sharing: sees only itself
    c.extend([2, 3])
    assert c.draft(3) == []


def test_shared_ngrams_stay_bounded_and_clear():
    shared = SharedNgrams(max_entries=10)
    a, b = NgramDrafter(shared=shared), NgramDrafter(shared=shared)
    a.extend(range(100, 200))
    assert len(shared.grams) <= 10
    a.extend([1, 2, 3])
    b.extend([1, 2])
    assert b.draft(1) == [3]
    shared.clear()
    c = NgramDrafter(shared=shared)
    c.extend([1, 2])
    assert c.draft(1) == []


def test_a_rarely_accepted_source_drafts_only_now_and_then_until_it_improves():
    sources = DraftSources()
    poor, good = ("shared", 1), ("own", 3)
    assert sources.allow(poor) and sources.acceptance(poor) is None  # unknown: drafted
    for _ in range(5):
        sources.record(poor, drafted=4, accepted=0)
        sources.record(good, drafted=4, accepted=3)
    assert sources.acceptance(poor) == 0.0 and abs(sources.acceptance(good) - 0.75) < 1e-9
    every = DraftSources.RETRY_EVERY
    allowed = [sources.allow(poor) for _ in range(3 * every)]
    assert allowed.count(True) == 3 and allowed[every - 1] and all(sources.allow(good) for _ in range(20))
    for _ in range(3):  # its retries are accepted again: it drafts every time once over the cut-off
        sources.record(poor, drafted=4, accepted=4)
    assert sources.acceptance(poor) > DraftSources.MIN_ACCEPTANCE and sources.allow(poor)


def test_the_drafter_names_its_source_and_skips_a_declined_one():
    sources, shared = DraftSources(), SharedNgrams()
    a = NgramDrafter(shared=shared, sources=sources)
    b = NgramDrafter(shared=shared, sources=sources)
    a.extend([1, 2, 3, 4, 5, 6])
    b.extend([9, 5])
    assert b.draft(2) == [6] and b.source == ("shared", 1)
    b.verified(1, 0)
    for _ in range(4):
        sources.record(("shared", 1), drafted=8, accepted=0)
    assert b.draft(2) == [] and b.source is None  # declined: no draft rows for that kind of match
    a.extend([1, 2, 3])
    assert a.draft(3) == [4, 5, 6] and a.source == ("own", 3)  # its own 3-gram: still drafted
    a.verified(3, 3)
    assert sources.acceptance(("own", 3)) == 1.0
    assert NgramDrafter().draft(0) == [] and NgramDrafter().source is None


def test_draft_sizes_share_the_step_budget():
    assert draft_sizes(0, 8, 64) == 0
    assert draft_sizes(4, 8, 64) == 8  # capped per request
    assert draft_sizes(32, 8, 64) == 2
    assert draft_sizes(100, 8, 64) == 1  # never less than one


def test_accept_greedy_takes_the_agreeing_prefix_and_the_bonus_token():
    vocab = 6

    def rows(argmaxes):
        out = torch.full((len(argmaxes), vocab), -1.0)
        for i, a in enumerate(argmaxes):
            out[i, a] = 2.0
        return out

    first, second, third = rows([3, 4, 1]), rows([2, 2]), rows([0, 5, 5])
    result = accept_greedy([first, second, third], [[3, 4], [1], [0, 5]])
    assert result[0][0] == [3, 4, 1]  # both drafts agree: two accepted and the bonus
    assert result[1][0] == [2]  # the first draft disagrees: only the model's own token
    assert result[2][0] == [0, 5, 5]
    expected = torch.log_softmax(first[0], -1)[3].item()
    assert result[0][1][0] == pytest.approx(expected)
    assert all(len(tokens) == len(logprobs) for tokens, logprobs in result)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def _run(loaded, drafts: int, prompts: list[list[int]], **params) -> tuple[Scheduler, list[Generation]]:
    model, tokenizer = loaded
    cfg = model.config
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, 8, 160)
    sched = Scheduler(BatchedDecoder(model, pool), tokenizer, num_draft_tokens=drafts, draft_budget=16)
    p = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 60, **params}
    reqs = [
        Generation(rid=f"r{i}", prompt=list(prompt), params=SamplingParams(**p), on_update=lambda r: None)
        for i, prompt in enumerate(prompts)
    ]
    for req in reqs:
        sched.submit([req])
    for _ in range(1000):
        if not (sched.waiting or sched.running):
            return sched, reqs
        sched.step()
    raise AssertionError("the scheduler did not finish")


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randrange(3, 200) for _ in range(rng.randint(5, 30))] for _ in range(count - 2)]
    return out + [[11, 12, 13] * 8, [40, 41] * 10]  # repetitive prompts: drafts from the start


def test_speculative_greedy_equals_plain_greedy_in_fewer_steps(loaded):
    prompts = _prompts(10)
    plain, plain_reqs = _run(loaded, 0, prompts)
    spec, spec_reqs = _run(loaded, 8, prompts)
    assert spec.speculation.drafted > 0 and spec.speculation.accepted > 0
    assert plain.speculation.drafted == 0
    assert spec.steps < plain.steps
    for a, b in zip(plain_reqs, spec_reqs):
        assert b.output == a.output
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert b.finish_reason == a.finish_reason == {"type": "length", "length": 60}
        assert b.spans == a.spans
    assert spec.pool.free_slots == spec.pool.slots  # every slot given back


def test_speculation_stops_where_plain_decoding_stops(loaded):
    prompts = _prompts(6, seed=1)
    plain, plain_reqs = _run(loaded, 0, prompts, max_new_tokens=40)
    # a stop token the plain run meets mid-way through a request's output
    stop = plain_reqs[-1].output[17]
    plain, plain_reqs = _run(loaded, 0, prompts, max_new_tokens=40, stop_token_ids=[stop])
    spec, spec_reqs = _run(loaded, 8, prompts, max_new_tokens=40, stop_token_ids=[stop])
    assert spec.speculation.accepted > 0
    for a, b in zip(plain_reqs, spec_reqs):
        assert b.output == a.output and b.finish_reason == a.finish_reason
    assert any(r.finish_reason["type"] == "stop" for r in spec_reqs)
    short, short_reqs = _run(loaded, 8, prompts, max_new_tokens=3)
    assert all(len(r.output) == 3 for r in short_reqs)


def test_sampled_requests_are_not_drafted(loaded):
    spec, reqs = _run(loaded, 8, _prompts(4), temperature=1.0, max_new_tokens=20)
    assert spec.speculation.drafted == 0
    assert all(len(r.output) == 20 for r in reqs)

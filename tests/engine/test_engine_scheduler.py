"""The engine's scheduler in this process (no HTTP, no engine thread), stepped by hand: admission into KV
slots, chunked prefill, the n samples of a prompt sharing one prefill, retract and abort."""

from __future__ import annotations

import pytest

from services.engine.batched_decoder import BatchedDecoder
from services.engine.kv_pool import KVPool
from services.model.loading import load_causal_lm
from services.engine.request import Generation, share_prompts
from services.engine.sampling import SamplingParams
from services.engine.scheduler import Scheduler


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


def _scheduler(loaded, slots: int = 8, chunk: int = 4096) -> tuple[Scheduler, list[int]]:
    model, tokenizer = loaded
    cfg = model.config
    pool = KVPool(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, slots, 128
    )
    sched = Scheduler(BatchedDecoder(model, pool), tokenizer, chunked_prefill_size=chunk)
    forwarded: list[int] = []
    real = sched.decoder.forward

    def counting(slots_, chunks, full=None):
        forwarded.append(sum(len(c) for c in chunks))
        return real(slots_, chunks, full)

    sched.decoder.forward = counting
    return sched, forwarded


def _group(prompt, rid="r", n=1, **params) -> list[Generation]:
    """n requests for one prompt, named as the engine names the children of sampling_params.n."""
    p = SamplingParams(**{"temperature": 0, "ignore_eos": True, **params})
    reqs = [
        Generation(rid=rid if n == 1 else f"{rid}-{i}", prompt=list(prompt), params=p, on_update=lambda r: None)
        for i in range(n)
    ]
    [group] = share_prompts(reqs)
    return group


def _run(sched: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not (sched.waiting or sched.running):
            return
        sched.step()
    raise AssertionError("the scheduler did not finish")


def test_n_samples_prefill_their_prompt_once(loaded):
    sched, forwarded = _scheduler(loaded)
    prompt = list(range(10, 40))
    group = _group(prompt, max_new_tokens=5, n=4, temperature=1.0)
    sched.submit(group)
    sched.step()
    assert forwarded == [30]  # one prefill of 30 tokens, not four
    assert all(len(g.output) == 1 for g in group)
    _run(sched)
    assert forwarded[1:] == [4] * 4 and [len(g.output) for g in group] == [5] * 4
    assert [g.rid for g in group] == ["r-0", "r-1", "r-2", "r-3"]
    assert sched.pool.free_slots == sched.pool.slots


def test_greedy_siblings_equal_a_lone_request(loaded):
    sched, _ = _scheduler(loaded)
    prompt = [5, 17, 300, 2]
    group, lone = _group(prompt, "g", max_new_tokens=8, n=3), _group(prompt, "x", max_new_tokens=8)
    sched.submit(group)
    sched.submit(lone)
    _run(sched)
    assert [g.output for g in group] == [lone[0].output] * 3


def test_long_prompts_are_prefilled_in_chunks_next_to_decodes(loaded):
    sched, forwarded = _scheduler(loaded, chunk=16)
    short = _group([1, 2, 3], "s", max_new_tokens=6)
    sched.submit(short)
    sched.step()
    sched.submit(_group(list(range(40, 90)), "long", max_new_tokens=2))
    _run(sched)
    # the short request keeps decoding (1 token a step) while the 50-token prompt goes in chunks of 16
    assert forwarded[:5] == [3, 1 + 16, 1 + 16, 1 + 16, 1 + 2]


def test_full_pool_makes_requests_wait_and_never_drops_one(loaded):
    sched, _ = _scheduler(loaded, slots=2)
    groups = [_group([7, i + 1], f"r{i}", max_new_tokens=3) for i in range(5)]
    for g in groups:
        sched.submit(g)
    sched.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    _run(sched)
    assert all(len(g[0].output) == 3 and g[0].finish_reason["type"] == "length" for g in groups)


def test_a_group_larger_than_the_pool_still_finishes(loaded):
    sched, _ = _scheduler(loaded, slots=2)
    group = _group([4, 5, 6], max_new_tokens=3, n=5)
    sched.submit(group)
    _run(sched)
    assert [len(g.output) for g in group] == [3] * 5


def test_retract_keeps_tokens_and_recomputes_kv(loaded):
    sched, _ = _scheduler(loaded)
    ref = _group([9, 8, 7], "ref", max_new_tokens=8)
    sched.submit(ref)
    _run(sched)
    group = _group([9, 8, 7], "g", max_new_tokens=8, n=2)
    sched.submit(group)
    for _ in range(3):
        sched.step()
    sched.pause("retract")
    assert not sched.running and all(g.slot is None for g in group) and len(sched.waiting) == 2
    sched.resume()
    _run(sched)
    assert [g.output for g in group] == [ref[0].output] * 2  # greedy: the same tokens after recomputing


def test_abort_of_a_leader_before_its_prefill_requeues_its_siblings(loaded):
    sched, _ = _scheduler(loaded, chunk=4)
    group = _group(list(range(100, 120)), "g", max_new_tokens=2, n=3)
    sched.submit(group)
    sched.step()  # the leader has 4 of its 20 prompt tokens; its siblings wait for the copy
    assert sched.abort("g-0") == 1
    _run(sched)
    assert group[0].finish_reason["type"] == "abort"
    assert [len(g.output) for g in group[1:]] == [2, 2]
    assert sched.pool.free_slots == sched.pool.slots


def test_context_full_finishes_with_length(loaded):
    sched, _ = _scheduler(loaded)
    long = _group(list(range(1, 120)), max_new_tokens=50)
    sched.submit(long)
    _run(sched)
    assert long[0].finish_reason == {"type": "length", "length": 9}  # 119 + 9 = 128 positions
    assert len(long[0].tokens) == sched.pool.slot_len

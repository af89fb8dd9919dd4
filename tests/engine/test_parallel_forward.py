"""A step's forward split over CPU threads (`--forward-workers`): where it cuts, that the split step computes
what the whole one does, and that an engine started with it generates as one without it."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from services.engine.parallel_forward import (
    MIN_SPLIT_SEQS,
    MIN_SPLIT_TOKENS,
    ParallelForward,
    StrategyChooser,
    split_points,
    step_kind,
)
from services.engine.config import EngineConfig
from services.engine.request import Generation, share_prompts
from services.engine.sampling import SamplingParams
from services.engine.server import make_pool, make_scheduler
from services.engine.batched_decoder import BatchedDecoder
from services.model.loading import load_causal_lm
from tests.engine.conftest import start_engine


def test_a_narrow_step_is_not_split():
    assert split_points([1] * (MIN_SPLIT_SEQS - 1) + [MIN_SPLIT_TOKENS], 2) == []  # too few sequences
    assert split_points([1] * (MIN_SPLIT_TOKENS - 1), 2) == []  # too few tokens
    assert split_points([2] * 64, 1) == []


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_cuts_balance_tokens_and_leave_no_part_empty(workers):
    rng = random.Random(workers)
    for _ in range(200):
        lengths = [rng.choice([1, 1, 2, 9, 40, 300]) for _ in range(rng.randint(MIN_SPLIT_SEQS, 70))]
        cuts = split_points(lengths, workers)
        if sum(lengths) < MIN_SPLIT_TOKENS:
            assert cuts == []
        if not cuts:  # too narrow, or the last sequences hold most tokens: the step runs whole
            continue
        assert cuts == sorted(set(cuts)) and 0 < cuts[0] and cuts[-1] < len(lengths) and len(cuts) < workers
        parts = [sum(lengths[a:b]) for a, b in zip([0, *cuts], [*cuts, len(lengths)])]
        # no part exceeds its share by more than its last sequence
        assert max(parts) <= sum(lengths) / workers + max(lengths)


def test_uniform_decode_steps_split_evenly():
    assert split_points([1] * 64, 2) == [32]
    assert split_points([2] * 64, 4) == [16, 32, 48]


def _decoder(model_dir):
    model, tokenizer = load_causal_lm(model_dir)
    return BatchedDecoder(model, make_pool(model, EngineConfig(model=model_dir, max_running=32))), tokenizer


class Always:
    """A StepStrategy that always answers `how`, and keeps what was recorded."""

    def __init__(self, how: str):
        self.how, self.records = how, []

    def pick(self, kind: tuple, ways: tuple[str, ...]) -> str:
        return self.how if self.how in ways else "whole"

    def record(self, kind: tuple, how: str, seconds_per_token: float) -> None:
        self.records.append((kind, how, seconds_per_token))


def _drive(chooser: StrategyChooser, kind: tuple, ways: tuple, cost: dict, steps: int) -> list[str]:
    picks = []
    for _ in range(steps):
        how = chooser.pick(kind, ways)
        picks.append(how)
        chooser.record(kind, how, cost[how])
    return picks


def test_the_chooser_tries_ways_in_prior_order_then_runs_the_fastest_and_keeps_checking():
    chooser, kind, ways = StrategyChooser(), (False, 7, True), ("split", "whole", "one")
    picks = _drive(chooser, kind, ways, {"one": 3.0, "split": 2.0, "whole": 1.0}, 96)
    assert picks[:3] == ["split", "whole", "one"]  # whole beat the prior's first: the prior is wrong, try on
    every = StrategyChooser.EXPLORE_EVERY  # then the others only to check, in turn, on every n-th step of the kind
    assert picks[3:].count("whole") == sum(1 for n in range(4, 97) if n % every)
    assert picks[3:].count("split") >= 2 and picks[3:].count("one") >= 2
    picks = _drive(chooser, kind, ways, {"one": 3.0, "split": 0.5, "whole": 1.0}, 256)  # the machine changed
    assert picks[-10:].count("split") >= 9
    assert chooser.pick((True, 11, True), ways) in ways  # another kind starts from scratch
    assert set(_drive(chooser, (False, 5, False), ("whole", "one"), {"one": 1.0, "whole": 2.0}, 40)) == {"one", "whole"}


def test_the_chooser_stops_warming_up_where_the_prior_order_holds():
    chooser, kind, ways = StrategyChooser(), (True, 12, True), ("split", "whole", "one")
    picks = _drive(chooser, kind, ways, {"split": 1.0, "whole": 2.0, "one": 2.5}, 20)
    assert picks[:3] == ["split", "whole", "split"]  # whole lost to split: one thread, slower still, is not tried
    every = StrategyChooser.EXPLORE_EVERY
    assert picks.count("one") == 1 and picks[every - 1] == "one"  # until the kind's first exploring step
    assert picks.count("split") == 20 - 2


def test_step_kinds_separate_prompt_chunks_and_sizes():
    assert step_kind([1] * 64) == (False, 7, 7)
    assert step_kind([2] * 64) == (False, 8, 7)
    assert step_kind([1] * 63 + [40]) == (True, 7, 7)
    assert step_kind([8] * 3) == (False, 5, 2) != step_kind([1] * 24)


@pytest.mark.parametrize("how", ["split", "whole", "one"])
def test_a_step_on_two_workers_computes_what_one_worker_does(tiny_model_dir, how):
    whole, _ = _decoder(tiny_model_dir)
    strategy = Always(how)
    split = ParallelForward(_decoder(tiny_model_dir)[0], workers=2, strategy=strategy)
    rng = random.Random(0)
    vocab = whole.hf.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(20)]
    step = [[rng.randrange(vocab) for _ in range(1 + 2 * (i % 4))] for i in range(20)]  # decodes, some with drafts
    slots = list(range(20))
    outputs = {}
    for name, decoder in (("whole", whole), ("split", split)):  # a prefill step of every prompt, then `step`
        outputs[name] = [
            decoder.forward(slots, prompts, [i % 3 == 0 for i in range(20)]),
            decoder.forward(slots, step, [len(t) > 1 for t in step]),
        ]
    for (last_w, full_w), (last_s, full_s) in zip(outputs["whole"], outputs["split"]):
        torch.testing.assert_close(last_s, last_w, rtol=1e-5, atol=1e-5)
        assert full_s.keys() == full_w.keys() and full_w
        for i in full_w:
            torch.testing.assert_close(full_s[i], full_w[i], rtol=1e-5, atol=1e-5)
    assert split.pool.lengths[:20] == whole.pool.lengths[:20]
    assert {h for _, h, _ in strategy.records} == {how} and all(t > 0 for _, _, t in strategy.records)
    assert all(kind[2] for kind, _, _ in strategy.records)  # both steps could be split
    split.close()


def _greedy_outputs(model_dir, workers: int, workload) -> list[list[int]]:
    model, tokenizer = load_causal_lm(model_dir)
    config = EngineConfig(model=model_dir, forward_workers=workers)
    sched = make_scheduler(BatchedDecoder(model, make_pool(model, config)), tokenizer, config)
    gens = [
        Generation(
            rid=f"r{i}",
            prompt=p,
            on_update=lambda g: None,
            params=SamplingParams(max_new_tokens=m, temperature=0, ignore_eos=True),
        )
        for i, (p, m) in enumerate(workload)
    ]
    for group in share_prompts(gens):
        sched.submit(group)
    while sched.waiting or sched.running:
        sched.step()
    return [g.output for g in gens]


def test_a_scheduler_with_two_workers_generates_what_one_does(tiny_model_dir):
    rng = random.Random(1)
    workload = [
        ([rng.randrange(3, 200) for _ in range(rng.randint(4, 30))], rng.choice([8, 16, 48])) for _ in range(24)
    ]
    assert _greedy_outputs(tiny_model_dir, 2, workload) == _greedy_outputs(tiny_model_dir, 1, workload)


def test_forward_workers_are_for_cpu_engines():
    with pytest.raises(ValueError, match="forward_workers"):
        EngineConfig(model="m", device="cuda", forward_workers=2)


def test_an_engine_with_two_forward_workers_answers_as_one_without(tiny_model_dir, tmp_path):
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(4, 30))] for _ in range(16)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    answers = []
    for workers in ("1", "2"):
        proc, url = start_engine(tiny_model_dir, tmp_path, "--forward-workers", workers)
        try:
            r = httpx.post(url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append([a["output_ids"] for a in r.json()])
        finally:
            proc.stop()
    assert answers[0] == answers[1] and all(len(ids) == 24 for ids in answers[0])


def test_a_step_whose_part_fails_raises_after_every_part_ended(tiny_model_dir):
    split = ParallelForward(_decoder(tiny_model_dir)[0], workers=2)
    too_long = [3] * (split.pool.slot_len + 1)
    # the overflowing sequence in the calling thread's part, then in the worker's
    for prompts in ([too_long] + [[3] * 8] * 15, [[3] * 200] * 15 + [too_long]):
        assert split_points([len(p) for p in prompts], 2), "the step must be split for this test"
        with pytest.raises(ValueError, match="context length"):
            split.forward(list(range(16)), prompts)
        assert not split._executor._work_queue.qsize()  # nothing of the failed step still queued
    split.close()

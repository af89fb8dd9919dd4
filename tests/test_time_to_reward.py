"""benchmarks/time_to_reward.py's parts that decide what is compared, without running the benchmark: the two task
shapes (rows, held-out split, the short task's partial-credit reward as the Sluice rollout imports it), the mini
preset's size, per-task flags, the TRL process getting every thread it is given while this process is pinned,
and the ratios against both baselines. No timing here: the benchmark itself runs on an idle machine
(docs/performance.md)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ttr_args  # noqa: E402
import ttr_summary  # noqa: E402
import ttr_tasks  # noqa: E402
from trl_grpo import TrlSpec, trl_env  # noqa: E402


def test_position_credit_gives_partial_credit_by_position():
    score = ttr_tasks.position_credit
    assert score(" c a d", {"label": "c a d"}) == 1.0
    assert score("c a b", {"label": "c a d"}) == pytest.approx(2 / 3)
    assert score("c a d m", {"label": "c a d"}) == pytest.approx(3 / 4)  # an extra word costs like a wrong one
    assert score("c", {"label": "c a d"}) == pytest.approx(1 / 3)
    assert score("a d c", {"label": "c a d"}) == 0.0
    assert score("", {"label": "c a d"}) == 0.0


def test_the_short_reward_loads_as_the_rollout_imports_it():
    from services.rollout.rewards import build_reward

    spec = ttr_tasks.TASKS["short"].reward_spec
    assert spec.startswith("import:")
    reward = build_reward(spec)
    assert reward._fn is ttr_tasks.position_credit


@pytest.mark.parametrize("task", sorted(ttr_tasks.TASKS))
def test_splits_hold_out_distinct_prompts_never_trained_on(task):
    train, held_out = ttr_tasks.make_splits(task, seed=3, n_train=600, n_eval=64)
    assert (len(train), len(held_out)) == (600, 64)
    held = {r["prompt"] for r in held_out}
    assert len(held) == 64 and not held & {r["prompt"] for r in train}
    if ttr_tasks.TASKS[task].distinct_train:
        assert len({r["prompt"] for r in train}) == 600
    assert ttr_tasks.make_splits(task, seed=3, n_train=600, n_eval=64) == (train, held_out)
    assert ttr_tasks.make_splits(task, seed=4, n_train=600, n_eval=64) != (train, held_out)


def test_short_rows_are_a_few_letters_reversed():
    train, _ = ttr_tasks.make_splits("short", seed=0, n_train=200, n_eval=8)
    lengths = set()
    for row in train:
        letters = row["prompt"].removeprefix("Reverse: ").split()
        assert row["label"].split() == letters[::-1]
        lengths.add(len(letters))
    assert lengths == {2, 3, 4}


def test_the_mini_preset_is_far_smaller_than_small(tmp_path):
    from transformers import AutoModelForCausalLM

    from services.model.init_model import init_model

    def params(preset: str) -> int:
        path = init_model(str(tmp_path / preset), preset=preset, seed=0)
        return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())

    mini = params("mini")
    assert 100_000 < mini < 1_000_000
    assert params("small") > 10 * mini


def test_task_flags_default_to_each_task_and_apply_to_all_when_given():
    args = ttr_args.parse_args([])
    assert args.reps == 3 and args.tasks == ["reverse", "short"]
    short, reverse = ttr_args.task_args(args, "short"), ttr_args.task_args(args, "reverse")
    assert (short.preset, short.steps, short.task) == ("mini", 300, "short")
    assert (reverse.preset, reverse.steps, reverse.thresholds) == ("small", 80, [0.6, 0.7, 0.8, 0.9])
    quick = ttr_args.parse_args(["--quick", "--lr", "0.01"])
    assert quick.reps == 1
    assert [ttr_args.task_args(quick, t).steps for t in ("reverse", "short")] == [20, 30]
    assert {ttr_args.task_args(quick, t).lr for t in ("reverse", "short")} == {0.01}
    assert ttr_args.parse_args(["--quick", "--reps", "2"]).reps == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--tasks", "letters"],
        ["--systems", "trl,vllm"],
        ["--trl-threads", "0"],
        ["--reps", "0"],
        ["--micro-batch-size", "48"],
    ],
)
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        ttr_args.parse_args(argv)
    assert argv[0] in capsys.readouterr().err  # the message names the flag


def test_the_trl_process_gets_the_threads_it_is_given_while_this_one_is_pinned(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    env = trl_env(2)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("2", "2")
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "2"


def test_trl_spec_refuses_zero_threads():
    fields = dict(
        task="short",
        warm_dir="w",
        prompts_path="p",
        workdir="d",
        steps=1,
        groups=1,
        n_samples=2,
        micro_batch_size=2,
        max_new_tokens=4,
        temperature=1.0,
        lr=1e-3,
        eval_every=1,
        seed=0,
    )
    assert TrlSpec.model_validate_json(TrlSpec(threads=2, **fields).model_dump_json()).threads == 2
    with pytest.raises(ValueError, match="threads"):
        TrlSpec(threads=0, **fields)


def _block(times: dict[str, float | None]) -> dict:
    return {"time_to_reward_s": times}


def test_ratios_name_the_strongest_baseline_at_the_highest_threshold_both_reach():
    thresholds = [0.6, 0.7, 0.8]
    sluice = _block({"0.6": 2.0, "0.7": 4.0, "0.8": 8.0})
    trl = _block({"0.6": 4.0, "0.7": 10.0, "0.8": 16.0})
    inprocess = _block({"0.6": 1.0, "0.7": 5.0, "0.8": None})
    assert ttr_summary.ratio(trl, sluice, thresholds) == {
        "threshold": 0.8,
        "sluice_s": 8.0,
        "baseline_s": 16.0,
        "sluice_over_baseline": 0.5,
    }
    strongest = ttr_summary.ratio_vs_strongest({"trl": trl, "inprocess_engine_2t": inprocess}, sluice, thresholds)
    assert strongest["against"] == "inprocess_engine_2t"
    assert (strongest["threshold"], strongest["sluice_over_baseline"]) == (0.7, 0.8)
    assert strongest["each"]["trl"]["sluice_over_baseline"] == 0.5
    # a threshold the warm start already meets (time 0) says nothing
    assert ttr_summary.ratio(_block({"0.6": 0.0}), _block({"0.6": 0.0}), [0.6]) is None

"""benchmarks/gpu_check.py and what it runs, without a GPU: deploy/one_gpu.yaml is a valid run file (and so is
the CPU smoke's version of it), the check reports every part as skipped where torch sees no CUDA device, its
figures come out of a run's steps.jsonl and a pytest junit file as documented, and the engine benchmark's
continuous-batching baseline leaves the model the other baselines share as it found it. No GPU timing here:
the check itself runs on a GPU (docs/performance.md)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

from services.front_door.run_file import load_run_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_check_run  # noqa: E402


def test_the_one_gpu_run_file_puts_engine_and_trainer_on_one_gpu():
    run = load_run_file(str(ROOT / "deploy" / "one_gpu.yaml"))
    assert (run.max_staleness, run.n_samples_per_prompt, run.rollout_batch_size, run.num_steps) == (2, 8, 32, 20)
    assert run.rollout.max_new_tokens == 128 and run.rollout.prompts.startswith("demo:")
    flags = run.stack.engine_flags
    assert (flags["device"], flags["dtype"]) == ("cuda", "bfloat16")
    assert flags["max_running"] >= run.rollout_batch_size * run.n_samples_per_prompt  # a whole step at once
    assert run.stack.role_flags["trainer"]["device"] == "cuda"
    # the trainer takes every flag the file gives it (as `sluice run` passes them), with valid values
    from services.cli import service_config
    from services.runtime.settings_cli import build_parser

    model = service_config("trainer")
    given = vars(build_parser(model, "trainer", "").parse_args(run.role_argv()["trainer"]))
    assert model(**{k: v for k, v in given.items() if v is not None}).device == "cuda"


def test_the_cpu_smoke_run_file_is_valid_and_small(tmp_path):
    path, data = gpu_check_run.write_run_file(str(tmp_path), str(tmp_path / "model"), "cpu", None)
    run = load_run_file(path)
    assert run.stack.engine_flags["device"] == "cpu" and run.stack.role_flags["trainer"]["device"] == "cpu"
    assert run.num_steps == 3 and run.stack.coordinator_port == 0
    assert run.stack.output_dir == str(tmp_path / "runs")
    # the GPU version keeps the run file's own settings, with this check's model, run dir and port
    path, _ = gpu_check_run.write_run_file(str(tmp_path), str(tmp_path / "model"), "cuda", None)
    assert (
        load_run_file(path).stack.engine_flags
        == load_run_file(str(ROOT / "deploy" / "one_gpu.yaml")).stack.engine_flags
    )


def test_without_a_gpu_every_part_is_skipped(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True and result["machine"]["cuda"] is False
    assert {name: part["status"] for name, part in result["parts"].items()} == {
        "run": "skipped",
        "engine": "skipped",
        "cuda_tests": "skipped",
    }


def test_step_figures_from_steps_jsonl():
    steps = [
        {
            "wall_time": 100.0,
            "step_s": 30.0,
            "wait_s": 25.0,
            "compute_s": 1.0,
            "publish_s": 2.0,
            "samples": 256,
            "tokens": 1000,
            "staleness_max": 0,
        }
    ]
    steps += [
        {
            "wall_time": 100.0 + 4 * i,
            "step_s": 4.0,
            "wait_s": 1.0,
            "compute_s": 2.0,
            "publish_s": 0.2,
            "samples": 256,
            "tokens": 1000,
            "staleness_max": 2,
        }
        for i in (1, 2)
    ]
    figures = gpu_check_run.step_figures(steps)
    assert figures["samples_per_s"] == 2 * 256 / 8  # the steps after the first, over their span
    assert figures["wait_fraction"] == 0.25 and figures["wait_share_of_wait_and_compute"] == pytest.approx(1 / 3, 1e-2)
    assert figures["publish_s_mean"] == 0.2 and figures["publish_fraction"] == 0.05
    assert figures["staleness_max"] == 2


def test_gpu_busy_counts_the_samples_inside_the_window():
    sampler = gpu_check_run.GpuSampler()
    sampler.samples = [(1.0, 0.0, 10.0), (2.0, 80.0, 20.0), (3.0, 60.0, 30.0), (4.0, 0.0, 40.0)]
    assert sampler.busy(2.0, 3.0) == {"busy_fraction": 0.7, "samples": 2, "memory_used_max_mib": 30}
    assert sampler.busy(None, None)["busy_fraction"] is None


def test_the_cuda_tests_are_found_and_counted(tmp_path):
    assert "tests/engine/test_engine_cuda.py" in gpu_check.cuda_test_files()
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2">'
        '<testcase classname="a" name="ok"/><testcase classname="a" name="bad"><failure/></testcase>'
        '<testcase classname="a" name="s1"><skipped/></testcase>'
        '<testcase classname="a" name="s2"><skipped/></testcase></testsuite></testsuites>'
    )
    assert gpu_check.junit_counts(str(junit)) == {
        "passed": 1,
        "failed": 1,
        "errors": 0,
        "skipped": 2,
        "failed_tests": ["a::bad"],
    }


def test_continuous_batching_runs_on_its_own_copy_of_the_model(tmp_path):
    """transformers switches the attention of the model its manager runs (5.17: to paged|sdpa, which a plain
    generate refuses); the benchmark's other baselines share the model, so the manager gets a copy."""
    from hf_baselines import hf_generate, start_continuous_batching

    from services.model.init_model import init_model
    from services.model.loading import load_causal_lm

    model, tokenizer = load_causal_lm(init_model(str(tmp_path / "m"), preset="tiny"), "float32", "cpu")
    before = model.config._attn_implementation
    workload = [{"prompt": [5, 6, 7, 8], "max_new_tokens": 4}, {"prompt": [9, 10], "max_new_tokens": 3}]
    cb, error = start_continuous_batching(model, workload)
    try:
        if cb is not None:
            assert cb.model is not model
        assert model.config._attn_implementation == before
        _, outputs = hf_generate(model, workload, tokenizer.pad_token_id or 0)  # the shared model still generates
        assert [len(o) for o in outputs] == [4, 3]
    finally:
        if cb is not None:
            cb.close()
    assert error is None or cb is None

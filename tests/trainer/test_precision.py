"""The trainer's --precision (services/trainer/precision.py) and its CUDA settings (services/trainer/device.py):
bf16-mixed trains float32 master weights from a bfloat16-autocast forward whose loss and log-probs stay close to
float32's; bf16 trains bfloat16 weights; what a backend cannot train in is refused, naming the flag."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.model.response_batch import ResponseBatch, response_logits, token_log_probs
from services.run_contract.run_config import RunConfig
from services.trainer.actor_update import actor_step
from services.trainer.backend import make_backend
from services.trainer.config import TrainerConfig
from services.trainer.critic_update import critic_step, load_critic
from services.trainer.data_parallel import DataParallel
from services.trainer.device import DeviceClock, allow_tf32
from services.trainer.optimizer import adamw
from services.trainer.precision import autocast, fsdp_compute_dtype, weights_dtype
from services.transferqueue.codec import Batch
from tests.trainer.test_actor_update import _batch

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

# bfloat16 rounds to 8 bits of mantissa: the tiny model's log-probs (~-7) move by ~1e-3 under autocast
LOG_PROB_ATOL = 2e-2
LOSS_REL = 2e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch="llama", seed=5)


def _run(model_dir: str) -> RunConfig:
    return RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        optim={"lr": 1e-3},
    )


def _one_step(model_dir: str, precision: str):
    """(model before, model after, optimizer, metrics) of one AdamW step in `precision` on the fixed batch."""
    model, _ = load_causal_lm(model_dir, weights_dtype(precision))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = adamw(model.parameters(), 1e-3, (0.9, 0.999), 0.0, "cpu")
    metrics = actor_step(model, optimizer, _batch(), _run(model_dir), 2, precision=precision)
    return before, model, optimizer, metrics


def test_the_flag_defaults_to_fp32_reads_its_env_and_refuses_an_unknown_value(monkeypatch):
    assert (TrainerConfig().precision, TrainerConfig().tf32) == ("fp32", True)
    monkeypatch.setenv("SLUICE_TRAINER_PRECISION", "bf16-mixed")
    assert TrainerConfig().precision == "bf16-mixed"
    with pytest.raises(ValidationError, match="precision"):
        TrainerConfig(precision="fp16")
    with pytest.raises(ValueError, match="unknown --precision 'fp16'"):
        weights_dtype("fp16")


def test_a_backend_refuses_a_precision_it_does_not_train_in():
    with pytest.raises(ValidationError, match="--precision bf16-mixed: the megatron backend trains in float32"):
        TrainerConfig(backend="megatron", precision="bf16-mixed")
    with pytest.raises(ValidationError, match="--fsdp-param-dtype is float16"):
        TrainerConfig(backend="fsdp", precision="bf16", fsdp_param_dtype="float16")
    assert TrainerConfig(backend="megatron").precision == "fp32"
    assert TrainerConfig(role="critic", backend="megatron", precision="bf16").precision == "bf16"  # torch critic
    with pytest.raises(ValueError, match="--precision bf16: the megatron backend"):  # before megatron is built
        make_backend("megatron", None, None, "cpu", DataParallel(), precision="bf16")


def test_fsdp_keeps_its_param_dtype_and_takes_bf16_mixed_as_its_mixed_precision():
    assert fsdp_compute_dtype("fp32", "") == ""
    assert fsdp_compute_dtype("fp32", "float16") == "float16"  # --fsdp-param-dtype as before
    assert fsdp_compute_dtype("bf16-mixed", "") == "bfloat16"
    assert fsdp_compute_dtype("bf16-mixed", "bfloat16") == "bfloat16"
    assert fsdp_compute_dtype("bf16", "") == ""  # the shards are bfloat16 already


def test_bf16_mixed_log_probs_are_float32_and_close_to_fp32s(model_dir):
    model, _ = load_causal_lm(model_dir)
    b = _batch()
    rb = ResponseBatch.build(b["tokens"], b["prompt_length"], b["response_length"])
    with torch.no_grad():
        reference = token_log_probs(response_logits(model, rb), rb.response_ids) * rb.mask
        with autocast("bf16-mixed", "cpu"):
            logits = response_logits(model, rb, temperature=0.7)
            mixed = token_log_probs(response_logits(model, rb), rb.response_ids) * rb.mask
    assert logits.dtype == torch.float32 and mixed.dtype == torch.float32
    assert not torch.equal(mixed, reference)  # the forward did run in bfloat16
    torch.testing.assert_close(mixed, reference, atol=LOG_PROB_ATOL, rtol=0)


def test_bf16_mixed_trains_float32_master_weights_to_fp32s_loss(model_dir):
    _, fp32, _, reference = _one_step(model_dir, "fp32")
    before, model, optimizer, metrics = _one_step(model_dir, "bf16-mixed")
    assert metrics.loss == pytest.approx(reference.loss, rel=LOSS_REL)
    assert metrics.grad_norm == pytest.approx(reference.grad_norm, rel=LOSS_REL)
    assert metrics.means()["rollout_logprob_abs_diff"] == pytest.approx(
        reference.means()["rollout_logprob_abs_diff"], abs=LOG_PROB_ATOL
    )
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert optimizer.state[p]["exp_avg"].dtype == torch.float32, name
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    # the update is fp32's: Adam's first step moves each weight by ~lr in the gradient's sign
    fp32_params = dict(fp32.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, fp32_params[name], atol=2.5e-3, rtol=0)


def test_bf16_trains_bfloat16_weights_and_optimizer_state(model_dir):
    _, _, _, reference = _one_step(model_dir, "fp32")
    before, model, optimizer, metrics = _one_step(model_dir, "bf16")
    assert metrics.loss == pytest.approx(reference.loss, rel=LOSS_REL)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert optimizer.state[p]["exp_avg"].dtype == torch.bfloat16, name
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_critic_trains_under_each_precision(model_dir):
    g = torch.Generator().manual_seed(1)
    b = _batch()
    batch = Batch(
        partition="train_0",
        rows=b.rows,
        columns={
            **b.columns,
            "values": [torch.randn(len(m), generator=g) for m in b["loss_mask"]],
            "returns": [torch.randn(len(m), generator=g) for m in b["loss_mask"]],
        },
    )
    losses = {}
    for precision in ("fp32", "bf16-mixed", "bf16"):
        critic = load_critic(model_dir, getattr(torch, weights_dtype(precision)))
        optimizer = adamw(critic.parameters(), 1e-3, (0.9, 0.999), 0.0, "cpu")
        losses[precision] = critic_step(critic, optimizer, batch, _run(model_dir), 2, precision=precision).loss
        assert next(critic.parameters()).dtype == getattr(torch, weights_dtype(precision))
    assert losses["bf16-mixed"] == pytest.approx(losses["fp32"], rel=LOSS_REL)
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=LOSS_REL)


def test_on_cpu_the_clock_reports_no_gpu_memory_and_tf32_changes_nothing():
    clock = DeviceClock("cpu")
    assert clock.memory() == {}
    assert clock.since(0.0) > 0
    precision = torch.get_float32_matmul_precision()
    allow_tf32("cpu", True)
    assert torch.get_float32_matmul_precision() == precision


FSDP_STEP = """
import json, sys, torch
from services.model.loading import load_causal_lm
from services.run_contract.run_config import RunConfig
from services.trainer.backend import make_backend
from services.trainer.data_parallel import DataParallel
from tests.trainer.test_actor_update import _batch
torch.set_num_threads(1)
run = RunConfig(name="r", model=sys.argv[1], n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4,
                micro_batch_size=2, optim={"lr": 1e-3})
dp = DataParallel()
backend = make_backend("fsdp", load_causal_lm(sys.argv[1])[0], run, "cpu", dp, precision="bf16-mixed")
m = backend.train(_batch(), run, 2)
p = next(backend.policy.parameters())
print(json.dumps({"loss": m.loss, "master": str(p.dtype), "state": str(backend.optimizer.state[p]["exp_avg"].dtype)}))
dp.close()
"""


def test_fsdp_bf16_mixed_trains_float32_shards_in_bfloat16(model_dir):
    """One fsdp rank (its own process: FSDP needs a process group) under --precision bf16-mixed: FSDP2's mixed
    precision computes in bfloat16 (the loss is close to, not equal to, fp32's) over float32 shards."""
    _, _, _, reference = _one_step(model_dir, "fp32")
    root = pathlib.Path(__file__).resolve().parents[2]  # `python -c` imports tests.* from its working directory
    done = subprocess.run(
        [sys.executable, "-c", FSDP_STEP, model_dir], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["master"], got["state"]) == ("torch.float32", "torch.float32")
    assert got["loss"] == pytest.approx(reference.loss, rel=LOSS_REL) and got["loss"] != reference.loss


def test_the_actor_trainer_trains_and_publishes_in_its_precision(fresh_trainer_metrics, tmp_path):
    """The service wiring: --precision bf16 loads, trains and publishes bfloat16 weights, and a CPU step's
    metrics time its compute without a GPU memory figure."""
    import threading

    from services.run_state.trainer_progress import trained_steps
    from services.role.role_service import RoleStatus
    from services.trainer.service import ActorTrainer
    from tests.fakes import FakeRunSession, InMemoryCoordinator, InMemoryDataPlane, InMemoryRedis
    from tests.trainer.test_actor_role import write_step

    directory = init_model(str(tmp_path), preset="tiny", arch="qwen2", seed=7)
    run = RunConfig(
        name="r",
        model=directory,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        num_steps=1,
        optim={"lr": 1e-2},
    )
    initial, _ = load_causal_lm(directory)
    plane, redis, coordinator = InMemoryDataPlane(), InMemoryRedis(), InMemoryCoordinator()
    write_step(plane, 0, initial, run.rollout.temperature)
    session = FakeRunSession(run, plane, coordinator=coordinator, redis=redis, run_id="p")
    trainer = ActorTrainer(
        TrainerConfig(run_id="p", precision="bf16"), RoleStatus("trainer"), publisher=coordinator.publisher
    )
    worker = threading.Thread(target=trainer.run_loop, args=(session, threading.Event()), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the trainer did not finish its step"
    published = coordinator.published[0].tensors
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert any(not torch.equal(published[n], p.to(torch.bfloat16)) for n, p in initial.named_parameters())
    metrics = trained_steps(redis, "p")[0]["metrics"]
    assert metrics["compute_s"] > 0 and "gpu_memory_peak_gb" not in metrics


def test_micro_batches_sized_from_memory():
    """--auto-micro-batch: the rows that fit what the GPU has left, from a step's measured cost per token; off a
    GPU the run's micro_batch_size; refused where the ranks must split alike."""
    import pytest as _pytest
    from services.trainer.config import TrainerConfig
    from services.trainer.device import DeviceClock, MicroBatchSizer, rows_that_fit

    # 10 GiB budget, 2 GiB weights and optimizer, 1 KiB a token, rows of 4096 tokens: (8 GiB) / 4 MiB = 2048
    assert rows_that_fit(10 * 2**30, 2 * 2**30, 1024, 4096, at_most=10_000) == 2048
    assert rows_that_fit(10 * 2**30, 2 * 2**30, 1024, 4096, at_most=64) == 64
    assert rows_that_fit(2 * 2**30, 3 * 2**30, 1024, 4096, at_most=64) == 1  # nothing left: one row at a time
    sizer = MicroBatchSizer("cpu", True, torch.nn.Linear(4, 4))
    batch = {"tokens": [list(range(7)), list(range(3))]}
    assert sizer.rows(5, batch) == 5 and sizer.observe(DeviceClock("cpu")) == {}  # a CPU: as configured
    with _pytest.raises(ValueError, match="--auto-micro-batch needs --backend torch"):
        TrainerConfig(backend="fsdp", auto_micro_batch=True)
    assert TrainerConfig(auto_micro_batch=True).auto_micro_batch

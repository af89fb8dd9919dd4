"""The trainer's optimizer step: micro-batching does not change the update; checkpoints round-trip."""

import copy

import pytest
import torch

from services.run_contract.run_config import RunConfig
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.trainer.actor_update import actor_step
from services.run_contract.checkpoint import latest_checkpoint, load_optimizer_state, save_checkpoint
from services.transferqueue.codec import Batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch="llama", seed=5)


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = [(3, 5), (2, 2), (4, 6), (1, 3)]
    tokens = [torch.randint(3, 200, (p + r,), generator=g) for p, r in lengths]
    return Batch(
        partition="train_0",
        rows=list(range(4)),
        columns={
            "tokens": tokens,
            "prompt_length": torch.tensor([p for p, _ in lengths]),
            "response_length": torch.tensor([r for _, r in lengths]),
            "loss_mask": [torch.ones(r) for _, r in lengths],
            "rollout_log_probs": [-5.0 + 0.1 * torch.randn(r, generator=g) for _, r in lengths],
            "advantages": [torch.full((r,), a) for (_, r), a in zip(lengths, [1.0, -1.0, 0.5, -0.5])],
        },
    )


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_give_the_same_update_as_one_batch(model_dir, loss_agg):
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=1,
        algorithm={"loss_agg": loss_agg},
        optim={"lr": 1e-3, "grad_clip": 1e9},
    )
    base, _ = load_causal_lm(model_dir)
    updated = []
    for micro in (4, 1):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        metrics = actor_step(model, opt, _batch(), run, micro)
        updated.append((dict(model.named_parameters()), metrics))
    (a, ma), (b, mb) = updated
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)
    assert ma.grad_norm == pytest.approx(mb.grad_norm, rel=1e-4)
    assert ma.loss == pytest.approx(mb.loss, rel=1e-4, abs=1e-7)
    assert any(not torch.equal(a[n], p) for n, p in base.named_parameters())  # it did move


def test_checkpoint_round_trip(model_dir, tmp_path):
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        optim={"lr": 1e-3},
    )
    model, _ = load_causal_lm(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    actor_step(model, opt, _batch(), run, 2)
    assert latest_checkpoint(str(tmp_path), "actor") is None
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), "actor", model, opt, model_dir, next_step=step, version=step + 10)
    ckpt = latest_checkpoint(str(tmp_path), "actor")
    assert (ckpt.next_step, ckpt.version) == (3, 13)
    assert len(list((tmp_path / "actor").iterdir())) == 2  # keeps the last two
    (tmp_path / "actor" / "step_00000004.tmp").mkdir()  # a crash mid-write is ignored
    assert latest_checkpoint(str(tmp_path), "actor").next_step == 3
    loaded, tokenizer = load_causal_lm(ckpt.path)
    for (n, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), n
    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-3)
    load_optimizer_state(ckpt.path, opt2)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)

"""LoRA training (run config trainer.lora): Sluice's actor steps equal peft's own model trained by a loop written
here, with the PPO loss written out by hand; only the adapter is trained, held in the optimizer and published."""

import os

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.run_config import RunConfig
from services.trainer.backend import make_backend
from services.trainer.data_parallel import DataParallel
from services.trainer.lora import load_actor, published
from services.transferqueue.codec import Batch

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"], "dropout": 0.0}
EPS = 0.2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("m")), preset="tiny", arch="qwen2", seed=3)


def _run(model_dir: str, **over) -> RunConfig:
    return RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        micro_batch_size=2,
        optim={"lr": 1e-2, "grad_clip": 1e9, "betas": (0.9, 0.99)},
        algorithm={"eps_clip": EPS},
        trainer={"lora": LORA},
        **over,
    )


def _response_log_probs(model, tokens, prompt_length: int) -> torch.Tensor:
    """log pi(token) of each response token of one sample, its forward alone (no padding)."""
    logits = model(input_ids=tokens[None]).logits[0, prompt_length - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[prompt_length:, None])[:, 0]


def _batch(model_dir: str) -> Batch:
    """Four samples whose rollout log-probs are the base model's (so the first step's ratios are 1)."""
    base, _ = load_causal_lm(model_dir)
    g = torch.Generator().manual_seed(1)
    lengths = [(3, 5), (2, 2), (4, 6), (1, 3)]
    tokens = [torch.randint(3, 200, (p + r,), generator=g) for p, r in lengths]
    with torch.no_grad():
        rollout = [_response_log_probs(base, t, p) for t, (p, _) in zip(tokens, lengths)]
    return Batch(
        partition="train_0",
        rows=list(range(4)),
        columns={
            "tokens": tokens,
            "prompt_length": torch.tensor([p for p, _ in lengths]),
            "response_length": torch.tensor([r for _, r in lengths]),
            "loss_mask": [torch.ones(r) for _, r in lengths],
            "rollout_log_probs": rollout,
            "advantages": [torch.full((r,), a) for (_, r), a in zip(lengths, [1.0, -1.0, 0.5, -0.5])],
        },
    )


def _peft_reference(model_dir: str, batch: Batch, steps: int) -> dict[str, torch.Tensor]:
    """peft's model, AdamW and the clipped PPO surrogate, token mean (Schulman et al. 2017):
    L = -(1 / N) sum_t min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t),  r_t = pi(t) / pi_rollout(t)."""
    torch.manual_seed(0)
    base, _ = load_causal_lm(model_dir)
    model = get_peft_model(
        base,
        LoraConfig(
            r=LORA["rank"],
            lora_alpha=LORA["alpha"],
            lora_dropout=0.0,
            target_modules=LORA["target_modules"],
            task_type="CAUSAL_LM",
        ),
    )
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0
    )
    tokens_total = sum(int(n) for n in batch["response_length"])
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for t, p, old, adv in zip(
            batch["tokens"], batch["prompt_length"].tolist(), batch["rollout_log_probs"], batch["advantages"]
        ):
            ratio = torch.exp(_response_log_probs(model, t, p) - old)
            loss = loss - torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv).sum() / tokens_total
        loss.backward()
        opt.step()
    return get_peft_model_state_dict(model)


def _sluice_lora(model_dir: str, batch: Batch, steps: int):
    run = _run(model_dir)
    torch.manual_seed(0)
    model = load_actor(run, None, "float32", "cpu")
    backend = make_backend("torch", model, run, "cpu", DataParallel())
    for _ in range(steps):
        backend.train(batch, run, run.micro_batch_size)
    return model, backend


@pytest.mark.parametrize("steps", [1, 2])
def test_a_lora_step_equals_peft_trained_by_hand(model_dir, steps):
    batch = _batch(model_dir)
    model, backend = _sluice_lora(model_dir, batch, steps)
    expected = _peft_reference(model_dir, batch, steps)
    sent = dict(backend.live_weights())
    assert sorted(sent) == sorted(expected)  # peft's saved names, and only the adapter's
    assert len(sent) == 2 * 3 * 2  # lora_A and lora_B of q_proj, v_proj, down_proj in both layers
    for name, tensor in expected.items():
        torch.testing.assert_close(sent[name], tensor, atol=2e-6, rtol=1e-5)
    moved = [n for n in expected if n.endswith("lora_B.weight")]
    assert all(sent[n].abs().max() > 1e-4 for n in moved)  # B starts at zero: it did train
    if steps == 2:  # A's gradient is 0 while B is: it moves from the second step on
        initial = _peft_reference(model_dir, batch, 0)
        assert any(not torch.equal(sent[n], initial[n]) for n in expected if n.endswith("lora_A.weight"))


def test_only_the_adapter_is_trained_and_optimized(model_dir):
    batch = _batch(model_dir)
    base, _ = load_causal_lm(model_dir)
    model, backend = _sluice_lora(model_dir, batch, 1)
    held = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    adapter = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert held == adapter and len(adapter) == 12
    assert len(backend.optimizer.state) == 12  # AdamW moments of the adapter alone
    weights = dict(model.get_base_model().named_parameters())
    for name, p in base.named_parameters():  # the base weights, frozen, are the base model's still
        module, leaf = name.rsplit(".", 1)
        key = name if name in weights else f"{module}.base_layer.{leaf}"
        assert torch.equal(weights[key], p), name


def test_full_fine_tuning_publishes_every_weight(model_dir):
    run = RunConfig(
        name="r", model=model_dir, n_samples_per_prompt=2, rollout_batch_size=2, global_batch_size=4, micro_batch_size=2
    )
    model = load_actor(run, None, "float32", "cpu")
    assert [n for n, _ in published(model)] == [n for n, _ in model.named_parameters()]


def test_lora_is_refused_where_it_cannot_work(model_dir):
    with pytest.raises(ValueError, match="trainer.lora trains with the torch or fsdp backend, not megatron"):
        make_backend(
            "megatron", load_actor(_run(model_dir), None, "float32", "cpu"), _run(model_dir), "cpu", DataParallel()
        )
    with pytest.raises(ValueError, match="actor_fwd"):
        RunConfig(name="r", model=model_dir, algorithm={"decoupled": True}, trainer={"lora": LORA})
    with pytest.raises(ValueError, match="rank"):
        RunConfig(name="r", model=model_dir, trainer={"lora": {"rank": 0}})
    with pytest.raises(ValueError, match="target_modules"):
        RunConfig(name="r", model=model_dir, trainer={"lora": {"target_modules": ["q_proj; rm"]}})


def test_checkpoint_is_peft_adapter_and_resumes(model_dir, tmp_path):
    """The checkpoint (from the copy taken for it, or the live model) is peft's adapter beside the run's tokenizer,
    readable by peft itself; the actor resumes from it with the same adapter and optimizer state."""
    from peft import PeftModel

    from services.run_contract.checkpoint import save_checkpoint
    from services.trainer.checkpoint_copy import copy_training_state

    batch = _batch(model_dir)
    model, backend = _sluice_lora(model_dir, batch, 2)
    copied = copy_training_state(model, backend.optimizer)
    assert [n for n, _ in copied.weights] == [n for n, _ in backend.live_weights()]  # what the publish sends
    written = [
        save_checkpoint(str(tmp_path / k), "actor", model, backend.optimizer, model_dir, 2, 2, copied=c)
        for k, c in (("copy", copied), ("live", None))
    ]
    live = dict(backend.live_weights())
    for path in written:
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(os.listdir(path))
        assert not any(n.startswith("model") and n.endswith(".safetensors") for n in os.listdir(path))
        by_peft = PeftModel.from_pretrained(load_causal_lm(model_dir)[0], path)
        for name, t in get_peft_model_state_dict(by_peft).items():
            torch.testing.assert_close(t, live[name], atol=0, rtol=0)
        resumed = load_actor(_run(model_dir), path, "float32", "cpu")
        again = make_backend("torch", resumed, _run(model_dir), "cpu", DataParallel())
        again.load_optimizer(path)
        assert len(again.optimizer.state) == 12
        for name, t in again.live_weights():
            torch.testing.assert_close(t, live[name], atol=0, rtol=0)


def test_sluice_export_merges_the_adapter_into_a_full_model(model_dir, tmp_path):
    from safetensors.torch import load_file

    from services.front_door.export_command import ExportError, export_checkpoint, main
    from services.run_contract.checkpoint import save_checkpoint

    model, backend = _sluice_lora(model_dir, _batch(model_dir), 2)
    path = save_checkpoint(str(tmp_path / "ckpt"), "actor", model, backend.optimizer, model_dir, 2, 2)
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0  # the newest checkpoint, merged
    exported, _ = load_causal_lm(str(tmp_path / "out"))
    base = dict(load_causal_lm(model_dir)[0].named_parameters())
    adapter = load_file(os.path.join(path, "adapter_model.safetensors"))
    scaling = LORA["alpha"] / LORA["rank"]
    for name, w in exported.named_parameters():
        module = "base_model.model." + name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapter:  # W0 + alpha / r * B @ A
            want = base[name] + scaling * adapter[f"{module}.lora_B.weight"] @ adapter[f"{module}.lora_A.weight"]
            torch.testing.assert_close(w, want, atol=1e-6, rtol=1e-5)
        else:
            assert torch.equal(w, base[name]), name
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")
    with pytest.raises(ExportError, match="pass --base"):
        export_checkpoint(path, str(tmp_path / "out2"), base=str(tmp_path / "nowhere"))

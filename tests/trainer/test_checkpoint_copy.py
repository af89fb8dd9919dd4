"""A checkpoint written from a copy of the training state (services/trainer/checkpoint_copy.py) is the one the
live model and optimizer would have written at the moment of the copy, whatever training does afterwards."""

import os

import pytest
import torch
from safetensors.torch import load_file

from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.run_contract.checkpoint import save_checkpoint
from services.trainer.checkpoint_copy import copy_if_affordable, copy_training_state, state_copy_bytes


@pytest.fixture()
def training(tmp_path):
    model_dir = init_model(str(tmp_path / "m"), preset="tiny", arch="qwen2", seed=3)
    model, _ = load_causal_lm(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        loss = model(input_ids=torch.randint(0, 100, (2, 8))).logits.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer has state to copy
    return model_dir, model, optimizer, step


def test_a_checkpoint_from_the_copy_is_the_state_at_the_copy_not_after(training, tmp_path):
    model_dir, model, optimizer, step = training
    live = save_checkpoint(str(tmp_path / "live"), "actor", model, optimizer, model_dir, next_step=1, version=1)
    copied = copy_training_state(model, optimizer)
    step()  # the next step trains while the copy is written
    from_copy = save_checkpoint(
        str(tmp_path / "copy"), "actor", model, optimizer, model_dir, next_step=1, version=1, copied=copied
    )
    a, b = (load_file(os.path.join(p, "model.safetensors")) for p in (live, from_copy))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], v.detach()) for k, v in model.state_dict().items() if k in a)  # it moved
    oa, ob = (torch.load(os.path.join(p, "optimizer.pt"), weights_only=True) for p in (live, from_copy))
    assert oa["state"].keys() == ob["state"].keys()
    assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for i in oa["state"] for k in oa["state"][i])
    published = dict(copied.weights)  # what the publish sends: every parameter, as copied
    assert list(published) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(published[n], a[n]) for n in published if n in a)


def test_tied_parameters_stay_tied_in_the_copy(training):
    _, model, optimizer, _ = training
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them, as tie_word_embeddings does
    copied = copy_training_state(model, optimizer)
    assert copied.model_state["lm_head.weight"] is copied.model_state["model.embed_tokens.weight"]
    assert copied.model_state["lm_head.weight"].data_ptr() != model.lm_head.weight.data_ptr()


def test_a_copy_over_the_limit_is_not_made(training):
    _, model, optimizer, _ = training
    need = state_copy_bytes(model)
    assert need == 3 * sum(p.numel() * 4 for p in model.parameters())
    assert copy_if_affordable(model, optimizer, need - 1) is None
    assert copy_if_affordable(model, optimizer, need) is not None

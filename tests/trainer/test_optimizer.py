"""The trainer's fused AdamW takes the same step as torch's reference AdamW and shares its checkpoint format."""

import torch

from services.trainer.optimizer import adamw


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((17, 5), (5,), (3, 3, 2))]


def _steps(params, optimizer, steps: int = 3):
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


def test_fused_adamw_equals_the_reference_update_and_state():
    fused_params, plain_params = _params(1), _params(1)
    fused = adamw(fused_params, 1e-2, (0.9, 0.99), 0.1, "cpu")
    assert fused.defaults["fused"] is True
    plain = torch.optim.AdamW(plain_params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    _steps(fused_params, fused)
    _steps(plain_params, plain)
    for a, b, start in zip(fused_params, plain_params, _params(1)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert float((a - start).detach().abs().min()) > 1e-5  # every element moved
    # a checkpoint of one loads into the other and goes on identically
    resumed = adamw(_params(1), 1e-2, (0.9, 0.99), 0.1, "cpu")
    resumed.load_state_dict(plain.state_dict())
    assert torch.equal(resumed.state_dict()["state"][0]["exp_avg"], plain.state_dict()["state"][0]["exp_avg"])


def test_learning_rate_schedules_warm_up_then_decay_to_the_floor():
    from services.trainer.optimizer import lr_factor, set_lr
    from services.run_contract.run_config import OptimSettings

    assert [lr_factor(s, 10, "constant") for s in (0, 5, 9)] == [1.0, 1.0, 1.0]
    assert [round(lr_factor(s, 6, "linear", warmup_steps=2), 6) for s in range(6)] == [
        0.5,
        1.0,
        1.0,
        0.666667,
        0.333333,
        0.0,
    ]
    cosine = [lr_factor(s, 11, "cosine", min_ratio=0.1) for s in range(11)]
    assert cosine[0] == 1.0 and abs(cosine[5] - 0.55) < 1e-9 and abs(cosine[10] - 0.1) < 1e-9
    assert all(a > b for a, b in zip(cosine, cosine[1:]))  # falls at every step
    assert lr_factor(50, 11, "cosine", min_ratio=0.1) == cosine[10]  # past the last step it stays at the floor
    params = _params(3)
    optimizer = adamw(params, 1e-2, (0.9, 0.99), 0.0, "cpu")
    optim = OptimSettings(lr=1e-2, lr_schedule="linear", min_lr_ratio=0.5)
    assert set_lr(optimizer, 1e-2, 9, optim, num_steps=10) == 5e-3
    assert all(group["lr"] == 5e-3 for group in optimizer.param_groups)

"""The precision contract of a weight sync (services/dcs/sync/precision.py): which dtype a publish travels in,
the cast on send, and a receiver's load that casts and refuses what does not fit before copying anything."""

from __future__ import annotations

import pytest
import torch

from services.dcs.sync.layout import pack, plan_buckets, unpack
from services.dcs.sync.precision import WeightMismatch, load_into, wire_dtype

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "declared,source,wire",
    [
        (["bfloat16", "bfloat16"], F32, BF16),  # every receiver serves bf16: half the bytes
        (["bfloat16", "float32"], F32, F32),  # they differ: full precision, each casts on load
        (["bfloat16", None], F32, F32),  # one did not say (SGLang's "auto"): what the trainer holds
        (["float32"], BF16, BF16),  # never wider than the source: the receiver casts up exactly
        (["float16"], BF16, BF16),  # same width: the trainer's values, cast once by the receiver
        ([], F32, F32),  # nobody receives
        (["auto"], F32, F32),
    ],
)
def test_the_wire_dtype_is_what_every_receiver_serves_when_they_agree(declared, source, wire):
    assert wire_dtype(declared, source) == wire


def test_floating_tensors_travel_cast_and_others_as_they_are():
    named = [
        ("w", torch.randn(4, 3)),
        ("step", torch.tensor([7], dtype=torch.int64)),
        ("h", torch.randn(5, dtype=BF16)),
    ]
    full_entries, full_sizes = plan_buckets(named, 1 << 20)
    entries, sizes = plan_buckets(named, 1 << 20, BF16)
    assert [e.dtype for e in entries] == ["bfloat16", "int64", "bfloat16"]
    assert sizes[0] < full_sizes[0] and entries[0].nbytes == full_entries[0].nbytes // 2
    got = unpack(0, entries, pack(0, entries, sizes[0], dict(named)))
    assert torch.equal(got["w"], named[0][1].to(BF16)) and torch.equal(got["step"], named[1][1])
    assert torch.equal(got["h"], named[2][1])


def test_a_receiver_casts_on_load():
    model = torch.nn.Linear(3, 2).to(BF16)
    w, b = torch.randn(2, 3), torch.randn(2)
    load_into(model, {"weight": w, "bias": b})
    assert model.weight.dtype == BF16 and torch.equal(model.weight.detach(), w.to(BF16))
    assert torch.equal(model.bias.detach(), b.to(BF16))


@pytest.mark.parametrize(
    "tensors,message",
    [
        (
            {"bias": torch.zeros(2), "weight": torch.zeros(3, 2)},
            r"weight \(3, 2\).*does not match the model's \(2, 3\)",
        ),
        ({"bias": torch.zeros(2), "encoder.weight": torch.zeros(2, 3)}, "encoder.weight.*no such parameter"),
        ({"bias": torch.zeros(2), "weight": torch.zeros(2, 3, dtype=torch.int32)}, "weight.*int32 cannot be cast"),
    ],
)
def test_a_mismatch_is_refused_naming_the_tensor_before_anything_is_copied(tensors, message):
    model = torch.nn.Linear(3, 2)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightMismatch, match=message):
        load_into(model, tensors)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the bias was not copied either

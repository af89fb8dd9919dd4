"""The engine's weight-update state (services/engine/weight_updates.py) against in-memory fakes of
the broadcast group and the scheduler: when a received version goes live, and that a failed receive leaves
the old weights serving."""

from __future__ import annotations

import pytest
import torch

from services.dcs.sync.layout import pack, plan_buckets
from services.engine.protocol import UpdateWeightsRequest
from services.engine.weight_updates import WeightUpdates


class FakeGroup:
    """Plays rank 0: each broadcast fills the receiver's tensor with the next queued source tensor."""

    def __init__(self, sources: list[torch.Tensor]):
        self.sources = list(sources)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if not self.sources:
            raise TimeoutError("nobody sent")
        tensor.copy_(self.sources.pop(0).view(tensor.dtype).reshape(tensor.shape))


class FakeScheduler:
    paused = False
    weight_version = "default"


def _updates(bracket_timeout_s: float = 60.0):
    model = torch.nn.Linear(3, 2, bias=True)
    scheduler = FakeScheduler()
    moved = []
    return (
        WeightUpdates(model, scheduler, "cpu", lambda: moved.append(scheduler.weight_version), bracket_timeout_s),
        model,
        scheduler,
        moved,
    )


def _body(group: str, version: str, named, flat: bool = False) -> UpdateWeightsRequest:
    body = {
        "group_name": group,
        "names": [n for n, _ in named],
        "dtypes": ["float32"] * len(named),
        "shapes": [list(t.shape) for _, t in named],
        "weight_version": version,
    }
    if flat:
        entries, sizes = plan_buckets(named, 1 << 20)
        body["flat_bucket"] = {"offsets": [e.offset for e in entries], "nbytes": sizes[0]}
    return UpdateWeightsRequest.model_validate(body)


def test_bracketed_buckets_go_live_together_at_end():
    updates, model, scheduler, moved = _updates()
    w, b = torch.full((2, 3), 7.0), torch.full((2,), 5.0)
    updates.groups["g"] = FakeGroup([w, b])
    assert updates.begin()
    updates.receive(_body("g", "1", [("weight", w)]))
    assert updates.load_unless_held().startswith("staged until /end")
    assert scheduler.weight_version == "default" and not torch.equal(model.weight, w)  # nothing half-loaded
    updates.receive(_body("g", "1", [("bias", b)]))
    assert updates.load_unless_held().startswith("staged until /end")
    assert updates.end() == "loaded 2 tensors"
    assert torch.equal(model.weight.detach(), w) and torch.equal(model.bias.detach(), b)
    assert scheduler.weight_version == "1" and moved == ["1"]


def test_unbracketed_update_loads_at_once_unless_paused():
    updates, model, scheduler, _ = _updates()
    w = torch.full((2, 3), 3.0)
    updates.groups["g"] = FakeGroup([w, w])
    scheduler.paused = True
    updates.receive(_body("g", "1", [("weight", w)]))
    assert updates.load_unless_held().startswith("staged until /continue")
    assert updates.load() == "loaded 1 tensors" and scheduler.weight_version == "1"  # what continue does
    scheduler.paused = False
    updates.receive(_body("g", "2", [("weight", w)]))
    assert updates.load_unless_held() == "loaded 1 tensors" and scheduler.weight_version == "2"


def test_flat_bucket_arrives_in_one_broadcast():
    updates, model, scheduler, _ = _updates()
    named = [("weight", torch.arange(6.0).reshape(2, 3)), ("bias", torch.tensor([9.0, 8.0]))]
    entries, sizes = plan_buckets(named, 1 << 20)
    group = updates.groups["g"] = FakeGroup([pack(0, entries, sizes[0], dict(named))])
    updates.receive(_body("g", "1", named, flat=True))
    assert not group.sources  # one broadcast for the whole bucket
    updates.load_unless_held()
    assert torch.equal(model.weight.detach(), named[0][1]) and torch.equal(model.bias.detach(), named[1][1])


def test_a_failed_receive_keeps_the_old_weights_and_a_lost_end_expires():
    updates, model, scheduler, _ = _updates(bracket_timeout_s=5.0)
    before = model.weight.detach().clone()
    updates.groups["g"] = FakeGroup([])  # the sender never comes
    updates.begin()
    with pytest.raises(TimeoutError):
        updates.receive(_body("g", "1", [("weight", before)]))
    assert updates.load() == "nothing staged" and torch.equal(model.weight.detach(), before)
    assert scheduler.weight_version == "default"
    with pytest.raises(ValueError, match="no weight update group"):
        updates.receive(_body("other", "1", [("weight", before)]))
    # a begin whose end never arrives holds a version back only until the bracket times out
    w = torch.full((2, 3), 1.5)
    updates.groups["g"] = FakeGroup([w])
    updates.begin()
    updates.receive(_body("g", "2", [("weight", w)]))
    assert updates.load_unless_held().startswith("staged until /end")
    updates._begun -= 5.0  # the bracket's time passes without an /end
    assert updates.load_unless_held() == "loaded 1 tensors" and scheduler.weight_version == "2"


def test_a_received_mismatch_is_refused_at_once_and_nothing_is_staged():
    from services.dcs.sync.precision import WeightMismatch

    updates, model, scheduler, _ = _updates()
    w = torch.full((2, 3), 4.0)
    updates.groups["g"] = FakeGroup([w, torch.zeros(3, 3)])
    updates.begin()
    updates.receive(_body("g", "1", [("weight", w)]))
    with pytest.raises(WeightMismatch, match=r"bias \(3, 3\)"):
        updates.receive(_body("g", "1", [("bias", torch.zeros(3, 3))]))
    assert updates.end() == "nothing staged" and not torch.equal(model.weight.detach(), w)
    assert scheduler.weight_version == "default"


def test_float32_weights_load_into_a_bfloat16_model():
    updates, model, scheduler, _ = _updates()
    model.to(torch.bfloat16)
    w = torch.randn(2, 3)
    updates.groups["g"] = FakeGroup([w])
    updates.receive(_body("g", "1", [("weight", w)]))
    assert updates.load_unless_held() == "loaded 1 tensors"
    assert model.weight.dtype == torch.bfloat16 and torch.equal(model.weight.detach(), w.to(torch.bfloat16))

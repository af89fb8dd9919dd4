"""Which transfer a publish uses (services/dcs/sync/backend_choice.py): auto picks by who shares the trainer's GPU,
an explicit choice that cannot work is refused naming why, and a CUDA IPC description is checked before use."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.dcs.sync.backend_choice import ReceiverPlace, choose_backend
from services.dcs.sync.cuda_ipc import SharedBucket

GPU0, GPU1 = "GPU-0000", "GPU-1111"
ENGINE_HERE = ReceiverPlace("engine", GPU0, takes_ipc=True)
ENGINE_ELSEWHERE = ReceiverPlace("engine", GPU1, takes_ipc=True)
SGLANG = ReceiverPlace("engine", None)  # a real SGLang server says nothing of its GPU
FORWARD_HERE = ReceiverPlace("actor_fwd", GPU0)


@pytest.mark.parametrize(
    "trainer_gpu,receivers,chosen",
    [
        (None, [ENGINE_HERE], "gloo"),  # a CPU trainer
        (GPU0, [ENGINE_ELSEWHERE, SGLANG], "nccl"),  # nobody on the trainer's GPU
        (GPU0, [ENGINE_HERE], "ipc"),  # one GPU: the engine maps the trainer's buckets
        (GPU0, [ENGINE_HERE, ENGINE_ELSEWHERE], "gloo"),  # some share it, some do not: NCCL would refuse
        (GPU0, [ENGINE_HERE, FORWARD_HERE], "gloo"),  # a forward role takes no IPC handles
        (GPU0, [], "nccl"),
    ],
)
def test_auto_picks_by_who_shares_the_trainers_gpu(trainer_gpu, receivers, chosen):
    assert choose_backend("auto", trainer_gpu, receivers) == chosen


@pytest.mark.parametrize(
    "requested,trainer_gpu,receivers,why",
    [
        ("nccl", None, [ENGINE_ELSEWHERE], "nccl needs the trainer on a GPU"),
        ("nccl", GPU0, [ENGINE_HERE], "engine shares the trainer's"),
        ("ipc", GPU0, [ENGINE_ELSEWHERE], "not: engine"),
        ("ipc", None, [ENGINE_HERE], "ipc needs the trainer on a GPU"),
        ("mpi", GPU0, [], "unknown sync backend 'mpi'"),
    ],
)
def test_an_explicit_choice_that_cannot_work_is_refused_naming_why(requested, trainer_gpu, receivers, why):
    with pytest.raises(ValueError, match=why):
        choose_backend(requested, trainer_gpu, receivers)


def test_explicit_choices_that_work_are_kept():
    assert choose_backend("gloo", GPU0, [ENGINE_HERE, ENGINE_ELSEWHERE]) == "gloo"
    assert choose_backend("nccl", GPU0, [ENGINE_ELSEWHERE]) == "nccl"
    assert choose_backend("ipc", GPU0, [ENGINE_HERE]) == "ipc"


def test_a_shared_bucket_description_must_stay_inside_its_storage():
    fields = dict(
        device=0,
        handle="aGFuZGxl",
        storage_size_bytes=64,
        storage_offset_bytes=0,
        ref_counter_handle="cmVm",
        ref_counter_offset=0,
        tensor_offset=16,
        numel=48,
    )
    assert SharedBucket(**fields).numel == 48
    with pytest.raises(ValidationError, match="overrun a storage of 64"):
        SharedBucket(**{**fields, "numel": 49})
    with pytest.raises(ValidationError):
        SharedBucket(**{**fields, "pickle": "gASV"})  # nothing but the description's fields

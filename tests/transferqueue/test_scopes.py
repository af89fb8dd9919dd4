"""Scoped names: "<scope>/<name>" partitions and tasks (Sluice scopes both by run id), so runs sharing one
TransferQueue never touch each other's rows and may define the same task differently."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.run_contract.partitions import partition_name, partition_prefix, step_of, task_name
from services.transferqueue.errors import TQError, task_applies


def ready(tq, partition: str, *tasks: str) -> dict[str, int]:
    """Ready rows per task, of the given tasks that the partition lists (the stack is shared with other tests,
    whose unscoped tasks apply everywhere)."""
    return {t.task: t.ready for t in tq.partition(partition).tasks if t.task in tasks}


def test_a_scoped_task_sees_only_its_scopes_partitions(tq, uniq):
    a, b = uniq("run-a"), uniq("run-b")
    pa, pb = partition_name(a, 0), partition_name(b, 0)
    tq.create_partition(pa, group_size=2)
    tq.create_partition(pb, group_size=4)
    tq.put(pa, {"x": torch.arange(4)})
    tq.put(pb, {"x": torch.arange(8)})
    # the same task name in two runs, defined differently (another group size): no conflict
    ta, tb = task_name(a, "advantage"), task_name(b, "advantage")
    tq.register_task(ta, ["x"], group_size=2)  # registered after the data: only a's partitions are scanned
    tq.register_task(tb, ["x"], group_size=4)
    shared = uniq("shared")
    tq.register_task(shared, ["x"], group_size=2)  # an unscoped task applies everywhere
    assert ready(tq, pa, ta, tb, shared) == {ta: 4, shared: 4}
    assert ready(tq, pb, ta, tb, shared) == {tb: 8, shared: 8}
    tq.put(pb, {"x": torch.arange(4)})  # a commit to b's partition makes rows ready for b's tasks only
    assert ready(tq, pb, ta, tb, shared) == {tb: 12, shared: 12}
    assert tq.claim(pa, ta, 4, wait_s=0.2).rows == [0, 1, 2, 3]
    assert tq.claim(pb, tb, 8, wait_s=0.2).rows == list(range(8))
    for call in (lambda: tq.claim(pb, ta, 2), lambda: tq.reset_task(pb, ta)):
        with pytest.raises(TQError) as err:
            call()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and ta in err.value.message
    assert [p.name for p in tq.list_partitions(partition_prefix(a))] == [pa]
    assert tq.clear_partition(pa) and tq.partition(pb).tasks  # clearing a's partition leaves b's alone
    tq.clear_partition(pb)


def test_scoped_names_are_validated():
    for name in ("run-a/train_0", "train_0"):
        assert task_applies(name, "x")
    assert task_applies("run-a/train_0", "run-a/t") and not task_applies("run-b/train_0", "run-a/t")
    assert not task_applies("run-ab/train_0", "run-a/t")
    assert step_of(partition_name("run-a", 12)) == 12 and step_of("train_3") is None
    assert step_of("run-a/other_3") is None


@pytest.mark.parametrize("name", ["a/b/c", "/x", "x/", "bad:name/x", "a" * 129 + "/x"])
def test_malformed_scoped_names_are_invalid_argument(tq, name):
    with pytest.raises(TQError) as err:
        tq.create_partition(name)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "partition name" in err.value.message
    with pytest.raises(TQError) as err:
        tq.register_task(name, ["x"])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "task name" in err.value.message

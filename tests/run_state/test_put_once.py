import pytest
import torch

from services.run_state.step_partitions import put_once
from services.transferqueue.errors import TQError


def test_put_once_skips_groups_a_previous_holder_wrote(tq, uniq):
    part = uniq("p")
    tq.create_partition(part, group_size=2)
    rows = tq.put(part, {"tokens": [torch.arange(3)] * 4})
    tq.put(part, {"log_probs": [torch.full((3,), -1.0)] * 2}, rows=rows[:2])  # a consumer that died before its ack
    put_once(tq, part, {"log_probs": [torch.full((3,), -2.0)] * 4}, rows, group_size=2)
    got = tq.get(part, rows, ["log_probs"])["log_probs"]
    assert [float(x[0]) for x in got] == [-1.0, -1.0, -2.0, -2.0]  # the first write stands, the rest is written


def test_put_once_still_raises_other_errors(tq, uniq):
    part = uniq("p")
    tq.create_partition(part, group_size=2)
    rows = tq.put(part, {"tokens": [torch.arange(3)] * 2})
    with pytest.raises(TQError):
        put_once(tq, part, {"log_probs": [torch.zeros(3)] * 2}, rows + [99, 100], group_size=2)

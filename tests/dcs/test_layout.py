"""A bucket layout described by a peer (the engine's flat_bucket extension) is checked before any byte is
received, and a checked layout views the tensors the publisher packed."""

from __future__ import annotations

import pytest
import torch

from services.dcs.sync.layout import bucket_entries, pack, plan_buckets, unpack


def test_a_packed_bucket_unpacks_through_its_described_layout():
    named = [
        ("a", torch.arange(3, dtype=torch.float32)),
        ("b", torch.ones(2, 5, dtype=torch.bfloat16)),
        ("c", torch.tensor([True, False, True])),
    ]
    entries, sizes = plan_buckets(named, bucket_bytes=1 << 20)
    flat = pack(0, entries, sizes[0], dict(named))
    described = bucket_entries(
        [e.name for e in entries],
        [e.dtype for e in entries],
        [e.shape for e in entries],
        [e.offset for e in entries],
        sizes[0],
    )
    got = unpack(0, described, flat)
    for name, tensor in named:
        assert torch.equal(got[name], tensor)


@pytest.mark.parametrize(
    "names,dtypes,shapes,offsets,size,error",
    [
        (["a"], ["float32"], [[4]], [0], 8, "does not fit"),  # 16 bytes in a bucket of 8
        (["a", "b"], ["float32"] * 2, [[2], [2]], [0, 4], 16, "does not fit"),  # overlaps the one before
        (["a"], ["float32"], [[2]], [3], 16, "does not fit"),  # not 8-byte aligned
        (["a"], ["float32"], [[2]], [-8], 16, "does not fit"),
        (["a"], ["complex64"], [[2]], [0], 16, "unknown dtype"),
        (["a"], ["float32"], [[-1]], [0], 16, "bad shape"),
        (["a"], ["float32"], [[2]], [0, 8], 16, "differ in length"),
        (["a"], ["float32"], [[2]], [0], -1, "not a byte count"),
        (["a"], ["float32"], [[2]], [0], 1 << 30, "differs from the 8 bytes"),  # slack a peer could inflate
    ],
)
def test_a_bad_layout_is_refused_naming_what_is_wrong(names, dtypes, shapes, offsets, size, error):
    with pytest.raises(ValueError, match=error):
        bucket_entries(names, dtypes, shapes, offsets, size)


def test_sglangs_flattened_bucket_packs_back_to_back_and_refuses_a_misaligned_tensor():
    from services.dcs.sync.layout import packed_entries

    entries, size = packed_entries(["a", "b", "c"], ["bfloat16", "bfloat16", "float32"], [[3], [1], [2]])
    assert [e.offset for e in entries] == [0, 6, 8] and size == 16
    with pytest.raises(ValueError, match="c: byte offset 6 is not aligned"):
        packed_entries(["a", "c"], ["bfloat16", "float32"], [[3], [2]])
    with pytest.raises(ValueError, match="unknown dtype"):
        packed_entries(["a"], ["complex64"], [[2]])

"""`core/schedule.py`: FSDP2's `Shard(0)` as byte ranges (the rest of the schedule's
tests are tests/library/project/test_static_schedule.py, from when it was a design
study in benchmarks/)."""

from __future__ import annotations

import pytest
import torch

from enginehooks.core.schedule import Slice, dim0_shards


@pytest.mark.parametrize(("rows", "world"), [(10, 4), (8, 2), (3, 4), (1, 2), (0, 2)])
def test_dim0_shards_cut_as_torch_chunk_cuts(rows: int, world: int) -> None:
    t = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    got = dim0_shards("w", (rows, 3), 4, world)
    chunks = t.chunk(world) if rows else ()
    assert len(got) == len([c for c in chunks if c.numel()])
    at = 0
    for r, c in enumerate(chunks):
        if c.numel():
            assert got[r] == Slice("w", at, at + c.numel() * 4)
            at += c.numel() * 4
    assert at == rows * 12


def test_a_scalar_is_held_by_rank_0_and_a_world_needs_a_rank() -> None:
    assert dim0_shards("s", (), 2, 4) == {0: Slice("s", 0, 2)}
    with pytest.raises(ValueError):
        dim0_shards("w", (4,), 4, 0)

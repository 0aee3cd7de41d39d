"""The static schedule (`enginehooks/core/schedule.py`, `docs/scale.md` part 3): which
trainer rank sends which bytes to which engine rank. Written as a design study in
benchmarks/ (hence this file's place); it moved into the package with the shard-direct
data path that follows it (issue 40), and these tests still pin it."""

from __future__ import annotations

import pytest

from enginehooks.core.schedule import (
    ScheduleError,
    Slice,
    Transfer,
    floor_seconds,
    link_bytes,
    schedule,
    view_slices,
)


def test_fsdp_shards_into_tensor_parallel_engine_ranks_each_get_only_their_slice() -> None:
    # 4 trainer ranks hold dim-0 quarters of a 1024-byte weight; engine TP=2 ranks need halves
    holds = {r: [Slice("w", 256 * r, 256 * (r + 1))] for r in range(4)}
    needs = {0: [Slice("w", 0, 512)], 1: [Slice("w", 512, 1024)]}
    ts = schedule(holds, needs)
    assert ts == [Transfer(0, 0, "w", 0, 256), Transfer(1, 0, "w", 256, 512),
                  Transfer(2, 1, "w", 512, 768), Transfer(3, 1, "w", 768, 1024)]
    egress, ingress = link_bytes(ts)
    assert ingress == {0: 512, 1: 512}  # nothing an engine rank drops
    assert egress == {0: 256, 1: 256, 2: 256, 3: 256}


def test_replicated_bytes_are_sent_once_per_engine_rank_by_the_least_loaded_holder() -> None:
    # a norm every trainer rank holds, needed whole by 4 engine ranks
    holds = {r: [Slice("norm", 0, 100)] for r in range(4)}
    needs = {e: [Slice("norm", 0, 100)] for e in range(4)}
    ts = schedule(holds, needs)
    assert sorted((t.dst, t.nbytes) for t in ts) == [(e, 100) for e in range(4)]
    egress, _ = link_bytes(ts)
    assert egress == {0: 100, 1: 100, 2: 100, 3: 100}  # balanced, not all from rank 0


def test_column_slices_of_a_matrix_and_missing_bytes() -> None:
    # an engine rank reads columns 2..4 of a 4x6 float32 matrix: one run per row
    runs = view_slices("m", 2, (4, 2), (6, 1), 4)
    assert runs == [Slice("m", 8 + 24 * i, 16 + 24 * i) for i in range(4)]
    assert view_slices("m", 6, (2, 6), (6, 1), 4) == [Slice("m", 24, 72)]  # rows 1-2: one run
    holds = {0: [Slice("m", 0, 48)], 1: [Slice("m", 48, 96)]}
    ts = schedule(holds, {0: runs})
    assert sum(t.nbytes for t in ts) == 32 and {t.src for t in ts} == {0, 1}
    with pytest.raises(ScheduleError, match="engine rank 0 needs bytes \\[96, 100\\) of 'm'"):
        schedule(holds, {0: [Slice("m", 90, 100)]})


def test_floor_is_the_busiest_link() -> None:
    ts = [Transfer(0, 0, "a", 0, 1000), Transfer(1, 0, "b", 0, 3000)]
    assert floor_seconds(ts, egress_bps=1000.0, ingress_bps=10000.0) == 3.0
    assert floor_seconds(ts, egress_bps=1e6, ingress_bps=1000.0) == 4.0

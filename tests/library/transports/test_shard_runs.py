"""`transports/shard_runs.py` on the host: a peer's messages compiled from the walk in
the same order and with the same packing as the per-range path, every range's address
found from segments equal to the address the per-range path's `source`/`dest` gives, and
a range that no segment holds, or a segment that is not bytes, refused by name before
anything moves. (The launches themselves need a GPU: tests/gpu/test_shard_runs_gpu.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from enginehooks.core.errors import TransportError
from enginehooks.core.schedule import Transfer
from enginehooks.transports import shard_direct as sd
from enginehooks.transports import shard_runs as sr
from tests.support.segs import Segs


def _case(seed: int) -> tuple[list[Transfer], Segs, int]:
    """A generated schedule for one receiver (rank 0) from three senders: per tensor,
    segments of random sizes and ranges inside them, some above `pack_below`."""
    rng = random.Random(seed)
    pack_below = 64
    transfers: list[Transfer] = []
    segs: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for k in range(rng.randint(1, 6)):
        name = f"t{k}"
        at = 0
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(8, 400)
            segs.setdefault(name, []).append((at, at + n, torch.zeros(n, dtype=torch.uint8)))
            a = at
            while a < at + n:
                b = min(at + n, a + rng.choice([1, 3, 8, 40, 100, 200]))
                transfers.append(Transfer(rng.randint(0, 2), 0, name, a, b))
                a = b
            at += n + rng.choice([0, 16])
    rng.shuffle(segs["t0"])  # segments in any order
    return sorted(transfers, key=lambda t: (t.src, t.dst, t.name, t.start)), Segs(segs), pack_below


@pytest.mark.parametrize("seed", range(12))
def test_compiled_peers_are_the_walk_and_addresses_are_the_per_range_ones(seed: int) -> None:
    transfers, places, pack_below = _case(seed)
    walk = sd._walk(transfers, lambda t: t.dst == 0, lambda t: t.src, pack_below)
    peers = sr.compile_peers(walk, pack_below)
    assert list(peers) == list(walk)
    for src, plan in peers.items():
        msgs = walk[src]
        assert plan.msgs == msgs
        assert plan.alone == [sd._alone(m, pack_below) for m in msgs]
        order = [i for m in msgs for i, _ in m]  # the per-range path's seal order
        assert plan.index.tolist() == order
        packed = [t for m in msgs if not sd._alone(m, pack_below) for _, t in m]
        assert plan.pack_bytes == sum(t.nbytes for t in packed)
        offs = np.cumsum([0] + [t.nbytes for t in packed])[:-1]
        assert plan.pack_off.tolist() == offs.tolist()
        loc = sr.locate(plan, places, torch.device("cpu"), "destination")
        want = [places.at(transfers[i]).data_ptr() for i in order]
        assert loc.addr.tolist() == want
        for k in plan.alone_pos.tolist():
            piece = loc.piece(plan, k)
            assert piece.data_ptr() == want[k] and piece.numel() == plan.nbytes[k]
        pack = torch.empty(plan.pack_bytes, dtype=torch.uint8)
        bufs = sr._messages(plan, loc, pack)  # what each message is posted from or into
        assert len(bufs) == len(msgs)
        for buf, msg, alone in zip(bufs, msgs, plan.alone):
            if alone:
                t = msg[0][1]
                assert buf.data_ptr() == places.at(t).data_ptr() and buf.numel() == t.nbytes
            else:
                assert buf is pack
        term, index = plan.constants(torch.device("cpu"))
        assert index.tolist() == order
        assert term.tolist() == [sd._signed(transfers[i].nbytes << 40) for i in order]


def test_a_range_no_segment_holds_is_refused_by_name() -> None:
    ts = [Transfer(0, 0, "w", 0, 8), Transfer(0, 0, "w", 8, 24)]
    plan = sr.compile_peers(sd._walk(ts, lambda t: True, lambda t: t.src, 64), 64)[0]
    held = Segs({"w": [(0, 16, torch.zeros(16, dtype=torch.uint8))]})
    with pytest.raises(TransportError, match=r"no source for bytes \[8, 24\) of 'w'"):
        sr.locate(plan, held, torch.device("cpu"), "source")
    before = Segs({"w": [(4, 24, torch.zeros(20, dtype=torch.uint8))]})
    with pytest.raises(TransportError, match=r"no destination for bytes \[0, 8\) of 'w'"):
        sr.locate(plan, before, torch.device("cpu"), "destination")
    with pytest.raises(TransportError, match="no source of 'w'"):
        sr.locate(plan, Segs({}), torch.device("cpu"), "source")


@pytest.mark.parametrize("bad", [torch.zeros(6, dtype=torch.float32),
                                 torch.zeros(48, dtype=torch.uint8)[::2],
                                 torch.zeros(30, dtype=torch.uint8)])
def test_a_segment_that_is_not_its_bytes_is_refused(bad: torch.Tensor) -> None:
    ts = [Transfer(0, 0, "w", 0, 24)]
    plan = sr.compile_peers(sd._walk(ts, lambda t: True, lambda t: t.src, 64), 64)[0]
    with pytest.raises(TransportError, match=r"segment \[0, 24\) of 'w' is not 24 contiguous"):
        sr.locate(plan, Segs({"w": [(0, 24, bad)]}), torch.device("cpu"), "source")


def test_the_table_path_needs_a_gpu_and_sum64_or_no_checksum() -> None:
    assert not sr.usable(torch.device("cpu"), "sum64")
    ts = [Transfer(0, 0, "w", 0, 8)]
    plan = sr.compile_peers(sd._walk(ts, lambda t: True, lambda t: t.src, 64), 64)[0]
    assert sr.aligned(plan, np.array([16, 32]))
    assert not sr.aligned(plan, np.array([16, 34]))


def test_compiled_peers_are_kept_per_schedule_object_and_side() -> None:
    ts = [Transfer(0, 0, "w", 0, 8)]
    walk = sd._walk(ts, lambda t: True, lambda t: t.src, 64)
    a = sd._compiled(ts, walk, ("send", 0, 64), 64)
    assert sd._compiled(ts, walk, ("send", 0, 64), 64) is a
    assert sd._compiled(list(ts), walk, ("send", 0, 64), 64) is a  # an equal list
    other = [Transfer(0, 0, "w", 0, 16)]
    assert sd._compiled(other, sd._walk(other, lambda t: True, lambda t: t.src, 64),
                        ("send", 0, 64), 64) is not a  # another schedule
    assert sd._compiled(ts, walk, ("receive", 0, 64), 64) is not a
    assert sd._walked(ts, ("send", 0, 64), lambda t: False, lambda t: 0, 64) == walk


def test_addresses_follow_a_segment_that_moved_between_pushes() -> None:
    """`locate` keeps the last push's search while the segments have the same shape;
    the addresses always come from this push's segments (a parameter re-allocated:
    a kept address would write into memory the tensor no longer owns), and segments
    cut differently are searched anew and drop the tables made for the old ones."""
    transfers, places, pack_below = _case(5)
    walk = sd._walk(transfers, lambda t: t.dst == 0, lambda t: t.src, pack_below)
    for plan in sr.compile_peers(walk, pack_below).values():
        order = plan.index.tolist()
        first = sr.locate(plan, places, torch.device("cpu"), "destination")
        kept = plan._located["destination"]
        again = sr.locate(plan, places, torch.device("cpu"), "destination")
        assert plan._located["destination"] is kept  # the same shape: not searched again
        assert again.addr.tolist() == first.addr.tolist()
        moved = {n: [(a, b, torch.zeros_like(t)) for a, b, t in segs]
                 for n, segs in places.segs.items()}
        places2 = Segs(moved)
        third = sr.locate(plan, places2, torch.device("cpu"), "destination")
        assert third.addr.tolist() == [places2.at(transfers[i]).data_ptr() for i in order]
        assert third.addr.tolist() != first.addr.tolist()
        # cut differently (a segment split in two): searched anew
        name, segs = next((n, v) for n, v in moved.items() if v[0][1] - v[0][0] >= 16)
        a, b, t = segs[0]
        cut = a + 8
        moved[name] = [(a, cut, t[: cut - a]), (cut, b, t[cut - a:]), *segs[1:]]
        plan._tables[("destination", True)] = "stale"  # type: ignore[assignment]
        fourth = sr.locate(plan, places2, torch.device("cpu"), "destination")
        assert plan._located["destination"] is not kept
        assert ("destination", True) not in plan._tables  # its rows named the old segments
        assert fourth.addr.tolist() == [places2.at(transfers[i]).data_ptr() for i in order]


def test_once_asks_each_tensor_once_per_send() -> None:
    """`Once` (what `send_shards`/`receive_shards` wrap `places` in): a tensor's
    segments asked once for all peers of one call, the same answers."""
    transfers, places, pack_below = _case(7)
    asked: list[str] = []

    class Counting(Segs):
        def segments(self, name: str) -> list[tuple[int, int, torch.Tensor]]:
            asked.append(name)
            return super().segments(name)

    counting = Counting(places.segs)
    once = sr.Once(counting)
    walk = sd._walk(transfers, lambda t: t.dst == 0, lambda t: t.src, pack_below)
    for plan in sr.compile_peers(walk, pack_below).values():
        got = sr.locate(plan, once, torch.device("cpu"), "destination")
        want = sr.locate(plan, places, torch.device("cpu"), "destination")
        assert got.addr.tolist() == want.addr.tolist()
    assert sorted(asked) == sorted(set(asked))  # each tensor once
    assert set(asked) == {t.name for t in transfers}

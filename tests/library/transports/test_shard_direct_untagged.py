"""`transports/shard_direct.py`'s message order (issue 40), on gloo with every tag 0.

NCCL ignores tags: a sender's and a receiver's point-to-point messages between one pair
match by the order each side posts them, nothing else. `send_shards` and
`receive_shards` both post each pair's messages in the order `_walk` gives (its
transfers sent alone, in schedule order, then its pack, then its seals), so tags only
label them. With `tagged=False` every gloo message carries tag 0, which makes gloo
match as NCCL does (a pair's messages in posting order): 2 senders and 2 receivers (one
process, four ranks of one gloo group) exchange a schedule that interleaves peers, sizes
and packs, and every byte lands where it belongs. A receiver that walks its messages in
another order is caught by the digests when the messages carry no tags (and, with
tags, the same swap is harmless): the untagged run really depends on the order.
"""

from __future__ import annotations

import datetime as _dt
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import enginehooks.transports.shard_direct as sd
from enginehooks.core.errors import ChecksumError
from enginehooks.core.schedule import Transfer
from enginehooks.transports.shard_direct import receive_shards, send_shards

SIZE = 8192
PACK = 256  # transfers under this many bytes travel packed


def _groups(tmp_path: Path, world: int) -> list[Any]:
    store = dist.FileStore(str(tmp_path / "store"), world)
    out: list[Any] = [None] * world

    def make(rank: int) -> None:
        out[rank] = dist.ProcessGroupGloo(store, rank, world, _dt.timedelta(seconds=20))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _schedule() -> list[Transfer]:
    """Two tensors, each engine rank fed by both trainer ranks: ranges sent alone (equal
    sizes, so a swap lands whole messages in the wrong place) and short packed runs."""
    out = []
    for name in ("a", "b"):
        for dst in (0, 1):
            base = dst * SIZE // 2
            out += [Transfer(0, dst, name, base, base + 512),
                    Transfer(1, dst, name, base + 512, base + 1024),
                    Transfer(0, dst, name, base + 1024, base + 1024 + 100),  # packed
                    Transfer(1, dst, name, base + 1124, base + 1124 + 60),   # packed
                    Transfer(0, dst, name, base + 1184, base + 1184 + 512),
                    Transfer(1, dst, name, base + 1696, base + 1696 + 512)]
    return sorted(out)


def _run(tmp_path: Path, tagged: bool, swap: int | None = None,
         secret: bytes | None = None) -> tuple[dict[str, Any], list[Any]]:
    """Each rank on a thread of its own (rank `swap`'s named "swap"); (whether each
    tensor's bytes all landed, with the bytes sent) and each rank's result."""
    pgs = _groups(tmp_path, 4)
    ts = _schedule()
    g = torch.Generator().manual_seed(3)
    data = {n: torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=g) for n in "ab"}
    got = {n: torch.zeros(SIZE, dtype=torch.uint8) for n in "ab"}
    results: list[Any] = [None] * 4

    def rank(r: int) -> None:
        try:
            if r < 2:
                results[r] = send_shards(pgs[r], ts, r, lambda t: data[t.name][t.start:t.stop],
                                         senders=2, mid=5, secret=secret, checksum="xxh3", timeout_s=20,
                                         pack_below=PACK, tagged=tagged)
            else:
                results[r] = receive_shards(pgs[r], ts, r - 2,
                                            lambda t: got[t.name][t.start:t.stop],
                                            senders=2, mid=5, secret=secret, checksum="xxh3", timeout_s=20,
                                            pack_below=PACK, tagged=tagged)
        except Exception as e:  # reported below, per rank
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,), name="swap" if r == swap else None)
               for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    want = {n: torch.zeros(SIZE, dtype=torch.uint8) for n in "ab"}
    for t in ts:
        want[t.name][t.start:t.stop] = data[t.name][t.start:t.stop]
    assert all(isinstance(x, (int, Exception)) for x in results)
    out: dict[str, Any] = {n: torch.equal(got[n], want[n]) for n in "ab"}
    out["sent"] = sum(x for x in results[:2] if isinstance(x, int))
    return out, results


def test_untagged_messages_match_by_the_order_both_sides_walk() -> None:
    ts = _schedule()
    assert {len(sd._walk(ts, lambda t, e=e: t.dst == e, lambda t: t.src, PACK)[j])
            for e in (0, 1) for j in (0, 1)} == {5}  # two alone per tensor and one pack per pair


@pytest.mark.parametrize("tagged", [False, True], ids=["all-tags-0", "tagged"])
def test_two_senders_two_receivers_every_byte_lands(tmp_path: Path, tagged: bool) -> None:
    out, results = _run(tmp_path, tagged)
    assert not [x for x in results if isinstance(x, Exception)], results
    assert out["a"] is True and out["b"] is True
    total = sum(t.nbytes for t in _schedule())
    assert out["sent"] == total and sum(results[2:]) == total


@pytest.mark.parametrize("secret", [None, b"k" * 32], ids=["digest", "keyed"])
def test_a_receiver_walking_another_order_is_caught_untagged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret: bytes | None) -> None:
    """Engine rank 0 posts its first two messages from each sender swapped (same sizes):
    untagged, each lands in the other's place, and the seals (which carry each range's
    index, or its MAC) refuse it."""
    walk = sd._walk

    def swapped(transfers: Any, keep: Any, peer_of: Any, pack_below: int) -> Any:
        out = walk(transfers, keep, peer_of, pack_below)
        if threading.current_thread().name == "swap":  # engine rank 0 only
            out = {p: [msgs[1], msgs[0], *msgs[2:]] for p, msgs in out.items()}
        return out

    monkeypatch.setattr(sd, "_walk", swapped)
    out, results = _run(tmp_path, False, swap=2, secret=secret)
    assert isinstance(results[2], ChecksumError), results
    assert "of 'a' from trainer rank" in str(results[2])
    assert out["a"] is False  # the bytes did land in the wrong places

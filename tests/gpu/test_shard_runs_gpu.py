"""`transports/shard_runs.py` on one GPU, against the per-range path of
`transports/shard_direct.py`, on generated schedules (ranges of every size around
`pack_below`, tensors in several segments, keyed and not, with and without `sum64`):

- a sender's table path (`pack_peer`: one launch packs and digests) puts on the wire the
  same messages, byte for byte, and the same seals as the per-range path;
- a receiver's table path (`receive_buffers`, then `land_peer`: one launch unpacks and
  digests) lands every range where the per-range `dest` would, and accepts those seals;
- a byte flipped in the pack or in a range received alone, or two ranges' seals
  swapped, is a `ChecksumError` naming the range (each fails if `land_peer`'s compare
  is removed: the bytes would land silently);
- an address off the kernel's 4-byte words takes the per-range path (None).

The wire itself (NCCL between processes) is in test_shard_direct_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from enginehooks.core.errors import ChecksumError
from enginehooks.core.schedule import Transfer
from enginehooks.transports import shard_direct as sd
from enginehooks.transports import shard_runs as sr
from tests.support.segs import Segs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PACK_BELOW = 4096


def _case(seed: int, word: int = 4) -> tuple[list[Transfer], Segs, Segs]:
    """One sender (rank 0) to one receiver: random tensors in segments, cut into ranges
    whose sizes are multiples of `word` (4: every address on the table path's words);
    the sender's segments hold random bytes, the receiver's zeros, laid out apart."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    transfers: list[Transfer] = []
    src: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    dst: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for k in range(rng.randint(2, 7)):
        name, at = f"t{k}", 0
        for _ in range(rng.randint(1, 3)):
            n = word * rng.randint(1, 6000)
            src.setdefault(name, []).append(
                (at, at + n, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).cuda()))
            dst.setdefault(name, []).append((at, at + n, torch.zeros(n, dtype=torch.uint8,
                                                                     device="cuda")))
            a = at
            while a < at + n:
                b = min(at + n, a + word * rng.choice([1, 5, 64, 700, 1024, 3000]))
                transfers.append(Transfer(0, 0, name, a, b))
                a = b
            at += n
    return transfers, Segs(src), Segs(dst)


def _plan(transfers: list[Transfer]) -> tuple[dict, sr.PeerPlan]:
    walk = sd._walk(transfers, lambda t: True, lambda t: t.src, PACK_BELOW)
    return walk, sr.compile_peers(walk, PACK_BELOW)[0]


CASES = [(seed, secret, checksum) for seed in range(6)
         for secret, checksum in ((None, "sum64"), (b"k" * 32, "sum64"), (None, None))]


@pytest.mark.parametrize(("seed", "secret", "checksum"), CASES)
def test_tables_put_the_per_range_bytes_and_seals_on_the_wire_and_land_them(
        seed: int, secret: bytes | None, checksum: str | None) -> None:
    transfers, src, dst = _case(seed)
    walk, plan = _plan(transfers)
    assert any(plan.alone) and not all(plan.alone), "a case with ranges alone and packed"
    dev = torch.device("cuda", torch.cuda.current_device())
    fast = sr.pack_peer(plan, src, dev, secret, 9, checksum)
    assert fast is not None
    msgs, seals, _ = fast
    want_msgs, want_seals = sd._pack_per_range(walk[0], src.at, secret, 9, checksum,
                                               PACK_BELOW, True)
    assert len(msgs) == len(want_msgs)
    for a, b in zip(msgs, want_msgs):
        assert torch.equal(a, b)
    assert seals.tolist() == want_seals.tolist()
    landing = sr.receive_buffers(plan, dst, dev, checksum)
    assert landing is not None
    for buf, msg in zip(landing.msgs, msgs):  # the wire, without NCCL
        buf.copy_(msg)
    landing.words.copy_(seals)
    sr.land_peer(landing, transfers, secret, 9, checksum)
    for t in transfers:
        assert torch.equal(dst.at(t), src.at(t)), t


def _landed(seed: int, secret: bytes | None) -> tuple[list[Transfer], sr.Landing,
                                                      list[torch.Tensor], torch.Tensor]:
    transfers, src, dst = _case(seed)
    _, plan = _plan(transfers)
    dev = torch.device("cuda", torch.cuda.current_device())
    fast = sr.pack_peer(plan, src, dev, secret, 9, "sum64")
    assert fast is not None
    landing = sr.receive_buffers(plan, dst, dev, "sum64")
    assert landing is not None
    return transfers, landing, fast[0], fast[1]


@pytest.mark.parametrize("secret", [None, b"k" * 32], ids=["digest", "keyed"])
@pytest.mark.parametrize("where", ["pack", "alone"])
def test_a_flipped_byte_is_refused_naming_its_range(secret: bytes | None, where: str) -> None:
    transfers, landing, msgs, seals = _landed(3, secret)
    plan = landing.plan
    k = plan.alone.index(where == "alone")  # the first message of that kind
    pos = k if where == "alone" else int(plan.pack_pos[3])
    at = 0 if where == "alone" else int(plan.pack_off[3]) + 1
    for buf, msg in zip(landing.msgs, msgs):
        buf.copy_(msg)
    landing.msgs[k][at: at + 1].bitwise_xor_(0x10)
    landing.words.copy_(seals)
    t = transfers[int(plan.index[pos])]
    with pytest.raises(ChecksumError, match=rf"bytes \[{t.start}, {t.stop}\) of '{t.name}'"):
        sr.land_peer(landing, transfers, secret, 9, "sum64")


def test_seals_of_two_ranges_swapped_are_refused() -> None:
    transfers, landing, msgs, seals = _landed(4, None)
    for buf, msg in zip(landing.msgs, msgs):
        buf.copy_(msg)
    words = seals.clone().reshape(-1, 2)
    words[[0, 1]] = words[[1, 0]]  # digests and indices of ranges 0 and 1 traded places
    landing.words.copy_(words.reshape(-1))
    t = transfers[int(landing.plan.index[0])]
    with pytest.raises(ChecksumError, match=rf"bytes \[{t.start}, {t.stop}\) of '{t.name}'"):
        sr.land_peer(landing, transfers, None, 9, "sum64")


def test_addresses_off_the_kernel_words_take_the_per_range_path() -> None:
    transfers, src, dst = _case(1, word=2)  # ranges of odd halves: pack offsets off 4
    _, plan = _plan(transfers)
    assert (plan.pack_off % 4).any()
    dev = torch.device("cuda", torch.cuda.current_device())
    assert sr.pack_peer(plan, src, dev, None, 9, "sum64") is None
    assert sr.receive_buffers(plan, dst, dev, "sum64") is None


def test_steady_pushes_reuse_their_tables_and_a_moved_destination_is_followed() -> None:
    """Three pushes of one plan: the second reuses the tables made for the first and
    lands the new bytes; before the third every destination moved (new tensors of the
    same sizes): the tables are reused with this push's addresses, so the bytes land in
    the new tensors and the old ones keep the second push's bytes (a table that kept
    the old addresses would write there)."""
    transfers, src, dst = _case(2)
    _, plan = _plan(transfers)
    dev = torch.device("cuda", torch.cuda.current_device())

    def push(into: Segs) -> None:
        fast = sr.pack_peer(plan, src, dev, None, 9, "sum64")
        assert fast is not None
        landing = sr.receive_buffers(plan, into, dev, "sum64")
        assert landing is not None
        for buf, msg in zip(landing.msgs, fast[0]):
            buf.copy_(msg)
        landing.words.copy_(fast[1])
        sr.land_peer(landing, transfers, None, 9, "sum64")

    push(dst)
    kept = dict(plan._tables)
    for segs in src.segs.values():  # new weights in place
        for _, _, t in segs:
            t.add_(1)
    push(dst)
    assert len(kept) == 4 and all(plan._tables[k] is kept[k] for k in kept)  # reused
    for t in transfers:
        assert torch.equal(dst.at(t), src.at(t)), t
    moved = Segs({n: [(a, b, torch.zeros_like(x)) for a, b, x in segs]
                  for n, segs in dst.segs.items()})
    for segs in src.segs.values():
        for _, _, t in segs:
            t.add_(1)
    push(moved)  # the same shape at other addresses: the tables again, new addresses
    assert all(plan._tables[k] is kept[k] for k in kept)
    for t in transfers:
        assert torch.equal(moved.at(t), src.at(t)), t
        assert torch.equal(dst.at(t), src.at(t) - 1), t

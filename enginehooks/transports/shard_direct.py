"""Shard-direct over gloo point to point (issue 40): each trainer rank sends only the
byte ranges the static schedule gives it, straight to the engine ranks that need them.

The group holds the `senders` trainer ranks at group ranks 0..senders-1 and the engine
ranks after them (engine rank e at `senders + e`). Both sides walk the same list of
`Transfer`s (the schedule in the signed manifest, `wire/schedule.py`) and tag transfer
i with i, so every receive matches its send whatever order gloo delivers them in. The
receiver posts each receive straight into the buffer its side chose (`dest`: a slice of
the engine's parameter where the copy plan is a plain copy, a staging tensor otherwise).
Transfers under `PACK_BELOW` bytes (a row-parallel slice is one short run per row) travel
packed, one message per (trainer rank, engine rank) pair, and are copied into their
destinations on arrival.

Digests per range: after its ranges, each sender sends every engine rank it served one
message of two int64 words per transfer: the range's digest (`core/checksums.py`) and,
with a shared secret, the 128-bit HMAC of the update id, transfer index, size and digest
(`core/auth.bucket_mac`, as a bucket's trailer) in its place. The receiver recomputes
each range's digest over the bytes where they landed and raises `ChecksumError` naming
the tensor and the range on the first that differs (a range received straight into a
parameter is then already written: the update is torn there, as any failed update).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.core.auth import bucket_mac
from enginehooks.core.checksums import digest
from enginehooks.core.errors import ChecksumError, TransportError
from enginehooks.core.schedule import Transfer

_MASK63 = (1 << 63) - 1


def _signed(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v > _MASK63 else v


def _seal(secret: bytes | None, mid: int, index: int, buf: torch.Tensor,
          checksum: str | None) -> tuple[int, int]:
    dig = digest(checksum, buf)
    if secret is None:
        return _signed(dig), 0
    return bucket_mac(secret, mid, index, buf.numel(), dig)


def _wait(works: Sequence[Any], timeout_s: float, what: str) -> None:
    for w in works:
        try:
            w.wait(_dt.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise TransportError(f"shard-direct {what} failed: {e}") from e


#: Transfers smaller than this travel packed, one message per (trainer rank, engine rank)
#: pair: a row-parallel slice is one short run per row, and a message per run costs more
#: than its bytes (gloo: about 0.3 x the link rate unpacked, on simulated nodes).
PACK_BELOW = 1 << 18


def _split(transfers: Sequence[Transfer], keep: Callable[[Transfer], bool], pack_below: int
           ) -> tuple[list[tuple[int, Transfer]], dict[tuple[int, int], list[tuple[int, Transfer]]]]:
    """(the transfers sent alone, the packed ones per (src, dst)), both in schedule order."""
    alone: list[tuple[int, Transfer]] = []
    packed: dict[tuple[int, int], list[tuple[int, Transfer]]] = {}
    for i, t in enumerate(transfers):
        if keep(t):
            if t.nbytes < pack_below:
                packed.setdefault((t.src, t.dst), []).append((i, t))
            else:
                alone.append((i, t))
    return alone, packed


def _checked(buf: torch.Tensor, t: Transfer, what: str) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.numel() != t.nbytes or not buf.is_contiguous():
        raise TransportError(f"shard-direct: the {what} of {t} is not {'its ' * (what == 'source')}"
                             f"{t.nbytes} contiguous bytes")
    return buf


def send_shards(group: Any, transfers: Sequence[Transfer], me: int,
                source: Callable[[Transfer], torch.Tensor], *, senders: int, mid: int,
                secret: bytes | None = None, checksum: str | None = "xxh3",
                timeout_s: float = 60.0, pack_below: int = PACK_BELOW) -> int:
    """Send trainer rank `me`'s transfers of `transfers` (the whole schedule, in its
    order): `source(t)` is the 1-D uint8 tensor of t's bytes. A transfer of at least
    `pack_below` bytes is a message of its own (tag: its index); the smaller ones to one
    engine rank are packed into one message (tag: len(transfers)); the seals follow
    (tag: len(transfers) + 1). Returns the bytes sent."""
    works: list[Any] = []
    seals: dict[int, list[int]] = {}
    sent, n = 0, len(transfers)
    alone, packed = _split(transfers, lambda t: t.src == me, pack_below)
    for i, t in alone:
        buf = _checked(source(t), t, "source")
        seals.setdefault(t.dst, []).extend(_seal(secret, mid, i, buf, checksum))
        works.append(dist.isend(buf, group=group, group_dst=senders + t.dst, tag=i))
        sent += t.nbytes
    for (_, dst), items in sorted(packed.items()):
        parts = []
        for i, t in items:
            buf = _checked(source(t), t, "source")
            seals.setdefault(dst, []).extend(_seal(secret, mid, i, buf, checksum))
            parts.append(buf)
            sent += t.nbytes
        works.append(dist.isend(torch.cat(parts), group=group, group_dst=senders + dst, tag=n))
    words = {dst: torch.tensor(v, dtype=torch.int64) for dst, v in seals.items()}
    works += [dist.isend(w, group=group, group_dst=senders + dst, tag=n + 1)
              for dst, w in sorted(words.items())]
    _wait(works, timeout_s, "send")
    return sent


def receive_shards(group: Any, transfers: Sequence[Transfer], me: int,
                   dest: Callable[[Transfer], torch.Tensor], *, senders: int, mid: int,
                   secret: bytes | None = None, checksum: str | None = "xxh3",
                   timeout_s: float = 60.0, pack_below: int = PACK_BELOW) -> int:
    """Receive engine rank `me`'s transfers of `transfers` into `dest(t)` (a 1-D uint8
    contiguous tensor of t's size, where t's bytes should land; the packed ones are
    copied there from their message), then check every range's digest where it landed,
    in the order the sender sealed them. Returns the bytes received."""
    n = len(transfers)
    alone, packed = _split(transfers, lambda t: t.dst == me, pack_below)
    works, got = [], 0
    bufs: dict[int, torch.Tensor] = {}
    order: dict[int, list[int]] = {}  # src -> transfer indices, in the sender's seal order
    for i, t in alone:
        bufs[i] = _checked(dest(t), t, "destination")
        works.append(dist.irecv(bufs[i], group=group, group_src=t.src, tag=i))
        order.setdefault(t.src, []).append(i)
        got += t.nbytes
    packs = {}
    for (src, _), items in sorted(packed.items()):
        for i, t in items:
            bufs[i] = _checked(dest(t), t, "destination")
            order.setdefault(src, []).append(i)
            got += t.nbytes
        packs[src] = torch.empty(sum(t.nbytes for _, t in items), dtype=torch.uint8)
        works.append(dist.irecv(packs[src], group=group, group_src=src, tag=n))
    words = {src: torch.empty(2 * len(idx), dtype=torch.int64) for src, idx in order.items()}
    works += [dist.irecv(w, group=group, group_src=src, tag=n + 1)
              for src, w in sorted(words.items())]
    _wait(works, timeout_s, "receive")
    for (src, _), items in packed.items():
        at = 0
        for i, t in items:
            bufs[i].copy_(packs[src][at: at + t.nbytes])
            at += t.nbytes
    for src, idx in order.items():
        sealed = words[src].tolist()
        for k, i in enumerate(idx):
            expect = (sealed[2 * k], sealed[2 * k + 1])
            if _seal(secret, mid, i, bufs[i], checksum) != expect:
                t = transfers[i]
                raise ChecksumError(
                    f"shard-direct: bytes [{t.start}, {t.stop}) of {t.name!r} from trainer "
                    f"rank {t.src} do not match their {'keyed ' if secret else ''}digest")
    return got

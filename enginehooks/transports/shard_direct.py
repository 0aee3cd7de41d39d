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

`peer` (both functions): where a rank of the other side is, as (process group, rank in
it). The default is the one group above; the `shard` transport (`ShardTransport`, below)
uses the groups `WeightSync` forms for several senders instead: sender j's own group
holds it at rank 0 and every engine worker after it (engine rank e at 1 + e), so the
point-to-point messages travel in the groups the broadcast path already has, and a
manifest without a schedule (the first push, before the engines recorded the copy plans
their needs come from) is broadcast over the same groups.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from enginehooks.core.auth import bucket_mac, load_secret
from enginehooks.core.buckets import manifest_id
from enginehooks.core.checksums import digest
from enginehooks.core.dtypes import torch_dtype
from enginehooks.core.errors import ChecksumError, TransportError
from enginehooks.core.manifest import Manifest
from enginehooks.core.schedule import Transfer
from enginehooks.transports.base import (
    Abort,
    Receiver,
    Sender,
    SendStats,
    Stream,
    Target,
    Transport,
)
from enginehooks.transports.broadcast import BroadcastReceiver, BroadcastSender
from enginehooks.transports.multisender import MultiReceiver
from enginehooks.wire.schedule import SCHEDULE_KEY, ShardSchedule

#: (process group, rank in it) of a rank of the other side (module docstring)
Peer = Callable[[int], tuple[Any, int]]

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


def _isend(pg: Any, buf: torch.Tensor, rank: int, tag: int) -> Any:
    """A send on a registered group (`dist.isend`) or on a group's own backend object
    (`transports/_rendezvous.new_group`'s, which `dist` does not know)."""
    if isinstance(pg, dist.ProcessGroup):
        return dist.isend(buf, group=pg, group_dst=rank, tag=tag)
    return pg.send([buf], rank, tag)


def _irecv(pg: Any, buf: torch.Tensor, rank: int, tag: int) -> Any:
    if isinstance(pg, dist.ProcessGroup):
        return dist.irecv(buf, group=pg, group_src=rank, tag=tag)
    return pg.recv([buf], rank, tag)


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
                timeout_s: float = 60.0, pack_below: int = PACK_BELOW,
                peer: Peer | None = None) -> int:
    """Send trainer rank `me`'s transfers of `transfers` (the whole schedule, in its
    order): `source(t)` is the 1-D uint8 tensor of t's bytes. A transfer of at least
    `pack_below` bytes is a message of its own (tag: its index); the smaller ones to one
    engine rank are packed into one message (tag: len(transfers)); the seals follow
    (tag: len(transfers) + 1). `peer(e)`: engine rank e's group and rank in it (module
    docstring). Returns the bytes sent."""
    to: Peer = peer if peer is not None else (lambda e: (group, senders + e))
    works: list[Any] = []
    seals: dict[int, list[int]] = {}
    sent, n = 0, len(transfers)
    alone, packed = _split(transfers, lambda t: t.src == me, pack_below)
    for i, t in alone:
        buf = _checked(source(t), t, "source")
        seals.setdefault(t.dst, []).extend(_seal(secret, mid, i, buf, checksum))
        works.append(_isend(to(t.dst)[0], buf, to(t.dst)[1], i))
        sent += t.nbytes
    for (_, dst), items in sorted(packed.items()):
        parts = []
        for i, t in items:
            buf = _checked(source(t), t, "source")
            seals.setdefault(dst, []).extend(_seal(secret, mid, i, buf, checksum))
            parts.append(buf)
            sent += t.nbytes
        works.append(_isend(to(dst)[0], torch.cat(parts), to(dst)[1], n))
    words = {dst: torch.tensor(v, dtype=torch.int64) for dst, v in seals.items()}
    works += [_isend(to(dst)[0], w, to(dst)[1], n + 1) for dst, w in sorted(words.items())]
    _wait(works, timeout_s, "send")
    return sent


def receive_shards(group: Any, transfers: Sequence[Transfer], me: int,
                   dest: Callable[[Transfer], torch.Tensor], *, senders: int, mid: int,
                   secret: bytes | None = None, checksum: str | None = "xxh3",
                   timeout_s: float = 60.0, pack_below: int = PACK_BELOW,
                   peer: Peer | None = None) -> int:
    """Receive engine rank `me`'s transfers of `transfers` into `dest(t)` (a 1-D uint8
    contiguous tensor of t's size, where t's bytes should land; the packed ones are
    copied there from their message), then check every range's digest where it landed,
    in the order the sender sealed them. `peer(j)`: trainer rank j's group and rank in
    it. Returns the bytes received."""
    frm: Peer = peer if peer is not None else (lambda j: (group, j))
    n = len(transfers)
    alone, packed = _split(transfers, lambda t: t.dst == me, pack_below)
    works, got = [], 0
    bufs: dict[int, torch.Tensor] = {}
    order: dict[int, list[int]] = {}  # src -> transfer indices, in the sender's seal order
    for i, t in alone:
        bufs[i] = _checked(dest(t), t, "destination")
        works.append(_irecv(frm(t.src)[0], bufs[i], frm(t.src)[1], i))
        order.setdefault(t.src, []).append(i)
        got += t.nbytes
    packs = {}
    for (src, _), items in sorted(packed.items()):
        for i, t in items:
            bufs[i] = _checked(dest(t), t, "destination")
            order.setdefault(src, []).append(i)
            got += t.nbytes
        packs[src] = torch.empty(sum(t.nbytes for _, t in items), dtype=torch.uint8)
        works.append(_irecv(frm(src)[0], packs[src], frm(src)[1], n))
    words = {src: torch.empty(2 * len(idx), dtype=torch.int64) for src, idx in order.items()}
    works += [_irecv(frm(src)[0], w, frm(src)[1], n + 1) for src, w in sorted(words.items())]
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


# -- the `shard` transport: shard-direct as a path of `WeightSync` ---------------------------
class ShardSource(Protocol):
    """One trainer rank's own bytes (`trainer_side/fsdp.FSDP2Shards`)."""

    #: this rank's index among the senders (the schedule's `src`)
    rank: int

    def source(self, t: Transfer) -> torch.Tensor:
        """This rank's bytes [t.start, t.stop) of tensor t.name (1-D uint8)."""
        ...


class ShardStream:
    """What a `shard` sender is handed in place of the trainer's stream. Iterated, it is
    that stream (`stream()`: what a manifest without a schedule broadcasts, gathering as
    the adapter does); `shards()` is this rank's own bytes, read from its placements
    with no collective (what a scheduled manifest sends). Neither is made unless used:
    a scheduled push never starts the stream, so no rank gathers."""

    def __init__(self, stream: Callable[[], Stream], shards: Callable[[], ShardSource]) -> None:
        self._stream, self.shards = stream, shards

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._stream())


def _gloo_endpoint(endpoint: dict[str, Any]) -> dict[str, Any]:
    """`endpoint` (the `shard` transport's) as the gloo broadcast receivers read it."""
    out = {**endpoint, "transport": "gloo"}
    if isinstance(out.get("senders"), list):
        out["senders"] = [{**ep, "transport": "gloo"} if isinstance(ep, dict) else ep
                          for ep in out["senders"]]
    return out


class ShardSender(BroadcastSender):
    """A trainer rank's half of the `shard` transport: its gloo broadcast group (sender
    at rank 0, every engine worker after it); a manifest with a schedule is sent point
    to point along it (`send_shards`), one without is broadcast (`BroadcastSender`)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("gloo", **options)

    def endpoint(self) -> dict[str, Any]:
        return {**super().endpoint(), "transport": ShardTransport.name}

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        if SCHEDULE_KEY not in manifest.meta:
            stats = super().send(manifest, stream, abort)
            stats.extra["schedule"] = f"off: {manifest.meta.get('schedule_off', 'broadcast')}"
            return stats
        if self.pg is None:
            raise TransportError("send() before connect(): the group has not formed")
        shards = getattr(stream, "shards", None)
        if not callable(shards):
            raise TransportError("a scheduled manifest is sent from a ShardStream (the "
                                 "trainer rank's own shards), not from a stream of tensors")
        src: ShardSource = shards()
        sched = ShardSchedule.of(manifest)
        if not 0 <= src.rank < sched.senders:
            raise TransportError(f"trainer rank {src.rank} is not one of the schedule's "
                                 f"{sched.senders} senders")
        t0 = time.perf_counter()
        pg = self.pg
        try:
            sent = send_shards(pg, sched.transfers, src.rank, src.source,
                               senders=sched.senders, mid=manifest_id(manifest),
                               secret=self.secret, checksum=manifest.checksum,
                               timeout_s=self.timeout_s, peer=lambda e: (pg, 1 + e))
        except BaseException:
            self._break()  # the group's state is unknown: the next push forms it anew
            raise
        mine = sum(1 for t in sched.transfers if t.src == src.rank)
        return SendStats(bytes=sent, buckets=0, seconds=time.perf_counter() - t0,
                         extra={"schedule": {"rank": src.rank, "bytes": sent,
                                             "transfers": mine}})


class ShardReceiver(Receiver):
    """An engine worker's half of the `shard` transport: the gloo broadcast receiver of
    every sender's group (`MultiReceiver`, or one `BroadcastReceiver` for one sender).
    A manifest with a schedule is received point to point (`receive_shards`): this
    worker's transfers (engine rank = its group rank - 1) land in tensors of each
    checkpoint tensor's shape, where only the runs its loader reads are filled, and
    then go to the target as any update does (`Target.apply`: the copy plan writes the
    planned tensors, the loader takes the rest, verification as for every update). A
    bad digest raises `ChecksumError` before anything is applied. Memory: the staged
    tensors, one model's bytes at most."""

    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        ep = _gloo_endpoint(endpoint)
        cpu = torch.device("cpu")
        self.inner: MultiReceiver | BroadcastReceiver = (
            MultiReceiver(ep, rank, cpu) if "senders" in ep else BroadcastReceiver(ep, rank, cpu))
        self.rank = rank
        self.timeout_s = float(ep.get("timeout_s") or 120.0)
        self.secret = load_secret()  # this engine process's shared secret, if any

    def connect(self) -> None:
        self.inner.connect()

    @property
    def broken(self) -> bool:
        return self.inner.broken

    def close(self) -> None:
        self.inner.close()

    def groups(self) -> list[Any]:
        """Each sender's process group, in sender order."""
        parts = self.inner.parts if isinstance(self.inner, MultiReceiver) else [self.inner]
        return [p.pg for p in parts]

    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        if SCHEDULE_KEY not in manifest.meta:
            return self.inner.deliver(manifest, target)
        t0 = time.perf_counter()
        sched = ShardSchedule.of(manifest)
        groups = self.groups()
        if len(groups) != sched.senders or any(g is None for g in groups):
            raise TransportError(f"the schedule has {sched.senders} senders; this worker is in "
                                 f"the groups of {len(groups)}")
        me = self.rank - 1
        specs = {t.name: t for t in manifest.tensors}
        staged: dict[str, torch.Tensor] = {}

        def dest(t: Transfer) -> torch.Tensor:
            buf = staged.get(t.name)
            if buf is None:  # zeros: bytes this rank's loader does not read stay defined
                buf = staged[t.name] = torch.zeros(specs[t.name].nbytes, dtype=torch.uint8)
            return buf[t.start: t.stop]

        try:
            got = receive_shards(None, sched.transfers, me, dest, senders=sched.senders,
                                 mid=manifest_id(manifest), secret=self.secret,
                                 checksum=manifest.checksum, timeout_s=self.timeout_s,
                                 peer=lambda j: (groups[j], 0))
        except ChecksumError:
            raise  # the groups are intact: the update is refused, nothing applied
        except BaseException:
            self.close()  # a failed receive leaves the groups in an unknown state
            raise
        t1 = time.perf_counter()
        target.apply((name, staged[name].view(torch_dtype(spec.dtype)).view(tuple(spec.shape)))
                     for name, spec in specs.items() if name in staged)
        return {"bytes": got, "seconds": time.perf_counter() - t0,
                "schedule": {"engine_rank": me, "received": got, "tensors": len(staged),
                             "receive_s": round(t1 - t0, 4),
                             "apply_s": round(time.perf_counter() - t1, 4)}}


class ShardTransport(Transport):
    """Shard-direct over gloo (issue 40): every trainer rank sends only its own shards'
    intersections with what each engine worker's loader reads, point to point, along
    the static schedule in the signed manifest (`control/shard_schedule.py`); until the
    engines report their needs (no copy plan recorded yet) or where the trainer's
    placements are not schedulable, the same groups carry a broadcast. CPU tensors."""

    name = "shard"
    several_senders: ClassVar[bool] = True
    #: the coordinator plans a static schedule for this transport (`WeightSync`)
    schedules: ClassVar[bool] = True
    direct_min: ClassVar[int | None] = 1 << 20

    def sender(self, **options: Any) -> Sender:
        return ShardSender(**options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return ShardReceiver(endpoint, rank, device)

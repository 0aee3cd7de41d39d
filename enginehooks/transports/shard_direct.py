"""Shard-direct point to point (issue 40), over gloo (host memory) or NCCL (GPUs): each
trainer rank sends only the byte ranges the static schedule gives it, straight to the
engine ranks that need them.

The group holds the `senders` trainer ranks at group ranks 0..senders-1 and the engine
ranks after them (engine rank e at `senders + e`). Both sides walk the same list of
`Transfer`s (the schedule in the signed manifest, `wire/schedule.py`) and post each
pair's messages in one order (`_walk`): its transfers sent alone, in schedule order,
then its pack, then its seals. On gloo each message also carries a tag (transfer i's
is i); NCCL ignores tags and matches a pair's messages by that order alone
(tests/library/transports/test_shard_direct_untagged.py runs gloo with every tag 0).
The receiver posts each receive straight into the buffer its side chose (`dest`: a
slice of the engine's parameter where the copy plan is a plain copy, a staging tensor
otherwise). Transfers under `PACK_BELOW` bytes (a row-parallel slice is one short run
per row) travel packed, one message per (trainer rank, engine rank) pair, packed and
unpacked on their device, and are copied into their destinations on arrival.

NCCL (the group's backend decides; every buffer then on the rank's GPU): each rank's
messages go out as one batch per group (`dist.batch_isend_irecv`, or the same
coalescing on a group's backend object: `_post`), one NCCL group call, so the pairs run
concurrently; the host waits on a CUDA event it polls against `timeout_s`
(`broadcast.wait_work`), so a dead peer is a `TransportError` within the timeout, never
a hang in a host sync. Digests with `sum64` are computed on the device, the seals sent
as a device tensor, and read to the host once per peer (`_seal_all`).

Digests per range: after its ranges, each sender sends every engine rank it served one
message of two int64 words per transfer: the range's digest (`core/checksums.py`) and
its index in the schedule (a range received into another's place, were the two sides'
orders ever to differ, is refused) or, with a shared secret, the 128-bit HMAC of the
update id, transfer index, size and digest (`core/auth.bucket_mac`, as a bucket's
trailer) in their place. The receiver recomputes each range's digest over the bytes
where they landed and raises `ChecksumError` naming the tensor and the range on the
first that differs (a range received straight into a parameter is then already
written: the update is torn there, as any failed update).

`peer` (both functions): where a rank of the other side is, as (process group, rank in
it). The default is the one group above; the `shard` and `shard_nccl` transports
(`ShardTransport`, `ShardNcclTransport`, below) use the groups `WeightSync` forms for
several senders instead: sender j's own group holds it at rank 0 and every engine
worker after it (engine rank e at 1 + e), so the point-to-point messages travel in the
groups the broadcast path already has, and a manifest without a schedule (the first
push, before the engines recorded the copy plans their needs come from) is broadcast
over the same groups.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from enginehooks.core.auth import bucket_mac, load_secret
from enginehooks.core.buckets import manifest_id
from enginehooks.core.checksums import digest, sum64_into
from enginehooks.core.dtypes import torch_dtype
from enginehooks.core.errors import ChecksumError, TransportError
from enginehooks.core.manifest import Manifest
from enginehooks.core.schedule import Transfer
from enginehooks.transports import shard_runs
from enginehooks.transports.base import (
    Abort,
    Receiver,
    Sender,
    SendStats,
    Stream,
    Target,
    Transport,
)
from enginehooks.transports.broadcast import BroadcastReceiver, BroadcastSender, wait_work
from enginehooks.transports.multisender import MultiReceiver
from enginehooks.wire.schedule import SCHEDULE_KEY, ShardSchedule

#: (process group, rank in it) of a rank of the other side (module docstring)
Peer = Callable[[int], tuple[Any, int]]

_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v > _MASK63 else v


def _seal(secret: bytes | None, mid: int, index: int, buf: torch.Tensor,
          checksum: str | None) -> tuple[int, int]:
    dig = digest(checksum, buf)
    if secret is None:  # the index: a range that landed in another's place is caught
        return _signed(dig), index
    return bucket_mac(secret, mid, index, buf.numel(), dig)


def _seal_all(secret: bytes | None, mid: int, items: Sequence[tuple[int, torch.Tensor]],
              checksum: str | None) -> torch.Tensor:
    """The seals of one peer's transfers (`items`: (transfer index, its bytes), in the
    order both sides post them) as 2 int64 words each, on the bytes' device. On a GPU
    with `sum64` the digests are computed there, one kernel per range and no host sync
    (`sum64_into`); with a secret they are read to the host once for the whole peer
    (the HMAC runs there). Elsewhere, `_seal` per range (a host digest)."""
    device = items[0][1].device if items else torch.device("cpu")
    if device.type != "cuda" or checksum != "sum64":
        return torch.tensor([w for i, buf in items for w in _seal(secret, mid, i, buf, checksum)],
                            dtype=torch.int64).to(device)
    acc = torch.zeros(len(items), dtype=torch.int64, device=device)
    for k, (_, buf) in enumerate(items):
        sum64_into(buf, acc, k)
    # sum64's length term, as `checksums._sum64` adds it: (n << 40) modulo 2**64
    acc ^= torch.tensor([_signed(buf.numel() << 40) for _, buf in items],
                        dtype=torch.int64).to(device, non_blocking=True)
    if secret is None:
        index = torch.tensor([i for i, _ in items], dtype=torch.int64)
        return torch.stack([acc, index.to(device, non_blocking=True)], dim=1).reshape(-1)
    digs = acc.tolist()  # the one host read of this peer's digests
    return torch.tensor([w for (i, buf), d in zip(items, digs)
                         for w in bucket_mac(secret, mid, i, buf.numel(), d & _MASK64)],
                        dtype=torch.int64).to(device)


def _is_nccl(pg: Any) -> bool:
    """Whether `pg` (a registered group or a backend object) runs NCCL."""
    if isinstance(pg, dist.ProcessGroup):
        return str(dist.get_backend(pg)) == "nccl"
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    return nccl is not None and isinstance(pg, nccl)


def _wait(works: Sequence[Any], timeout_s: float, what: str,
          device: torch.device | None = None) -> None:
    """Every work done within `timeout_s` each, or a `TransportError` saying what failed.
    On a GPU (`device`) the host waits on a CUDA event it polls against the timeout
    (`broadcast.wait_work`): NCCL's own `wait()` only orders the current stream, and a
    later host sync on a dead peer would hang past every deadline."""
    for w in works:
        if w is None:  # a coalesced batch's own sends and receives: its end work waits
            continue
        if device is not None and device.type == "cuda":
            wait_work(w, None, timeout_s, f"shard-direct {what}", device)
            continue
        try:
            w.wait(_dt.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise TransportError(f"shard-direct {what} failed: {e}") from e


#: Transfers smaller than this travel packed, one message per (trainer rank, engine rank)
#: pair: a row-parallel slice is one short run per row, and a message per run costs more
#: than its bytes (gloo: about 0.3 x the link rate unpacked, on simulated nodes).
PACK_BELOW = 1 << 18

#: one point-to-point message: (group, rank in it, tensor, tag)
_Op = tuple[Any, int, torch.Tensor, int]


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


def _post(ops: Sequence[_Op], send: bool, batched: bool) -> list[Any]:
    """Post `ops` (each pair's in the order both sides walk them). Over gloo, one
    `isend`/`irecv` each (gloo matches a pair's messages by tag, and in posting order
    within a tag). Over NCCL (`batched`), which ignores tags and runs a pair's
    messages in posting order, one batch per group: `dist.batch_isend_irecv` on a
    registered group, `_start_coalescing`/`_end_coalescing` on a backend object (what
    `batch_isend_irecv` does inside): one NCCL group call, so the sends to (or the
    receives from) different peers run concurrently rather than each waiting on the
    one before it on the group's stream, which could deadlock across peers."""
    if not batched:
        post = _isend if send else _irecv
        return [post(pg, buf, rank, tag) for pg, rank, buf, tag in ops]
    groups: dict[int, list[_Op]] = {}
    for op in ops:
        groups.setdefault(id(op[0]), []).append(op)
    works: list[Any] = []
    for group_ops in groups.values():
        pg = group_ops[0][0]
        if isinstance(pg, dist.ProcessGroup):
            fn = dist.isend if send else dist.irecv
            works += dist.batch_isend_irecv(
                [dist.P2POp(fn, buf, group=pg, group_peer=rank)
                 for _, rank, buf, _ in group_ops])
            continue
        pg._start_coalescing()
        try:
            for _, rank, buf, _ in group_ops:  # their own works are the batch's (None)
                (pg.send if send else pg.recv)([buf], rank, 0)
        finally:
            works.append(pg._end_coalescing())
    return works


def _walk(transfers: Sequence[Transfer], keep: Callable[[Transfer], bool],
          peer_of: Callable[[Transfer], int], pack_below: int
          ) -> dict[int, list[list[tuple[int, Transfer]]]]:
    """The messages of every peer (the other side's rank, `peer_of`), in the one order
    both sides post them: each transfer of at least `pack_below` bytes alone, in
    schedule order, then one message packing the smaller ones (schedule order). The
    seals follow as the peer's last message. NCCL matches a pair's messages by this
    order alone, so a sender and a receiver that walk the same signed schedule agree
    on it message by message (`test_shard_direct_untagged.py` proves it on gloo with
    every tag 0)."""
    alone: dict[int, list[list[tuple[int, Transfer]]]] = {}
    packed: dict[int, list[tuple[int, Transfer]]] = {}
    for i, t in enumerate(transfers):
        if keep(t):
            if t.nbytes < pack_below:
                packed.setdefault(peer_of(t), []).append((i, t))
            else:
                alone.setdefault(peer_of(t), []).append([(i, t)])
    return {p: alone.get(p, []) + ([packed[p]] if p in packed else [])
            for p in sorted({*alone, *packed})}


def _checked(buf: torch.Tensor, t: Transfer, what: str, cuda: bool) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.numel() != t.nbytes or not buf.is_contiguous():
        raise TransportError(f"shard-direct: the {what} of {t} is not {'its ' * (what == 'source')}"
                             f"{t.nbytes} contiguous bytes")
    if (buf.device.type == "cuda") != cuda:
        raise TransportError(f"shard-direct: the {what} of {t} is on {buf.device}; over "
                             f"{'NCCL' if cuda else 'gloo'} it must be on "
                             f"{'a CUDA device' if cuda else 'the host'}")
    return buf


def _alone(msg: list[tuple[int, Transfer]], pack_below: int) -> bool:
    """Whether a message of `_walk` is one transfer sent alone (else a pack)."""
    return len(msg) == 1 and msg[0][1].nbytes >= pack_below


class _Clock:
    """Adds the host seconds since its last call to `phases[name]` (nothing where
    `phases` is None)."""

    def __init__(self, phases: dict[str, float] | None) -> None:
        self.phases, self.t = phases, time.perf_counter()

    def __call__(self, name: str) -> None:
        if self.phases is not None:
            now = time.perf_counter()
            self.phases[name] = self.phases.get(name, 0.0) + now - self.t
            self.t = now


def _outgoing(dst: int, msgs: list[list[tuple[int, Transfer]]], bufs: list[torch.Tensor],
              seals: torch.Tensor) -> list[torch.Tensor]:
    """Engine rank `dst`'s messages (`msgs`: their transfers, `bufs`: their bytes) as
    they are posted, after they were sealed: the seam where the fault tests flip a
    byte on the wire (both paths pass through it)."""
    return bufs


def _compiled(transfers: Sequence[Transfer], walk: dict[int, list[list[tuple[int, Transfer]]]],
              key: tuple[object, ...], pack_below: int) -> dict[int, shard_runs.PeerPlan]:
    got = shard_runs.COMPILED.get(transfers, key)
    if got is None:
        got = shard_runs.compile_peers(walk, pack_below)
        shard_runs.COMPILED.put(transfers, key, got)
    return got


def _walked(transfers: Sequence[Transfer], key: tuple[object, ...],
            keep: Callable[[Transfer], bool], peer_of: Callable[[Transfer], int],
            pack_below: int) -> dict[int, list[list[tuple[int, Transfer]]]]:
    """`_walk`, from the compiled peers where this schedule was compiled before (the
    walk is a Python pass over every transfer)."""
    got = shard_runs.COMPILED.get(transfers, key)
    if got is not None:
        return {p: plan.msgs for p, plan in got.items()}
    return _walk(transfers, keep, peer_of, pack_below)


def _pack_per_range(msgs: list[list[tuple[int, Transfer]]],
                    source: Callable[[Transfer], torch.Tensor], secret: bytes | None,
                    mid: int, checksum: str | None, pack_below: int, cuda: bool
                    ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One engine rank's messages and seals, range by range (where the table path of
    `shard_runs.pack_peer` is not taken; both give the same bytes)."""
    bufs = [[(i, _checked(source(t), t, "source", cuda)) for i, t in msg] for msg in msgs]
    # sealed before packing: the pack carries the bytes that were digested
    seals = _seal_all(secret, mid, [x for msg in bufs for x in msg], checksum)
    return [parts[0][1] if _alone(msg, pack_below)
            else torch.cat([b for _, b in parts])  # packed on the bytes' device
            for msg, parts in zip(msgs, bufs)], seals


def send_shards(group: Any, transfers: Sequence[Transfer], me: int,
                source: Callable[[Transfer], torch.Tensor], *, senders: int, mid: int,
                secret: bytes | None = None, checksum: str | None = "xxh3",
                timeout_s: float = 60.0, pack_below: int = PACK_BELOW,
                peer: Peer | None = None, tagged: bool = True,
                places: shard_runs.Places | None = None,
                phases: dict[str, float] | None = None) -> int:
    """Send trainer rank `me`'s transfers of `transfers` (the whole schedule, in its
    order): `source(t)` is the 1-D uint8 tensor of t's bytes (host memory over gloo, a
    CUDA device over NCCL: the group's backend decides). Per engine rank, in the order
    `_walk` gives: each transfer of at least `pack_below` bytes as a message of its own
    (gloo tag: its index), the smaller ones packed into one message (on their device;
    tag len(transfers)), then the seals (tag len(transfers) + 1). `tagged=False` sends
    every gloo message with tag 0 (as NCCL, which ignores tags: only the order
    matches). `peer(e)`: engine rank e's group and rank in it (module docstring).
    `places`: the same bytes as segments per tensor; where given on a GPU, each engine
    rank's ranges are packed and sealed in one launch (`shard_runs.py`), the same
    messages and seals as `source`'s path. `phases`, where given, gets the host
    seconds of each step ("walk", "pack": sources found, packed and sealed, "post",
    "wait"). Returns the bytes sent."""
    clock = _Clock(phases)
    to: Peer = peer if peer is not None else (lambda e: (group, senders + e))
    n = len(transfers)
    key = ("send", me, pack_below)
    walk = _walked(transfers, key, lambda t: t.src == me, lambda t: t.dst, pack_below)
    if not walk:
        return 0
    nccl = _is_nccl(to(next(iter(walk)))[0])
    ops: list[_Op] = []
    sent = 0
    device: torch.device | None = None
    keep: list[Any] = []  # the table path's sources, alive until the sends are done
    compiled = None
    places = shard_runs.Once(places) if places is not None else None
    if places is not None and nccl and walk:
        first = next(iter(walk.values()))[0][0][1]
        dev = _checked(source(first), first, "source", nccl).device
        if shard_runs.usable(dev, checksum):
            compiled = _compiled(transfers, walk, key, pack_below)
    clock("walk")
    for dst, msgs in walk.items():
        pg, rank = to(dst)
        fast = (shard_runs.pack_peer(compiled[dst], places, dev, secret, mid, checksum)
                if compiled is not None and places is not None else None)
        if fast is not None:
            bufs_out, seals, loc = fast
            keep.append(loc)
        else:
            bufs_out, seals = _pack_per_range(msgs, source, secret, mid, checksum,
                                              pack_below, nccl)
        for msg, buf in zip(msgs, _outgoing(dst, msgs, bufs_out, seals)):
            tag = msg[0][0] if _alone(msg, pack_below) else n
            ops.append((pg, rank, buf, tag if tagged else 0))
            sent += buf.numel()
        ops.append((pg, rank, seals, n + 1 if tagged else 0))
        device = seals.device
    clock("pack")
    works = _post(ops, send=True, batched=nccl)
    clock("post")
    _wait(works, timeout_s, "send", device if nccl else None)
    clock("wait")
    del keep
    return sent


def receive_shards(group: Any, transfers: Sequence[Transfer], me: int,
                   dest: Callable[[Transfer], torch.Tensor], *, senders: int, mid: int,
                   secret: bytes | None = None, checksum: str | None = "xxh3",
                   timeout_s: float = 60.0, pack_below: int = PACK_BELOW,
                   peer: Peer | None = None, tagged: bool = True,
                   places: shard_runs.Places | None = None,
                   phases: dict[str, float] | None = None) -> int:
    """Receive engine rank `me`'s transfers of `transfers` into `dest(t)` (a 1-D uint8
    contiguous tensor of t's size, where t's bytes should land: host memory over gloo,
    a CUDA device over NCCL; the packed ones are copied there from their message),
    then check every range's digest where it landed, in the order the sender sealed
    them: on a GPU with `sum64` on the device, each sender's seals and this side's
    digests read to the host once per sender. `peer(j)`: trainer rank j's group and
    rank in it. `places`: the same destinations as segments per tensor; where given on
    a GPU, each sender's pack is unpacked and every range digested in one launch
    (`shard_runs.py`). `phases`, where given, gets the host seconds of each step
    ("walk", "buffers", "post", "wait", "land": unpacked, digested, compared).
    Returns the bytes received."""
    clock = _Clock(phases)
    frm: Peer = peer if peer is not None else (lambda j: (group, j))
    n = len(transfers)
    key = ("receive", me, pack_below)
    walk = _walked(transfers, key, lambda t: t.dst == me, lambda t: t.src, pack_below)
    if not walk:
        return 0
    nccl = _is_nccl(frm(next(iter(walk)))[0])
    ops: list[_Op] = []
    got = 0
    bufs: dict[int, torch.Tensor] = {}
    packs: list[tuple[list[tuple[int, Transfer]], torch.Tensor]] = []
    words: dict[int, torch.Tensor] = {}
    order: dict[int, list[int]] = {}  # src -> transfer indices, in the sender's seal order
    landings: dict[int, shard_runs.Landing] = {}
    device = torch.device("cpu")
    compiled = None
    places = shard_runs.Once(places) if places is not None else None
    if places is not None and nccl:
        first = next(iter(walk.values()))[0][0][1]
        dev = _checked(dest(first), first, "destination", nccl).device
        if shard_runs.usable(dev, checksum):
            compiled = _compiled(transfers, walk, key, pack_below)
    clock("walk")
    for src, msgs in walk.items():
        pg, rank = frm(src)
        fast = (shard_runs.receive_buffers(compiled[src], places, dev, checksum)
                if compiled is not None and places is not None else None)
        if fast is not None:
            landings[src] = fast
            device = fast.words.device
            for msg, buf in zip(msgs, fast.msgs):
                tag = msg[0][0] if _alone(msg, pack_below) else n
                ops.append((pg, rank, buf, tag if tagged else 0))
            got += int(compiled[src].nbytes.sum()) if compiled is not None else 0
            ops.append((pg, rank, fast.words, n + 1 if tagged else 0))
            continue
        for msg in msgs:
            for i, t in msg:
                bufs[i] = _checked(dest(t), t, "destination", nccl)
                order.setdefault(src, []).append(i)
                got += t.nbytes
            device = bufs[msg[0][0]].device
            if _alone(msg, pack_below):
                ops.append((pg, rank, bufs[msg[0][0]], msg[0][0] if tagged else 0))
            else:
                pack = torch.empty(sum(t.nbytes for _, t in msg), dtype=torch.uint8,
                                   device=device)
                packs.append((msg, pack))
                ops.append((pg, rank, pack, n if tagged else 0))
        words[src] = torch.empty(2 * len(order[src]), dtype=torch.int64, device=device)
        ops.append((pg, rank, words[src], n + 1 if tagged else 0))
    clock("buffers")
    works = _post(ops, send=False, batched=nccl)
    clock("post")
    _wait(works, timeout_s, "receive", device if nccl else None)
    clock("wait")
    for landing in landings.values():
        shard_runs.land_peer(landing, transfers, secret, mid, checksum)
    for msg, pack in packs:
        at = 0
        for i, t in msg:
            bufs[i].copy_(pack[at: at + t.nbytes])
            at += t.nbytes
    for src, idx in order.items():
        mine = _seal_all(secret, mid, [(i, bufs[i]) for i in idx], checksum)
        both = torch.cat([words[src], mine]).tolist()  # one host read per sender
        sealed, local = both[: 2 * len(idx)], both[2 * len(idx):]
        for k, i in enumerate(idx):
            if sealed[2 * k: 2 * k + 2] != local[2 * k: 2 * k + 2]:
                t = transfers[i]
                raise ChecksumError(
                    f"shard-direct: bytes [{t.start}, {t.stop}) of {t.name!r} from trainer "
                    f"rank {t.src} do not match their {'keyed ' if secret else ''}digest")
    clock("land")
    return got


# -- the `shard` transport: shard-direct as a path of `WeightSync` ---------------------------
class ShardSource(Protocol):
    """One trainer rank's own bytes (`trainer_side/fsdp.FSDP2Shards`)."""

    #: this rank's index among the senders (the schedule's `src`)
    rank: int

    def source(self, t: Transfer) -> torch.Tensor:
        """This rank's bytes [t.start, t.stop) of tensor t.name (1-D uint8)."""
        ...

    # Optional: `segments(name)` (`shard_runs.Places`), the same bytes per tensor; a
    # source that has it is sent on a GPU by one launch per engine rank.


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


def _inner_endpoint(endpoint: dict[str, Any]) -> dict[str, Any]:
    """`endpoint` (a `shard` or `shard_nccl` transport's) as the broadcast receivers of
    its backend read it."""
    backend = "nccl" if endpoint.get("transport") == ShardNcclTransport.name else "gloo"
    out = {**endpoint, "transport": backend}
    if isinstance(out.get("senders"), list):
        out["senders"] = [{**ep, "transport": backend} if isinstance(ep, dict) else ep
                          for ep in out["senders"]]
    return out


class ShardSender(BroadcastSender):
    """A trainer rank's half of the `shard` transport (`backend` "gloo") or of
    `shard_nccl` ("nccl": its shards on its GPU): its broadcast group (sender at rank
    0, every engine worker after it); a manifest with a schedule is sent point to point
    along it (`send_shards`), one without is broadcast (`BroadcastSender`)."""

    def __init__(self, backend: str = "gloo", **options: Any) -> None:
        super().__init__(backend, **options)

    def endpoint(self) -> dict[str, Any]:
        name = ShardNcclTransport.name if self.backend == "nccl" else ShardTransport.name
        return {**super().endpoint(), "transport": name}

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
        t0 = time.perf_counter()
        src: ShardSource = shards()
        sched = ShardSchedule.of(manifest)
        if not 0 <= src.rank < sched.senders:
            raise TransportError(f"trainer rank {src.rank} is not one of the schedule's "
                                 f"{sched.senders} senders")
        pg = self.pg
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NCCL's batch runs on the current GPU
            places = src if callable(getattr(src, "segments", None)) else None
            phases: dict[str, float] = {"shards": time.perf_counter() - t0}
            sent = send_shards(pg, sched.transfers, src.rank, src.source,
                               senders=sched.senders, mid=manifest_id(manifest),
                               secret=self.secret, checksum=manifest.checksum,
                               timeout_s=self.timeout_s, peer=lambda e: (pg, 1 + e),
                               places=places, phases=phases)  # type: ignore[arg-type]
        except BaseException:
            self._break()  # the group's state is unknown: the next push forms it anew
            raise
        mine = sched.count_from(src.rank)
        return SendStats(bytes=sent, buckets=0, seconds=time.perf_counter() - t0,
                         extra={"schedule": {"rank": src.rank, "bytes": sent,
                                             "transfers": mine},
                                # host ms per step: the shards read and the schedule
                                # parsed, then `send_shards`' steps
                                "phases_ms": {k: round(v * 1e3, 3)
                                              for k, v in phases.items()}})


class _Staging:
    """A worker's staging tensors of one scheduled update, one per checkpoint tensor it
    receives any of, made on first use (per transfer: `dest`; per tensor: `segments`,
    `shard_runs.Places`). Zeros where this rank receives only part of the tensor (the
    bytes its loader does not read stay defined); uninitialised where the schedule
    sends it every byte (`whole`: a memset of the whole model per push saved); and
    where the target holds a tensor the schedule sends whole as a plain copy, that
    tensor's own bytes (`direct`: received in place, no staging and no copy)."""

    def __init__(self, sizes: dict[str, int], device: torch.device,
                 whole: set[str] | None = None,
                 direct: dict[str, torch.Tensor] | None = None) -> None:
        self.sizes, self.device = sizes, device
        self.whole = whole or set()
        self.direct = direct or {}
        self.staged: dict[str, torch.Tensor] = {}

    def _of(self, name: str) -> torch.Tensor:
        buf = self.staged.get(name)
        if buf is None and name in self.direct:
            buf = self.staged[name] = self.direct[name].reshape(-1).view(torch.uint8)
        if buf is None:
            make = torch.empty if name in self.whole else torch.zeros
            buf = self.staged[name] = make(self.sizes[name], dtype=torch.uint8,
                                           device=self.device)
        return buf

    def dest(self, t: Transfer) -> torch.Tensor:
        return self._of(t.name)[t.start: t.stop]

    def segments(self, name: str) -> list[tuple[int, int, torch.Tensor]]:
        buf = self._of(name)
        return [(0, buf.numel(), buf)]


class ShardReceiver(Receiver):
    """An engine worker's half of the `shard` transport: the broadcast receiver of
    every sender's group (`MultiReceiver`, or one `BroadcastReceiver` for one sender),
    gloo with host buffers, or NCCL on the worker's GPU (`shard_nccl`).
    A manifest with a schedule is received point to point (`receive_shards`), from
    inside the target's `apply` (its first pull): this worker's transfers (engine rank =
    its group rank - 1) land straight in the target's own tensor where the schedule
    sends a tensor whole and the target holds it as a planned plain copy
    (`Target.destinations`: the replay then copies nothing), else in a staging tensor of
    the checkpoint tensor's shape, where only the runs its loader reads are filled; then
    they go to the target as any update does (the copy plan writes the planned tensors,
    the loader takes the rest, verification as for every update). A bad digest raises
    `ChecksumError` before the target gets a tensor (what landed in place makes the
    worker `torn`, as any failed update). Memory: the staged tensors only, up to one
    model's bytes where nothing lands in place (on the GPU for `shard_nccl`)."""

    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        ep = _inner_endpoint(endpoint)
        if ep["transport"] != "nccl":
            device = torch.device("cpu")
        elif device.type != "cuda":
            raise TransportError(f"the {ShardNcclTransport.name} transport receives on a CUDA"
                                 f" device, not {device}")
        self.device = device
        self.inner: MultiReceiver | BroadcastReceiver = (
            MultiReceiver(ep, rank, device) if "senders" in ep
            else BroadcastReceiver(ep, rank, device))
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
        phases: dict[str, float] = {"schedule": time.perf_counter() - t0}
        groups = self.groups()
        if len(groups) != sched.senders or any(g is None for g in groups):
            raise TransportError(f"the schedule has {sched.senders} senders; this worker is in "
                                 f"the groups of {len(groups)}")
        push = _ScheduledReceive(self, manifest, sched, groups, target, t0, phases)
        try:
            target.apply(push.stream())
            if not push.started:
                raise TransportError("the target's apply took no tensor of the update")
        except BaseException:
            if not push.started:
                # the target failed before it pulled a tensor: the senders are sending
                # this worker its ranges all the same; receive them (into staging,
                # thrown away) so that they finish instead of waiting out their timeout
                with contextlib.suppress(BaseException):
                    for _ in push.stream(land=False):
                        pass
            raise
        t1 = push.t1
        phases["apply"] = time.perf_counter() - t1
        return {"bytes": push.got, "seconds": time.perf_counter() - t0,
                "schedule": {"engine_rank": push.me, "received": push.got,
                             "tensors": len(push.staged),
                             # tensors received straight into the target's own
                             "in_place": len(push.direct),
                             "receive_s": round(t1 - t0, 4),
                             "apply_s": round(time.perf_counter() - t1, 4)},
                "phases_ms": {k: round(v * 1e3, 3) for k, v in phases.items()}}


class _ScheduledReceive:
    """One scheduled push into one worker (`ShardReceiver.deliver`): the ranges the
    schedule sends it are received when the target's `apply` first pulls (inside the
    target's session), then handed to it tensor by tensor. A tensor sent whole, which
    the target holds as a planned plain copy (`Target.destinations`: same dtype, shape
    and device, contiguous), is received straight into the target's own tensor, and
    the replay then copies nothing for it."""

    def __init__(self, owner: ShardReceiver, manifest: Manifest, sched: ShardSchedule,
                 groups: list[Any], target: Target, t0: float,
                 phases: dict[str, float]) -> None:
        self.owner, self.manifest, self.sched, self.groups = owner, manifest, sched, groups
        self.target, self.t0, self.phases = target, t0, phases
        self.me = owner.rank - 1
        self.specs = {t.name: t for t in manifest.tensors}
        covered = sched.bytes_to(self.me)  # the schedule's ranges are disjoint (`from_meta`)
        self.whole = [n for n in self.specs if covered.get(n) == self.specs[n].nbytes]
        self.got, self.t1 = 0, t0
        self.staged: dict[str, torch.Tensor] = {}
        self.direct: dict[str, torch.Tensor] = {}
        self.started = False

    def stream(self, land: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive every range, then yield the update's tensors. `land`: into the
        target's own tensors where it can (False: into staging only, to drain a push
        whose target failed before it pulled)."""
        owner, specs, phases, groups = self.owner, self.specs, self.phases, self.groups
        self.started = True
        if land:
            self.direct.update(
                (n, d) for n, d in zip(self.whole, self.target.destinations(self.whole))
                if d is not None and _in_place(d, specs[n], owner.device))
        # the target's apply up to its first pull, and its destinations
        phases["destinations"] = time.perf_counter() - self.t0 - sum(phases.values())
        staging = _Staging({n: s.nbytes for n, s in specs.items()}, owner.device,
                           whole=set(self.whole), direct=self.direct)
        self.staged = staging.staged
        try:
            if owner.device.type == "cuda":
                torch.cuda.set_device(owner.device)  # NCCL's batch runs on this GPU
            self.got = receive_shards(
                None, self.sched.transfers, self.me, staging.dest,
                senders=self.sched.senders, mid=manifest_id(self.manifest),
                secret=owner.secret, checksum=self.manifest.checksum,
                timeout_s=owner.timeout_s, peer=lambda j: (groups[j], 0),
                places=staging, phases=phases)
        except ChecksumError:
            # the groups are intact: the update is refused before the target gets a
            # tensor (what landed in place already makes the worker `torn`)
            raise
        except BaseException:
            owner.close()  # a failed receive leaves the groups in an unknown state
            raise
        self.t1 = time.perf_counter()
        for name, spec in specs.items():
            if name in self.direct:
                yield name, self.direct[name]
            elif name in self.staged:
                yield name, self.staged[name].view(torch_dtype(spec.dtype)).view(
                    tuple(spec.shape))


def _in_place(dest: torch.Tensor, spec: Any, device: torch.device) -> bool:
    """Whether `dest` (a target's `destination`) can take a tensor of `spec` as its
    own bytes: same dtype, shape and device, contiguous."""
    return (dest.device == device and dest.is_contiguous()
            and dest.dtype == torch_dtype(spec.dtype) and tuple(dest.shape) == tuple(spec.shape))


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


class ShardNcclTransport(ShardTransport):
    """Shard-direct over NCCL (issue 40): the `shard` transport with GPU tensors, its
    groups NCCL, the ranges posted as one batch of point-to-point operations per group
    (`send_shards`), digested on the device (`sum64`), and received straight into the
    engine's GPU buffers. Chosen by name, `WeightSync("shard_nccl", senders=...)`, as
    `nccl` is chosen next to `gloo`; a manifest without a schedule is broadcast over the
    same NCCL groups with `nccl`'s bucket settings."""

    name = "shard_nccl"
    default_checksum = "sum64"
    direct_min: ClassVar[int | None] = 1 << 62
    default_bucket_bytes: ClassVar[int] = 1 << 30

    def sender(self, **options: Any) -> Sender:
        return ShardSender("nccl", **options)

"""Broadcast from several trainer ranks: one broadcast group per sender, one manifest.

Sender j's group holds sender j (its rank 0) and every engine worker (the same ranks
as in a single-sender group), so no sender receives another's bytes. The engine worker
joins every group (`MultiReceiver`), receives each sender's part (`control/senders.parts`)
with the ordinary single-sender checks, and a failure of any part ends the whole update
on this worker, closing every group; the error names the sender rank it came from.

Two ways to receive the parts:

- **In the send order** (`meta["order"]`, the default on CUDA): every bucket of every
  part, one after the other, on one thread and the current CUDA stream, in the order
  the trainer ranks send them, with the next bucket's receive posted before the
  current one is consumed (as one sender's receiver does). The coordinator writes the
  order into the (signed) manifest when the ranks stream the same tensors in lockstep
  (FSDP): `send_order` replays `core/buckets.pack`'s rule for when each rank sends each
  bucket (at the stream position of the tensor that seals it; the last ones once the
  stream ended).
- **Concurrently** (gloo, or a manifest without an order: ranks that each own their
  part and stream it on their own): each part on a thread of its own (over NCCL on a
  CUDA stream of its own, items crossing to the consumer with CUDA events), tensors
  applied in the order they arrive.

Why the order (NCCL, issue 23): a broadcast completes only when every member's kernel
runs, and CUDA does not promise that a kernel launched on one stream runs while an
earlier one of another stream spins waiting for its peers (NCCL: "using multiple
communicators concurrently ... can deadlock"; a device synchronisation, an implicitly
synchronising call such as a page-locked or device allocation or a module load, or two
streams sharing a hardware queue serialise them). Received concurrently, a worker posts
part 1's bucket 0 at once; under FSDP lockstep rank 1 sends it only after rank 0 has
packed everything before rank 1's first tensor (the embedding: rank 0's buckets 0..n),
and rank 0 reuses a buffer only once its bucket k-2 arrived. So: rank 0 waits (drain)
for the workers' receive of its bucket k-2 (or later) -> that receive, on the worker's
GPU, is behind part 1's pending receive -> which waits for rank 1 to send -> rank 1
waits in the lockstep gather for rank 0. Seen on 4x H200: 256 KiB buckets and 256 MiB
buckets of a 7B model (the embedding spans several buckets) hung; one bucket per
sender did not (no rank waits for a receive before the lockstep ends).

Why the send order cannot deadlock, for any bucket size and any assignment of tensors
to ranks: let T be the order in which the collectives happen along the lockstep: for
each stream position i, the trainer ranks' lockstep collectives for tensor i (flag,
gathers), then the buckets sealed while tensor i is packed (one owner per tensor), and
after the last position the ranks' last buckets, part by part. Every process issues its
collectives in an order consistent with T: a trainer rank by construction (`pack`
seals a bucket while packing a tensor, before the next tensor's collectives), a worker
because it posts receives exactly in `meta["order"]`, which is T restricted to the
buckets. Every host wait is for a collective the process already issued (a drain waits
for bucket k-2, a worker for the bucket it posted, lockstep for the flag or gather it
entered). Take the first collective C of T that has not completed: every collective
before it completed, so a member that has not issued C yet waits only on completed
work and issues it; once all have, everything each member launched before C depends
only on collectives before C, so C runs on every GPU even if the GPU ran kernels
strictly in launch order and every CUDA call synchronised the device. By induction
every collective completes. (Concurrent reception is kept where no sender's progress
waits on another's: each part then progresses on its own sender alone.)

`SenderSet` is the coordinator's (trainer rank 0's) sender: its own broadcast sender,
plus the other ranks' senders, which it drives through `TrainerRanks` (the followers'
loop is `control/multisend.py`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from enginehooks.control.ranks import RanksBroken, ShortGather, TrainerRanks
from enginehooks.control.senders import parts, sender_ranges
from enginehooks.core.buckets import TRAILER_BYTES, Unpacker, buffer_bytes, message_bytes
from enginehooks.core.errors import EngineHooksError, ManifestError, TransportError
from enginehooks.core.manifest import Manifest
from enginehooks.transports.base import Abort, Receiver, Sender, SendStats, Stream, Target
from enginehooks.transports.broadcast import (
    BroadcastReceiver,
    BroadcastSender,
    Deadline,
    _bcast,
    _bury,
    _host_wait,
)

#: How long the coordinator waits for the other ranks' answer to a `close`.
CLOSE_WAIT_S = 5.0

#: The manifest's `meta` key listing its buckets (global indices) in the send order.
ORDER_KEY = "order"


def send_order(manifest: Manifest, stream: Sequence[str]) -> list[int] | None:
    """The order in which the trainer ranks send `manifest`'s buckets when every rank
    iterates the same `stream` (tensor names in stream order) in lockstep and sends its
    part with `BroadcastSender.send` (module docstring): `core/buckets.pack` sends a
    bucket while it packs the first tensor with a piece in a later bucket (a direct
    bucket while it packs its tensor), and the rest once the stream has ended. None
    where a tensor of the manifest is not in `stream`."""
    where = {name: i for i, name in enumerate(stream)}
    end = len(stream)
    keyed: list[tuple[int, int, int]] = []  # (stream position, sender, global index)
    for j, (part, (first, _nb, _ft, _nt)) in enumerate(zip(parts(manifest),
                                                             sender_ranges(manifest))):
        index = 0
        for entry in part.tensors:
            if entry.name not in where:
                return None
            at = where[entry.name]
            for piece in entry.pieces:
                while piece.bucket > index:
                    keyed.append((at, j, first + index))
                    index += 1
                if part.buckets[index].direct:
                    keyed.append((at, j, first + index))
                    index += 1
        while index < len(part.buckets):
            keyed.append((end, j, first + index))
            index += 1
    return [g for _at, _j, g in sorted(keyed)]


def order_of(manifest: Manifest) -> list[tuple[int, int]] | None:
    """`meta["order"]` as (sender, bucket of its part) pairs, checked: every bucket once,
    each sender's buckets in their own order. None where the manifest has no order."""
    raw = manifest.meta.get(ORDER_KEY)
    if raw is None:
        return None
    n = len(manifest.buckets)
    if (not isinstance(raw, list) or len(raw) != n
            or not all(isinstance(g, int) and not isinstance(g, bool) for g in raw)
            or sorted(raw) != list(range(n))):
        raise ManifestError(f"meta.{ORDER_KEY} must list each of the {n} buckets once, got "
                            f"{str(raw)[:200]}")
    owner: dict[int, tuple[int, int]] = {}
    for j, (first, count, _ft, _nt) in enumerate(sender_ranges(manifest)):
        for k in range(count):
            owner[first + k] = (j, k)
    out = [owner[g] for g in raw]
    last: dict[int, int] = {}
    for j, k in out:
        if k != last.get(j, -1) + 1:
            raise ManifestError(f"meta.{ORDER_KEY} sends bucket {k} of sender {j} out of "
                                "that sender's order")
        last[j] = k
    return out


def only(stream: Iterable[tuple[str, torch.Tensor]], names: set[str]
         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The items of `stream` named in `names` (the whole stream is still iterated: on a
    sharded trainer each step may be a collective every rank must enter)."""
    for name, t in stream:
        if name in names:
            yield name, t


def named(error: BaseException, who: str) -> EngineHooksError:
    """`error` with `who` in front of its text, keeping its class where it can (a
    `ChecksumError` stays one)."""
    text = f"{who}: {type(error).__name__}: {error}" if not isinstance(
        error, EngineHooksError) else f"{who}: {error}"
    if isinstance(error, EngineHooksError):
        try:
            out = type(error)(text)
        except TypeError:
            out = TransportError(text)
    else:
        out = TransportError(text)
    out.__cause__ = error
    return out


class SenderSet(Sender):
    """Trainer rank 0's sender when every rank of `trainer_ranks` sends its part."""

    def __init__(self, backend: str, *, trainer_ranks: TrainerRanks, host: str = "127.0.0.1",
                 port: int = 0, timeout_s: float = 120.0, **options: Any) -> None:
        self.backend, self.ranks, self.timeout_s = backend, trainer_ranks, float(timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._pending: list[ShortGather] = []
        self.own = BroadcastSender(backend, host=host, port=port, timeout_s=timeout_s, **options)
        try:
            answers = self.command({"op": "open"}).result()
            self.endpoints = [self.own.endpoint()] + [a["endpoint"] for a in self._ok(
                answers, "open its sender")[1:]]
        except BaseException:
            self.own.close()
            raise

    # -- the control channel ------------------------------------------------------------
    def command(self, cmd: dict[str, Any], timeout_s: float | None = None) -> ShortGather:
        """Send `cmd` to every other rank and start gathering their answers."""
        self._settle()
        self.ranks.broadcast(cmd, timeout_s)
        g = self.ranks.gather_short({"ok": True})
        self._pending.append(g)
        return g

    def _settle(self) -> None:
        """Wait for answers still outstanding (a command abandoned by a failed push):
        every rank's collectives must come in the same order."""
        while self._pending:
            g = self._pending.pop(0)
            if not g.done():
                g.result(self.timeout_s)

    def _ok(self, answers: list[Any], what: str) -> list[Any]:
        bad = [(j, a) for j, a in enumerate(answers) if j and not (isinstance(a, dict)
                                                                  and a.get("ok"))]
        if bad:
            raise TransportError("; ".join(
                f"trainer rank {j} could not {what}: {a.get('error') if isinstance(a, dict) else a}"
                for j, a in bad))
        return answers

    # -- Sender -------------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        own = self.own.endpoint()
        return {**own, "group": f"multi-{own['group']}", "senders": self.endpoints}

    def connect(self, world_size: int) -> None:
        with self._lock:
            if self._closed:
                raise TransportError("the sender group was closed before it connected")
            g = self.command({"op": "connect", "world": world_size})
        self.own.connect(world_size)
        self._ok(g.result(self.timeout_s), "join its broadcast group")

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        mine = parts(manifest)
        if len(mine) != len(self.endpoints):
            raise TransportError(f"the manifest has {len(mine)} senders; the group has "
                                 f"{len(self.endpoints)}")
        t0 = time.perf_counter()
        with self._lock:
            g = self.command({"op": "send", "manifest": manifest.to_json()})
        names = {t.name for t in mine[0].tensors}
        stats = self.own.send(mine[0], only(stream, names), abort)
        g.future.add_done_callback(lambda _f: abort.poke())
        if not abort.wait_for(g.done, self.timeout_s):
            raise TransportError(f"trainer ranks 1..{self.ranks.size - 1} did not finish "
                                 f"sending within {self.timeout_s}s")
        answers = self._ok(g.result(self.timeout_s), "send its part")
        stats.bytes = manifest.total_bytes
        stats.buckets = len(manifest.buckets)
        stats.seconds = time.perf_counter() - t0
        stats.extra["senders"] = [{"rank": 0, "seconds": stats.seconds}] + [
            {"rank": j, **{k: v for k, v in a.items() if k != "ok"}}
            for j, a in enumerate(answers) if j]
        return stats

    @property
    def broken(self) -> bool:
        return self._closed or self.own.broken or self.ranks.broken is not None

    def close(self) -> None:
        """Close this rank's sender and tell the others to close theirs; their answer is
        not waited for here (it is before the next command), so a failed push is
        reported at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.own.close()
            # With an answer still outstanding (a failed push), say nothing: the other
            # ranks close their senders when the next group opens.
            if self.ranks.broken is None and all(g.done() for g in self._pending):
                with contextlib.suppress(RanksBroken):
                    self.command({"op": "close"}, timeout_s=CLOSE_WAIT_S)


class _Handoff:
    """One item crossing from a part's thread to the consumer: `taken` is set when the
    consumer asks for its next item; on CUDA, `ready` is recorded on the part's stream
    once the item is ready and `done` on the consumer's stream when it is done with it."""

    __slots__ = ("done", "ready", "taken")

    def __init__(self) -> None:
        self.taken = threading.Event()
        self.ready: Any = None
        self.done: Any = None


def _used_on(t: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator that `stream` reads `t` (made on a part's stream): its
    memory is not handed out again before what `stream` queued on it has run."""
    if t.device == stream.device and t.untyped_storage().nbytes():
        t.record_stream(stream)


class MultiReceiver(Receiver):
    """One engine worker's receiver of an update from several senders (module
    docstring): one `BroadcastReceiver` per sender's group, received in the send order
    (`_ordered`) or concurrently (`_merged`)."""

    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        senders = endpoint.get("senders")
        if not isinstance(senders, list) or not senders or len(senders) > 4096:
            raise TransportError(f"a multi-sender endpoint lists its senders, not "
                                 f"{str(senders)[:200]}")
        self.world_size = endpoint.get("world_size")
        self.timeout_s = float(endpoint.get("timeout_s") or 120.0)
        self.who = [f"sender rank {j} ({ep.get('host')}:{ep.get('port')})" if isinstance(
            ep, dict) else f"sender rank {j}" for j, ep in enumerate(senders)]
        self.device = device
        self.parts = [BroadcastReceiver({**ep, "world_size": self.world_size}, rank, device)
                      for ep in senders]
        # one CUDA stream per part (module docstring), made on first use
        self._streams: list[Any] = [None] * len(self.parts)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def connect(self) -> None:
        errors: list[tuple[int, BaseException]] = []

        def join(j: int) -> None:
            try:
                self.parts[j].connect()
            except BaseException as e:
                errors.append((j, e))

        def join_in_turn() -> None:
            # NCCL: one group at a time, in the senders' order on every worker. Two
            # communicators forming at once on one GPU can wait on each other (a
            # device-wide sync in one's setup behind the other's first collective,
            # itself waiting for a peer that is busy forming the first one).
            for j in range(len(self.parts)):
                if errors:
                    return
                join(j)

        threads = ([threading.Thread(target=join_in_turn, daemon=True,
                                     name="enginehooks-join-senders")]
                   if self.cuda else
                   [threading.Thread(target=join, args=(j,), daemon=True,
                                     name=f"enginehooks-join-sender-{j}")
                    for j in range(len(self.parts))])
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s + 5.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        late = ([j for j, p in enumerate(self.parts) if p.broken]
                if self.cuda and threads[0].is_alive() else
                [j for j, t in enumerate(threads) if t.is_alive()])
        if errors or late:
            self.close()
            if errors:
                j, e = errors[0]
                raise named(e, self.who[j])
            raise TransportError(f"the groups of {[self.who[j] for j in late]} did not form "
                                 f"within {self.timeout_s}s")

    @property
    def broken(self) -> bool:
        return any(p.broken for p in self.parts)

    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        t0 = time.perf_counter()
        mine = parts(manifest)
        if len(mine) != len(self.parts):
            raise TransportError(f"the manifest has {len(mine)} senders; this worker joined "
                                 f"the groups of {len(self.parts)}")
        order = order_of(manifest)
        if order is not None and self.in_order():
            target.apply(self._ordered(mine, order, target.destination))
        else:
            target.apply(self._merged(mine, target.destination))
        return {"bytes": manifest.total_bytes, "seconds": time.perf_counter() - t0,
                "senders": len(self.parts), "in_order": order is not None and self.in_order()}

    def in_order(self) -> bool:
        """Whether a manifest with a send order is received in it (module docstring):
        `ENGINEHOOKS_MULTI_ORDER` = `auto` (default: on CUDA), `1` (always), `0` (never:
        the parts concurrently, the NCCL hazard the order avoids included)."""
        mode = os.environ.get("ENGINEHOOKS_MULTI_ORDER", "auto")
        return mode == "1" or (mode != "0" and self.cuda)

    def _ordered(self, mine: list[Manifest], order: list[tuple[int, int]],
                 into: Callable[[str], torch.Tensor | None]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every part's buckets in the send order `order` (module docstring), on this
        thread and the current stream: `BroadcastReceiver.stream`'s loop over the
        buckets of several groups. Bucket g+1's receive (whichever group) is posted
        before bucket g is consumed; views of bucket g stay valid until the consumer
        asks for the first tensor of bucket g+1, and the consumer works on the current
        stream, after which NCCL orders the receive that next reuses the buffer."""
        device = self.device
        pgs = [p.pg for p in self.parts]
        if any(pg is None for pg in pgs):
            raise TransportError("receive before connect(): a sender's group has not formed")
        unpackers = [Unpacker(m, device, into, p.secret) for m, p in zip(mine, self.parts)]
        for m, u in zip(mine, unpackers):
            if not m.buckets:
                yield from u.empties()
        n = len(order)
        if not n:
            return
        bufs = [p._buffers.get(buffer_bytes(m)) if m.buckets else []
                for p, m in zip(self.parts, mine)]
        sizes = [[message_bytes(b.nbytes) for b in m.buckets] for m in mine]
        # direct buckets (gloo): their trailers, received first, and where payloads went
        heads = [[torch.empty(TRAILER_BYTES, dtype=torch.uint8, device=device)
                  for _ in range(2)] if any(b.direct for b in m.buckets) else []
                 for m in mine]
        payloads: list[list[torch.Tensor | None]] = [[None, None] for _ in mine]
        landed = [[False, False] for _ in mine]
        deadline = Deadline(self.timeout_s, device)  # the whole transfer, as one sender's
        left, waited = deadline.left, deadline.wait

        j = order[0][0]

        def post(g: int) -> Any:
            nonlocal j
            j, k = order[g]
            m, u, slot = mine[j], unpackers[j], k % 2
            if not m.buckets[k].direct:
                return _bcast(pgs[j], bufs[j][slot][: sizes[j][k]], left(f"receive of bucket {k}"))
            what = f"receive of bucket {k}'s trailer"
            waited(_bcast(pgs[j], heads[j][slot], left(what)), what)
            reason = u.check_header(k, heads[j][slot])
            if reason >= 0:
                text = torch.empty(reason, dtype=torch.uint8, device=device)
                if reason:
                    what = f"receive of bucket {k}'s abort reason"
                    waited(_bcast(pgs[j], text, left(what)), what)
                u.aborted(text)
            region = u.landing(k)
            landed[j][slot] = region is not None
            payload = region if region is not None else bufs[j][slot][: m.buckets[k].nbytes]
            payloads[j][slot] = payload
            return _bcast(pgs[j], payload, left(f"receive of bucket {k}"))

        work: Any = None
        try:
            work = post(0)
            for g in range(n):
                j, k = order[g]
                m, u, slot = mine[j], unpackers[j], k % 2
                buf = bufs[j][slot][: sizes[j][k]]
                waited(work, f"receive of bucket {k}")
                work = None
                direct = m.buckets[k].direct
                if not direct:  # the trailer before the next receive (see stream())
                    u.verify(k, buf, check_digest=False)
                if g + 1 < n:
                    work = post(g + 1)
                    j = order[g][0]  # errors below are this bucket's
                if direct and landed[j][slot]:
                    payload = payloads[j][slot]
                    assert payload is not None  # landed: post() received it there
                    u.verify_digest(k, payload, heads[j][slot])
                    yield from u.unpack(k, buf, verified=True, landed=True)
                    continue
                placed = None if direct else u.land(k, buf)
                if placed is None:
                    u.verify_digest(k, buf, heads[j][slot] if direct else None)
                yield from u.unpack(k, buf, verified=True, placed=placed)
        except GeneratorExit:
            _bury(work, *bufs, *payloads)
            self.close()
            raise
        except BaseException as e:
            # a torn update: leave every group, so that every sender fails now
            _bury(work, *bufs, *payloads)
            self.close()
            if isinstance(e, Exception):
                raise named(e, self.who[j]) from e
            raise

    def _merged(self, mine: list[Manifest], into: Callable[[str], torch.Tensor | None]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every part's tensors as they arrive. Each part's views stay valid until the
        consumer asks for the next item (the part's thread waits for that before it
        moves on), as `BroadcastReceiver.stream` promises one consumer.

        On CUDA (module docstring) each part runs on its own stream; an item is handed
        over with an event recorded on that stream once the item is ready, which the
        consumer's current stream waits for before the item is yielded; when the
        consumer asks for the next item, an event recorded on its stream is what the
        part's stream waits for before the part goes on (and may post a receive into
        the buffer the item lived in). Every part's stream also starts after what the
        consumer's stream had queued (reads of the destinations the update overwrites),
        and the update ends only once the consumer's stream has done its copies."""
        q: queue.Queue[tuple[int, Any, _Handoff | None]] = queue.Queue()
        stop = threading.Event()
        handed: list[_Handoff] = []  # released all at once when the update ends
        cuda, device = self.cuda, self.device
        start: Any = None
        if cuda:
            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(device))

        def pump(j: int) -> None:
            try:
                if cuda:
                    self._pump_cuda(j, mine[j], into, q, stop, handed, start)
                    return
                for item in self.parts[j].stream(mine[j], into):
                    h = _Handoff()
                    handed.append(h)
                    q.put((j, item, h))
                    # bounded: each bucket's own wait is; `stop` releases it at once
                    h.taken.wait(self.timeout_s + 10.0)
                    if stop.is_set():
                        return
            except BaseException as e:
                q.put((j, e, None))
                return
            q.put((j, None, None))

        threads = [threading.Thread(target=pump, args=(j,), daemon=True,
                                    name=f"enginehooks-recv-sender-{j}")
                   for j in range(len(self.parts))]
        for t in threads:
            t.start()
        left, taken = len(threads), None
        try:
            while left:
                if taken is not None:
                    if cuda:  # the part may reuse the item's buffer once our reads are done
                        taken.done = torch.cuda.Event()
                        taken.done.record(torch.cuda.current_stream(device))
                    taken.taken.set()
                    taken = None
                try:
                    # each part's own waits are bounded by timeout_s per bucket
                    j, item, taken = q.get(timeout=self.timeout_s + 10.0)
                except queue.Empty:
                    raise TransportError(f"no bucket from any sender within "
                                         f"{self.timeout_s + 10.0}s") from None
                if isinstance(item, BaseException):
                    raise named(item, self.who[j])
                if item is None:
                    left -= 1
                    continue
                if cuda and taken is not None:
                    here = torch.cuda.current_stream(device)
                    here.wait_event(taken.ready)
                    _used_on(item[1], here)
                yield item
            if cuda:
                # the consumer's copies out of the parts' buffers are done before the
                # update is reported done (and before a buffer can be freed)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(device))
                _host_wait(ev, None, self.timeout_s, "the copies of the update's last tensors")
        except BaseException:
            # One part failed (or the consumer did): the update is torn; leave every
            # group so that the other senders fail now instead of at their timeout.
            stop.set()
            for h in handed:
                h.taken.set()
            self.close()
            raise
        finally:
            stop.set()
            for h in handed:
                h.taken.set()

    def _pump_cuda(self, j: int, part: Manifest, into: Callable[[str], torch.Tensor | None],
                   q: queue.Queue[tuple[int, Any, _Handoff | None]], stop: threading.Event,
                   handed: list[_Handoff], start: Any) -> None:
        """Part `j`'s thread on CUDA: its receiver runs on the part's own stream (the
        receiver's waits, its digests, `Unpacker.land`'s copies and every collective it
        posts are ordered on that stream); see `_merged`."""
        device = self.device
        torch.cuda.set_device(device)
        s = self._streams[j]
        if s is None:
            s = self._streams[j] = torch.cuda.Stream(device=device)
        with torch.cuda.stream(s):
            s.wait_event(start)
            for item in self.parts[j].stream(part, into):
                h = _Handoff()
                h.ready = torch.cuda.Event()
                h.ready.record(s)
                handed.append(h)
                q.put((j, item, h))
                # bounded: each bucket's own wait is; `stop` releases it at once
                if not h.taken.wait(self.timeout_s + 10.0) and not stop.is_set():
                    raise TransportError(f"the engine did not take a tensor of this part "
                                         f"within {self.timeout_s + 10.0}s")
                if stop.is_set():
                    return
                if h.done is not None:
                    s.wait_event(h.done)
        q.put((j, None, None))

    def close(self) -> None:
        for p in self.parts:
            p.close()
        _bury(*self.parts)

"""Broadcast from several trainer ranks: one broadcast group per sender, one manifest.

Sender j's group holds sender j (its rank 0) and every engine worker (the same ranks
as in a single-sender group), so the senders run concurrently, each at its own link's
rate, and no sender receives another's bytes. The engine worker joins every group
(`MultiReceiver`), receives each sender's part (`control/senders.parts`) with the
ordinary single-sender receiver on a thread of its own, and applies the tensors in
the order they arrive; a failure of any part ends the whole update on this worker,
closing every group, and the error names the sender rank it came from.

Over NCCL (GPU buffers) each part's thread runs its receiver on a CUDA stream of its
own. On one shared stream, `Work.wait()` of one part's pending receive would make that
stream, and so every later collective of the other parts (NCCL orders its stream after
the current one at launch), wait for that part's sender: with senders that gather in
lockstep (FSDP) that is a cycle. Items cross to the consumer with CUDA events: the
consumer's stream waits for the part's stream before it reads an item, and the part's
stream waits for the consumer's before the part reuses the buffer the item lives in.

`SenderSet` is the coordinator's (trainer rank 0's) sender: its own broadcast sender,
plus the other ranks' senders, which it drives through `TrainerRanks` (the followers'
loop is `control/multisend.py`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from enginehooks.control.ranks import RanksBroken, ShortGather, TrainerRanks
from enginehooks.control.senders import parts
from enginehooks.core.errors import EngineHooksError, TransportError
from enginehooks.core.manifest import Manifest
from enginehooks.transports.base import Abort, Receiver, Sender, SendStats, Stream, Target
from enginehooks.transports.broadcast import (
    BroadcastReceiver,
    BroadcastSender,
    _bury,
    _host_wait,
)

#: How long the coordinator waits for the other ranks' answer to a `close`.
CLOSE_WAIT_S = 5.0


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
    docstring): one `BroadcastReceiver` per sender's group."""

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
        target.apply(self._merged(mine, target.destination))
        return {"bytes": manifest.total_bytes, "seconds": time.perf_counter() - t0,
                "senders": len(self.parts)}

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

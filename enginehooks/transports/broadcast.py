"""Broadcast from the trainer's sender rank to every engine worker: `gloo` and `nccl`.

One code path serves both backends; only where buffers live differs (host memory for
gloo, the sender's / receiver's GPU for nccl). Two buffers per side: the sender packs
bucket k+1 while bucket k is on the wire, and a receiver posts the receive of bucket
k+1 before it applies bucket k. A buffer is reused only after the collective that used
it has completed (`Work.wait`, which on NCCL also orders the current stream after the
communication stream), so packing can never tear bytes still being sent.

NCCL specifics (what each guards against):
- `Work.wait()` on NCCL does not block the host; it only makes the current stream wait.
  A host that then syncs would block inside CUDA where neither the coordinator's `Abort`
  nor our timeout can reach it. So every wait for a collective is a wait for a CUDA
  event, polled (`host_wait`) against the `Abort` condition and `timeout_s`: a dead peer
  becomes a `TransportError` and `pg.abort()`.
- No host sync per bucket (issue 37): the event of each collective is recorded on a side
  stream (`Arrivals`), so it marks that collective alone, not the work queued on the
  current stream after it (later packs on the sender, the target's copies on a
  receiver); a bucket's trailer is copied to pinned memory on the same side stream, so
  the receiver reads it without a sync; with `sum64` on a GPU digests are compared on the
  device and read once per push (`Unpacker.finish`). A GPU sender has `SENDER_SLOTS`
  buffers and packs ahead of the wire while earlier broadcasts are in flight.
- NCCL's own watchdog kills the whole process when a collective outlives the group's
  timeout. The group is therefore built with a longer timeout than ours
  (`_nccl_timeout`), so our error path, not a process teardown, ends a stuck update.
- NCCL creates its communicator lazily, in the first collective, which can block the
  host without a deadline. `connect()` runs a one-element broadcast on a helper
  thread, bounded by `timeout_s`, so the group is live (or a clear error) before the
  first push, and the first push's timing excludes communicator setup.
- The receiver posts bucket k+1's receive before it yields bucket k; NCCL orders its
  stream after the current stream at launch, so the target's copies out of a buffer
  (made on the current stream) finish before the next receive overwrites it.

One receive loop (`receive_in_order`) serves one sender's group (`BroadcastReceiver.stream`)
and several senders' groups received in the send order (`multisender.MultiReceiver`); it
and the primitives it is built from (`bcast`, `wait_work`, `wait_within`, `host_wait`,
`bury`) are public for that module. A whole transfer is bounded by the package's one
`Deadline` (`core/deadline.py`).

Direct buckets (gloo, and nccl for tensors that fill a bucket: `direct_min` in
`collectives.py`; see `core/manifest.py`): the sender
broadcasts the bucket's trailer, then the payload from the tensor's own storage (no
packing copy); the receiver checks the trailer (signature, update, index, size, or an
abort notice whose reason follows as its own message) before it posts the payload's
receive, straight into the destination where the target offers one
(`Unpacker.landing`), and verifies the digest before the tensor is handed on.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import gc
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.core.auth import load_secret
from enginehooks.core.buckets import (
    TRAILER_BYTES,
    Unpacker,
    buffer_bytes,
    direct_abort,
    message_bytes,
    pack,
    write_abort,
)
from enginehooks.core.deadline import Deadline
from enginehooks.core.errors import PeerLost, TransferStalled, TransportError
from enginehooks.core.manifest import Manifest
from enginehooks.transports._rendezvous import (
    call_off,
    client_store,
    connect_timeout,
    master_store,
    new_group,
)
from enginehooks.transports.base import (
    Abort,
    Receiver,
    Sender,
    SendStats,
    Stream,
    Target,
    data_plane_error,
)
from enginehooks.wire.endpoint import GroupEndpoint

#: Bucket buffers of a sender on a GPU: the host packs up to `SENDER_SLOTS - 1` buckets
#: ahead of the wire, each slot freed by a CUDA event after its broadcast (never a host
#: sync on the stream), so the host's work for the next buckets overlaps the wire.
SENDER_SLOTS = 3


class _Buffers:
    """`count` reusable byte buffers (two by default), grown when a manifest needs more."""

    def __init__(self, device: torch.device, pin: bool, count: int = 2) -> None:
        self.device, self.pin, self.count = device, pin, count
        self.bufs: list[torch.Tensor] = []

    def get(self, nbytes: int) -> list[torch.Tensor]:
        if not self.bufs or self.bufs[0].numel() < nbytes:
            self.bufs = []  # free the old ones before allocating the new ones
            for _ in range(self.count):
                b = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self.bufs.append(b.pin_memory() if self.pin else b)
        return self.bufs


def _nccl_timeout(timeout_s: float) -> float:
    """The NCCL group's own timeout: past ours, so its watchdog never fires first."""
    return 2 * timeout_s + 60


# Collectives still in flight when an update fails. Destroying a gloo/NCCL `Work` that
# has not completed blocks until the collective times out, which would stall the
# thread reporting the failure; parking them here lets the error travel at once while
# the dead collective times out in the background.
_GRAVEYARD: list[Any] = []


def bury(*items: Any) -> None:
    _GRAVEYARD.extend(x for x in items if x is not None)
    del _GRAVEYARD[:-64]  # the oldest have long timed out


@atexit.register
def _release_parked() -> None:
    """Release what failed updates parked while the interpreter is still whole. Left to
    the interpreter's finalisation, a parked group's gloo I/O thread outlives the objects
    around it, and a peer that closes its end first makes gloo throw out of that thread
    (`terminate called ... gloo::IoException`, SIGABRT, exit status 134) after the
    program itself ended well. The groups were aborted when they were parked, so this
    does not wait for their collectives."""
    _GRAVEYARD.clear()
    gc.collect()


def bcast(pg: Any, buf: torch.Tensor, timeout_s: float) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    if buf.device.type == "cuda":
        timeout_s = _nccl_timeout(timeout_s)
    opts.timeout = _dt.timedelta(seconds=timeout_s)
    try:
        return pg.broadcast([buf], opts)
    except RuntimeError as e:  # gloo/NCCL report a lost peer or a reset connection so
        raise data_plane_error(e, "broadcast") from e


def _collective_error(work: Any, what: str) -> None:
    """`work.wait()`, with the collective's own error (a lost peer, a reset connection:
    a RuntimeError from gloo/NCCL) raised as a `TransportError` that says what failed."""
    try:
        work.wait()
    except RuntimeError as e:
        raise data_plane_error(e, what) from e


def host_wait(ev: torch.cuda.Event, abort: Abort | None, timeout_s: float, what: str) -> None:
    """Block this thread until `ev` completed on the GPU, `abort` fires, or `timeout_s`.

    CUDA offers no wait that a condition variable can interrupt, so the event is polled:
    tightly for the first millisecond (a bucket that is about to arrive costs no thread
    start and no wake-up latency), then every 100 us. `abort` is checked on every poll.
    """
    if ev.query():
        return
    t0 = time.monotonic()
    end, spin = t0 + timeout_s, t0 + 0.001
    while not ev.query():
        if abort is not None and abort.error is not None:
            raise PeerLost(f"update aborted: {abort.error}") from abort.error
        now = time.monotonic()
        if now >= end:
            raise TransferStalled(f"{what} did not complete within {timeout_s}s")
        time.sleep(0 if now < spin else 1e-4)


class Arrivals:
    """Events that mark when collectives completed on the GPU, recorded on a side
    stream of their own: waiting for one never waits for the work queued on the
    current stream (the packs of later buckets, the target's copies out of earlier
    ones), which a host sync on the current stream would. A small trailer can be read
    back through pinned memory in the same step (`read`)."""

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.pinned = torch.empty((rows, TRAILER_BYTES // 8), dtype=torch.int64).pin_memory()

    def mark(self, work: Any, what: str, trailer: torch.Tensor | None = None,
             row: int = 0) -> torch.cuda.Event:
        """An event that completes once `work` did (and, with `trailer`, once its 64
        bytes were copied to pinned row `row`)."""
        with torch.cuda.stream(self.side):
            _collective_error(work, what)  # the side stream waits for the collective
            if trailer is not None:
                self.pinned[row].view(torch.uint8).copy_(trailer, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.side)
        return ev

    def read(self, row: int) -> list[int]:
        """The trailer copied to `row` (call once its event completed)."""
        return self.pinned[row].tolist()


def wait_work(work: Any, abort: Abort | None, timeout_s: float, what: str,
          device: torch.device | None = None) -> None:
    """Wait for a collective, waking early if the coordinator aborts the update.

    On CUDA, also block the host (abortably) until the collective finished on the GPU,
    so that no later host sync can hang outside our timeout.
    """
    if device is not None and device.type == "cuda":
        _collective_error(work, what)  # the current stream now waits for NCCL's stream
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        host_wait(ev, abort, timeout_s, what)
        return
    if abort is None:
        _collective_error(work, what)
        return
    fut = work.get_future()
    fut.add_done_callback(lambda _f: abort.poke())
    if not abort.wait_for(fut.done, timeout_s):
        raise TransferStalled(f"{what} did not complete within {timeout_s}s")
    _collective_error(work, what)  # re-raises the collective's own error


def _warmup(pg: Any, device: torch.device, timeout_s: float, what: str) -> None:
    """Create the NCCL communicator now, bounded by `timeout_s` (see module docstring)."""
    box: dict[str, BaseException] = {}
    done = threading.Event()

    def run() -> None:
        try:
            with torch.cuda.device(device):
                t = torch.zeros(1, dtype=torch.uint8, device=device)
                bcast(pg, t, timeout_s).wait()
                torch.cuda.current_stream(device).synchronize()
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="enginehooks-nccl-init", daemon=True).start()
    if not done.wait(timeout_s):
        with contextlib.suppress(Exception):
            pg.abort()
        raise TransportError(f"{what}: the NCCL communicator did not form within {timeout_s}s")
    if "error" in box:
        raise TransportError(f"{what}: NCCL communicator setup failed: {box['error']}") from box[
            "error"
        ]


class BroadcastSender(Sender):
    def __init__(
        self,
        backend: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 120.0,
        connect_timeout_s: float | None = None,
        device: torch.device | str | None = None,
        secret: bytes | None = None,
        **_: Any,
    ) -> None:
        self.backend = backend
        self.secret = secret
        self.host = host
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout(timeout_s, connect_timeout_s)
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            # this rank's own GPU: `connect()` sets it as the current device, which an
            # index-less "cuda" cannot be
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.store = master_store(host, port, timeout_s, self.connect_timeout_s)
        self.group_id = uuid.uuid4().hex[:12]
        self.pg: Any = None
        self.world_size = 0
        cuda = self.device.type == "cuda"
        self._buffers = _Buffers(self.device, pin=False, count=SENDER_SLOTS if cuda else 2)
        self._arrivals: Arrivals | None = None

    def endpoint(self) -> dict[str, Any]:
        return {
            "transport": self.backend,
            "host": self.host,
            "port": self.store.port,
            "group": self.group_id,
            "timeout_s": self.timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
        }

    def connect(self, world_size: int) -> None:
        nccl = self.backend == "nccl" and self.device.type == "cuda"
        if nccl:
            torch.cuda.set_device(self.device)
        self.world_size = world_size
        # `host` is where the store listens; the gloo device binds this host's address
        # on the route to it (`gloo_devices`): the trainer's own address here.
        self.pg = new_group(
            self.backend, self.store, f"enginehooks/{self.group_id}/", 0, world_size,
            _nccl_timeout(self.timeout_s) if nccl else self.timeout_s, host=self.host,
            secret=self.secret,
        )
        if nccl:
            try:
                _warmup(self.pg, self.device, self.timeout_s, f"group {self.group_id} rank 0")
            except BaseException:
                self._break()
                raise

    def call_off(self, reason: str) -> None:
        """Call off the group while it forms (a replica refused its join): every rank
        waiting for it ends at once with `reason` (`_rendezvous.arrive`)."""
        call_off(self.store, f"enginehooks/{self.group_id}/", reason, self.secret)

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        if self.pg is None:
            raise TransportError("send() before connect(): the group has not formed")
        t0 = time.perf_counter()
        bufs = self._buffers.get(buffer_bytes(manifest))
        slots = len(bufs)
        cuda = self.device.type == "cuda"
        if cuda and self._arrivals is None:
            self._arrivals = Arrivals(self.device, 1)
        arrivals = self._arrivals
        pending: list[Any] = [None] * slots
        # a direct bucket's trailer broadcast, and the payload (the trainer's own tensor)
        # it must keep alive until its broadcast completed, per slot
        trailers: list[Any] = [None] * slots
        # on a GPU: the event that marks each slot's broadcasts done (`Arrivals`)
        done: list[torch.cuda.Event | None] = [None] * slots
        sizes = [message_bytes(b.nbytes) for b in manifest.buckets]

        # where the sender's time goes (stats.extra["phases_ms"]): waiting for the wire to
        # free a buffer, posting broadcasts, and the rest (the trainer's stream, packing,
        # digests), which the slots hide behind the wire when it is shorter
        waited = posted = 0.0

        def drain(slot: int, what: str) -> None:
            nonlocal waited
            t = time.perf_counter()
            ev = done[slot]
            if ev is not None:  # the slot's broadcasts completed: no sync on the stream
                host_wait(ev, abort, self.timeout_s, what)
                for w in (trailers[slot], pending[slot]):
                    if w is not None:  # order the next pack into the slot after them
                        _collective_error(w, what)
            else:
                for w in (trailers[slot], pending[slot]):
                    if w is not None:
                        wait_work(w, abort, self.timeout_s, what, self.device)
            trailers[slot] = pending[slot] = done[slot] = None
            waited += time.perf_counter() - t

        def next_buffer(index: int) -> torch.Tensor:
            drain(index % slots, f"broadcast of bucket {index - slots}")
            return bufs[index % slots][: sizes[index]]

        stats = SendStats()
        index = -1
        try:
            for index, buf in pack(manifest, stream, next_buffer, self.secret):
                t = time.perf_counter()
                slot = index % slots
                if manifest.buckets[index].direct:  # trailer first, then the payload
                    trailer = bufs[slot][: sizes[index]][-TRAILER_BYTES:]
                    trailers[slot] = bcast(self.pg, trailer, self.timeout_s)
                pending[slot] = bcast(self.pg, buf, self.timeout_s)
                if arrivals is not None:
                    done[slot] = arrivals.mark(pending[slot], f"broadcast of bucket {index}")
                stats.bytes += manifest.buckets[index].nbytes
                stats.buckets += 1
                posted += time.perf_counter() - t
            for k in range(index + 1, index + 1 + slots):  # oldest first
                drain(k % slots, "the last broadcasts")
        except TransportError:
            bury(*pending, *trailers, bufs)
            self._break()
            raise
        except BaseException as e:
            # The stream itself failed (a trainer error, or it broke the plan): tell every
            # receiver why, through the bucket they are waiting for, then fail here.
            self._abort_receivers(manifest, index + 1, [*pending, *trailers],
                                  f"{type(e).__name__}: {e}")
            raise
        stats.seconds = time.perf_counter() - t0
        stats.extra["phases_ms"] = {
            "wait_wire": waited * 1e3, "post": posted * 1e3,
            "stream_pack_digest": (stats.seconds - waited - posted) * 1e3}
        stats.extra["slots"] = slots
        return stats

    def _abort_receivers(
        self, manifest: Manifest, index: int, pending: list[Any], reason: str
    ) -> None:
        if index >= len(manifest.buckets):
            return
        try:
            for slot in range(len(pending)):
                if pending[slot] is not None:
                    pending[slot].wait()
                    pending[slot] = None
            bufs = self._buffers.bufs
            buf = bufs[index % len(bufs)][: message_bytes(manifest.buckets[index].nbytes)]
            mid = Unpacker(manifest).mid
            if manifest.buckets[index].direct:  # its receivers wait for a trailer alone
                trailer = buf[-TRAILER_BYTES:]
                text = direct_abort(trailer, mid, index, reason, self.secret)
                bcast(self.pg, trailer, self.timeout_s).wait()
                if text.numel():  # where the group's buffers live (NCCL: the GPU)
                    bcast(self.pg, text.to(buf.device), self.timeout_s).wait()
                return
            write_abort(buf, mid, index, reason, self.secret)
            bcast(self.pg, buf, self.timeout_s).wait()
        except Exception:
            self._break()

    def _break(self) -> None:
        """After a failed collective the group's state is unknown: drop it for good."""
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()
            # A process group dropped after a failed collective blocks in its destructor
            # until that collective times out; parked, the error travels at once.
            bury(pg)

    @property
    def broken(self) -> bool:
        return self.pg is None

    def close(self) -> None:
        self._break()
        self._buffers.bufs = []


def wait_within(deadline: Deadline, work: Any, what: str, device: torch.device) -> float:
    """Wait for a posted collective within what is left of `deadline` (a whole
    transfer's); the milliseconds it took (time spent waiting for the wire)."""
    t = time.perf_counter()
    try:
        wait_work(work, None, deadline.within(what), what, device)
    except TransportError as e:  # gloo's own timeout names only the last op
        if time.monotonic() >= deadline.at - 0.05:
            raise deadline.late(what) from e
        raise
    return (time.perf_counter() - t) * 1e3


class BroadcastReceiver(Receiver):
    """One engine worker's half of a broadcast group; `close()` (or a failed update,
    which closes it) leaves the group for good (`broken`)."""

    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        ep = GroupEndpoint.parse(endpoint, rank)
        self.host, self.port, self.group_id = ep.host, ep.port, ep.group
        self.timeout_s, self.world_size, self.backend = ep.timeout_s, ep.world_size, ep.transport
        self.connect_timeout_s = ep.connect_timeout_s
        self.rank = rank
        self.device = device
        self.secret = load_secret()  # this engine process's shared secret, if any
        self.pg: Any = None
        self._buffers = _Buffers(device, pin=False)
        self._arrivals: Arrivals | None = None
        self.phases: dict[str, float] = {}  # the last stream's, in ms (see `stream`)

    def connect(self) -> None:
        nccl = self.backend == "nccl" and self.device.type == "cuda"
        if nccl:
            torch.cuda.set_device(self.device)
        store = client_store(self.host, self.port, self.timeout_s, self.connect_timeout_s)
        # The trainer's host is only where to connect: the gloo device binds this engine
        # host's own address on the route to it (or GLOO_SOCKET_IFNAME), never the
        # trainer's address, which no other machine has.
        self.pg = new_group(
            self.backend, store, f"enginehooks/{self.group_id}/", self.rank, self.world_size,
            _nccl_timeout(self.timeout_s) if nccl else self.timeout_s, host=self.host,
            secret=self.secret,
        )
        if nccl:
            try:
                _warmup(self.pg, self.device, self.timeout_s,
                        f"group {self.group_id} rank {self.rank}")
            except BaseException:
                self.close()
                raise

    def stream(
        self, manifest: Manifest, into: Callable[[str], torch.Tensor | None] | None = None,
        target: Target | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the update's tensors as buckets arrive; bucket k+1 is already in flight
        while the caller consumes bucket k, so views of bucket k stay valid until the
        caller asks for the first tensor of bucket k+1. The caller must consume them on
        the current stream (or sync its own stream before asking for the next one).
        `into` is the target's optional `destination(name)` (see `Unpacker`). The loop
        is `receive_in_order` over this one group."""
        self.phases = {}  # filled as the buckets arrive (`deliver` reports it)
        order = [(0, k) for k in range(len(manifest.buckets))]
        yield from receive_in_order([self], [manifest], order, into, self.timeout_s,
                                    phases=self.phases, target=target)

    @property
    def broken(self) -> bool:
        return self.pg is None

    def arrivals(self) -> Arrivals:
        """This receiver's side stream and pinned trailer rows (made once)."""
        if self._arrivals is None:
            self._arrivals = Arrivals(self.device, 4)
        return self._arrivals

    def buffers(self, manifest: Manifest) -> list[torch.Tensor]:
        """This receiver's two bucket buffers, large enough for `manifest`."""
        return self._buffers.get(buffer_bytes(manifest))

    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.phases = {}
        target.apply(self.stream(manifest, target.destination, target))
        return {"bytes": manifest.total_bytes, "seconds": time.perf_counter() - t0,
                "phases_ms": dict(self.phases)}

    def close(self) -> None:
        self._buffers.bufs = []  # leaving the group gives the two buckets back
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()
            # A process group dropped after a failed collective blocks in its destructor
            # until that collective times out; parked, the error travels at once.
            bury(pg)


def receive_in_order(
    receivers: Sequence[BroadcastReceiver], manifests: Sequence[Manifest],
    order: Sequence[tuple[int, int]], into: Callable[[str], torch.Tensor | None] | None,
    timeout_s: float, *, phases: dict[str, float] | None = None,
    name: Callable[[int, Exception], Exception] | None = None,
    target: Target | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The broadcast receive loop, for one group or several (one sender's, or each
    sender's part of one update, `transports/multisender.py`): the buckets of
    `manifests[j]` arrive over `receivers[j]`'s group, in `order` ((group, bucket of its
    manifest) pairs), on this thread and the current stream.

    Bucket g+1's receive (whichever group) is posted before bucket g is consumed, so the
    views of bucket g stay valid until the consumer asks for the first tensor of bucket
    g+1; the consumer works on the current stream, after which NCCL orders the receive
    that next reuses the buffer. A direct bucket's trailer is received and checked
    first, with nothing else in flight, so that neither an abort notice nor a stranger's
    bytes ever land in the destination. `timeout_s` bounds the whole transfer (one
    `Deadline`). `phases` (ms) collects where the time goes: waiting for buckets,
    checking them (trailer, digest, or the fused landing), and the rest (the target's
    own work on the yielded tensors). A failure leaves every group (a torn update) and,
    with `name`, is raised as `name(group, error)`. `target`: the receiving target, told
    what lands in its own tensors where it asks (`Target.landing_wanted`)."""
    pgs = [r.pg for r in receivers]  # a concurrent leave() must not pull a group from under us
    if any(pg is None for pg in pgs):
        raise TransportError("receive before connect(): the group has not formed")
    device = receivers[0].device
    unpackers = [Unpacker(m, device, into, r.secret, target)
                 for m, r in zip(manifests, receivers)]
    for m, u in zip(manifests, unpackers):
        if not m.buckets:
            yield from u.empties()
    n = len(order)
    if not n:
        return
    bufs = [r.buffers(m) if m.buckets else [] for r, m in zip(receivers, manifests)]
    sizes = [[message_bytes(b.nbytes) for b in m.buckets] for m in manifests]
    # direct buckets: their trailers (received first) and where each payload went
    heads = [[torch.empty(TRAILER_BYTES, dtype=torch.uint8, device=device)
              for _ in range(2)] if any(b.direct for b in m.buckets) else []
             for m in manifests]
    payloads: list[list[torch.Tensor | None]] = [[None, None] for _ in manifests]
    landed = [[False, False] for _ in manifests]
    deadline = Deadline.after(timeout_s)
    left = deadline.within
    times = phases if phases is not None else {}
    times.update(wait_wire=0.0, check=0.0)
    started = time.perf_counter()
    # On a GPU: each receive's arrival is an event on a side stream, and its trailer
    # comes back through pinned memory with it (`Arrivals`): checking a trailer never
    # waits for the target's work on the current stream, and with `sum64` the digests
    # are compared on the device and read once, at the end (`Unpacker.finish`).
    cuda = device.type == "cuda"
    arrivals = receivers[0].arrivals() if cuda else None

    def waited(work: Any, what: str, ev: torch.cuda.Event | None = None) -> None:
        if ev is None:
            times["wait_wire"] += wait_within(deadline, work, what, device)
            return
        t = time.perf_counter()
        try:
            host_wait(ev, None, left(what), what)
        except TransferStalled as e:
            raise deadline.late(what) from e
        _collective_error(work, what)  # the current stream waits for the receive
        times["wait_wire"] += (time.perf_counter() - t) * 1e3

    j = order[0][0]  # the group of the bucket an error belongs to
    digs: list[list[int]] = [[0, 0] for _ in manifests]  # each slot's announced digest

    def post(g: int) -> tuple[Any, torch.cuda.Event | None]:
        """Post the receive of the g-th bucket of `order`."""
        nonlocal j
        j, k = order[g]
        m, u, slot = manifests[j], unpackers[j], k % 2
        if not m.buckets[k].direct:
            what = f"receive of bucket {k}"
            buf = bufs[j][slot][: sizes[j][k]]
            w = bcast(pgs[j], buf, left(what))
            return w, (arrivals.mark(w, what, buf[-TRAILER_BYTES:], slot)
                       if arrivals is not None else None)
        what = f"receive of bucket {k}'s trailer"
        w = bcast(pgs[j], heads[j][slot], left(what))
        if arrivals is not None:
            waited(w, what, arrivals.mark(w, what, heads[j][slot], 2 + slot))
            reason, digs[j][slot] = u.check_header_raw(k, arrivals.read(2 + slot))
        else:
            waited(w, what)
            reason = u.check_header(k, heads[j][slot])
        if reason >= 0:
            text = torch.empty(reason, dtype=torch.uint8, device=device)
            if reason:
                what = f"receive of bucket {k}'s abort reason"
                waited(bcast(pgs[j], text, left(what)), what)
            u.aborted(text)
        region = u.landing(k)
        landed[j][slot] = region is not None
        payload = region if region is not None else bufs[j][slot][: m.buckets[k].nbytes]
        payloads[j][slot] = payload
        what = f"receive of bucket {k}"
        w = bcast(pgs[j], payload, left(what))
        return w, arrivals.mark(w, what) if arrivals is not None else None

    work: Any = None
    try:
        work, ev = post(0)
        for g in range(n):
            j, k = order[g]
            m, u, slot = manifests[j], unpackers[j], k % 2
            buf = bufs[j][slot][: sizes[j][k]]
            waited(work, f"receive of bucket {k}", ev)
            work = None
            direct = m.buckets[k].direct
            defer = u.defer()
            # Read the trailer before posting the next receive: after an abort notice
            # no collective may be left in flight (destroying a pending Work blocks
            # until it times out, which would delay the error). The digest is checked
            # while the next bucket is already on its way.
            t = time.perf_counter()
            if not direct:
                if arrivals is not None:
                    nbytes, digs[j][slot] = u.verify_raw(k, arrivals.read(slot))
                    if nbytes < 0:  # an abort notice: its reason is in the payload
                        u.aborted(buf[: -1 - nbytes])
                else:
                    u.verify(k, buf, check_digest=False)
            if g + 1 < n:
                work, ev = post(g + 1)
                j = order[g][0]  # errors below are this bucket's
            if direct and landed[j][slot]:
                payload = payloads[j][slot]
                assert payload is not None  # landed: post() received it there
                if defer:
                    u.defer_digest(k, payload, digs[j][slot])
                else:
                    u.verify_digest(k, payload, heads[j][slot])
                times["check"] += (time.perf_counter() - t) * 1e3
                yield from u.unpack(k, buf, verified=True, landed=True)
                continue
            # a packed bucket on a GPU: copied into the target's destinations while
            # its digest is computed (`Unpacker.land`), where the target offers them
            placed = None if direct else u.land(k, buf, digs[j][slot] if defer else None)
            if placed is None:
                if defer:
                    u.defer_digest(k, buf[: m.buckets[k].nbytes], digs[j][slot])
                else:
                    u.verify_digest(k, buf, heads[j][slot] if direct else None)
            times["check"] += (time.perf_counter() - t) * 1e3
            yield from u.unpack(k, buf, verified=True, placed=placed)
        t = time.perf_counter()
        for u in unpackers:  # the deferred digests: one read for the update
            u.finish()
        times["check"] += (time.perf_counter() - t) * 1e3
        times["target_and_rest"] = ((time.perf_counter() - started) * 1e3
                                    - times["wait_wire"] - times["check"])
    except BaseException as e:
        # A torn update leaves every group in an unknown state: leave them, so that
        # every sender fails now.
        bury(work, *bufs, *payloads)
        for r in receivers:
            r.close()
        if name is not None and isinstance(e, Exception):
            raise name(j, e) from e
        raise

"""Colocated transports: trainer and engine on one host (`shm`) or one GPU (`cuda_ipc`).

No bytes travel through a collective: the sender owns two bucket buffers that every
receiver maps once, and the trainer-side process and the engine workers take turns on
them. What differs between `shm` and `cuda_ipc` is only how a buffer is allocated,
described (a JSON-able descriptor, never a pickle) and mapped; everything else lives
here, in `ColocatedSender` / `ColocatedReceiver`.

Signalling goes through the TCPStore rendezvous (the same one the broadcast transports
use), under the group's prefix `enginehooks/<group>/`:

- `join/<rank>`            a receiver connected (the sender waits for all of them)
- `buffers/<gen>`          descriptor of buffer generation `gen` (JSON)
- `u<seq>/ready/<k>`       bucket k of update `seq` is sealed in a slot:
                           `{"gen", "slot", "mid"}`, or `{"abort": reason}`
- `u<seq>/ack/<k>/<rank>`  rank copied bucket k out: `ok`, or `error: ...`

Update `seq` counts the sender's `send()` calls and each receiver's `deliver()` calls;
both sides start from zero in a fresh group, and a failed update marks both halves
`broken`, so the coordinator rebuilds the group (fresh prefix, fresh counters) before
the next push and the counters can never drift apart.

Ordering, which is what keeps the bytes whole:
1. the sender packs bucket k into slot k % 2 (two buffers bound the memory), seals it
   (trailer with the digest), syncs its device, then publishes `ready/k`;
2. a receiver reads `ready/k`, verifies the trailer and digest through the same
   `Unpacker` the broadcast transports use, hands views of the slot to the target,
   syncs its device once the target moved on (the copies out are done), then acks;
3. the sender reuses slot k % 2 for bucket k + 2 only after every receiver acked k.

Step 3 is what a forged ack would break: anyone who reaches the store could write `ok`
for a bucket a receiver is still reading, and the sender would refill the slot under
it (bytes from two updates, applied without an error). So, **with a shared secret**
(`ENGINEHOOKS_SECRET` on the trainer and the engines, `core/auth.py`), every control
message above carries an HMAC-SHA256 suffix (`<body>\nmac=<hex>`, `_rendezvous.py`)
over: the group, the message kind (`join`, `buffers`, `ready`, `ack`), the update `seq`,
the bucket index (the generation for `buffers`, the rank for `join`), the audience (the
receiver rank that writes an ack or a join; `*`, every receiver of the group, for the
one `ready` and `buffers` key they all read), the direction (`trainer->engine`,
`engine->trainer`, or `trainer->trainer` for the coordinator's abort, which only the
sender reads) and the body. A message moved to another key, group, update, bucket, rank
or direction no longer verifies. A message whose MAC fails (or that is unsigned) is
noise: the side that read it logs it (naming the key) and keeps waiting for the
genuine one, which the genuine writer's `set` puts in its place; if none comes, the wait
ends at its timeout and the error says which keys held messages that did not verify.
It is never taken as a real ack, abort, descriptor or join, so the sender refills a
slot only after each receiver's own authenticated ack, which that receiver writes only
after its copies out of the slot are done: a receiver never applies bytes the sender
could have rewritten, and only a verified abort ends an update early. What a
store-reaching attacker keeps is delay: overwriting or deleting a key after the genuine
message landed leaves that wait to its timeout.

**Without a secret**, nothing is signed (messages are the bare bodies, exactly as
before) and a process that reaches the store can forge acks, aborts and descriptors:
run with a secret wherever the store is reachable by anyone but the trainer and its
engines (docs/security.md, "Transport control messages"). A side without a secret
ignores the MAC suffix of a side that has one (a trainer with a secret refuses such
engines at join, before this matters).

Failures cross over through the same keys: a receiver that fails writes `error: ...`
into its remaining acks; a sender that fails (its stream broke, an ack said error or
did not verify, a wait timed out, or the coordinator's `Abort` fired) writes
`{"abort": ...}` into the remaining ready keys. Every store wait carries `timeout_s`.
The coordinator's `Abort` reaches a sender blocked in a store wait through a watcher
thread on a second store connection, which writes the abort into the acks the sender
waits for.
"""

from __future__ import annotations

import datetime as _dt
import json
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.core.auth import load_secret
from enginehooks.core.buckets import Unpacker, buffer_bytes, manifest_id, message_bytes, pack
from enginehooks.core.errors import PeerLost, SenderAborted, TransferStalled, TransportError
from enginehooks.core.manifest import Manifest
from enginehooks.transports._rendezvous import (  # re-exported: the colocated names
    EVERY_RECEIVER,
    MAC_SEP,
    RECHECK_S,
    TO_ENGINE,
    TO_TRAINER,
    TRAINER_SELF,
    ControlChannel,
    ControlMessageRefused,
    Ignored,
    client_store,
    connect_timeout,
    control_mac,
    master_store,
)
from enginehooks.wire.endpoint import GroupEndpoint

__all__ = ["EVERY_RECEIVER", "MAC_SEP", "OK", "TO_ENGINE", "TO_TRAINER", "TRAINER_SELF",
           "ColocatedReceiver", "ColocatedSender", "ControlChannel", "ControlMessageRefused",
           "control_mac"]
from enginehooks.transports.base import Abort, Receiver, Sender, SendStats, Stream, Target

# (`store.set(key, value)` takes bytes; torch's stubs say str: hence the `ignore[arg-type]`
# on the sealed messages this module and cuda_ipc.py write into stores.)

OK = b"ok"
#: How often a sender polls the acks it has not seen verified yet.
POLL_S = RECHECK_S


def _set_all(store: dist.Store, keys: list[str], values: list[bytes]) -> None:
    """Best-effort: write `values[i]` under `keys[i]` (the peer may be gone already), in
    batches so one failure notice never becomes thousands of round trips."""
    try:
        for start in range(0, len(keys), 512):
            store.multi_set(  # type: ignore[attr-defined]  # torch's stubs lack it
                keys[start : start + 512], values[start : start + 512])
    except Exception:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class ColocatedSender(Sender):
    """Trainer side: owns the buffers and the store; see the module docstring.

    Subclasses implement `_allocate` (two buffers and their JSON descriptor),
    `_all_mapped` (called once every receiver mapped a generation) and `_release`.
    """

    transport_name = "colocated"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 120.0,
        connect_timeout_s: float | None = None,
        device: torch.device | str | None = None,
        secret: bytes | None = None,
        **_: Any,
    ) -> None:
        self.host = host
        self.secret = secret
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = connect_timeout(self.timeout_s, connect_timeout_s)
        self.device = self._default_device(device)
        self.store = master_store(host, port, self.timeout_s, self.connect_timeout_s)
        self.group_id = uuid.uuid4().hex[:12]
        self.prefix = f"enginehooks/{self.group_id}/"
        self.channel = ControlChannel(secret, self.group_id, self.prefix,
                                      f"{self.transport_name} sender")
        self.world_size = 0
        self.seq = 0
        self.gen = 0
        self.bufs: list[torch.Tensor] = []
        self._broken = False
        self._watch_store: dist.TCPStore | None = None
        self._mapped_gens: set[int] = set()

    # -- what subclasses provide -----------------------------------------------------
    def _default_device(self, device: torch.device | str | None) -> torch.device:
        return torch.device(device or "cpu")

    @abstractmethod
    def _allocate(self, nbytes: int, gen: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Two buffers of `nbytes` and the JSON-able descriptor receivers map them from."""

    def _all_mapped(self, gen: int) -> None:
        """Every receiver has mapped generation `gen` (shm unlinks its files here)."""

    @abstractmethod
    def _release(self) -> None:
        """Free the current buffers (after every receiver is done with them)."""

    def _sealed(self, index: int, buf: torch.Tensor) -> None:
        """Bucket `index` is packed and sealed in `buf`, not yet published. A seam for
        tests that corrupt a sealed bucket to prove receivers catch it; no-op here."""

    # -- Sender API --------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        return {
            "transport": self.transport_name,
            "host": self.host,
            "port": self.store.port,
            "group": self.group_id,
            "timeout_s": self.timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
        }

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _receivers(self) -> range:
        return range(1, self.world_size)

    def connect(self, world_size: int) -> None:
        if world_size < 2:
            raise TransportError(f"a colocated group needs at least one receiver, got {world_size}")
        self.world_size = world_size
        # each receiver signs its own join: a forged one is ignored (`_await_signed`)
        self._await_signed(
            "join", 0, None, (TO_TRAINER,), self.connect_timeout_s,
            lambda missing, e, ignored: TransportError(
                f"{self.transport_name} group {self.group_id}: receivers {missing} did not "
                f"join within {self.connect_timeout_s}s{f' ({e})' if e else ''}{ignored}"))
        self._watch_store = client_store(
            self.host, self.store.port, self.timeout_s, self.connect_timeout_s)

    def _ensure_buffers(self, nbytes: int) -> None:
        if self.bufs and self.bufs[0].numel() >= nbytes:
            return
        self._release()
        self.bufs = []
        self.gen += 1
        bufs, desc = self._allocate(nbytes, self.gen)
        self.bufs = bufs
        body = json.dumps(desc, sort_keys=True).encode()
        self.store.set(self._key("buffers", self.gen),
                       self.channel.seal("buffers", 0, self.gen, EVERY_RECEIVER, TO_ENGINE, body))  # type: ignore[arg-type]

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        if self.world_size < 2 or self._watch_store is None:
            raise TransportError("send() before connect(): the group has not formed")
        if self._broken:
            raise TransportError("this group failed an earlier update; rebuild it")
        t0 = time.perf_counter()
        self.seq += 1
        seq, n = self.seq, len(manifest.buckets)
        sizes = [message_bytes(b.nbytes) for b in manifest.buckets]
        self._ensure_buffers(buffer_bytes(manifest))
        mid = manifest_id(manifest)
        pending: list[int | None] = [None, None]
        finished = threading.Event()
        watcher = self._watch(abort, seq, n, finished)

        def next_buffer(index: int) -> torch.Tensor:
            slot = index % 2
            if (waiting := pending[slot]) is not None:
                self._wait_acks(seq, waiting, abort)
                pending[slot] = None
            return self.bufs[slot][: sizes[index]]

        stats = SendStats()
        index = -1
        published = 0  # buckets whose ready key is out
        try:
            for index, buf in pack(manifest, stream, next_buffer, self.secret):
                self._sealed(index, buf)
                _sync(self.device)  # the slot's bytes are final before anyone may read
                body = json.dumps({"gen": self.gen, "slot": index % 2, "mid": mid}).encode()
                self.store.set(
                    self._key(f"u{seq}", "ready", index),
                    self.channel.seal("ready", seq, index, EVERY_RECEIVER, TO_ENGINE, body),  # type: ignore[arg-type]
                )
                published = index + 1
                pending[index % 2] = index
                stats.bytes += manifest.buckets[index].nbytes
                stats.buckets += 1
            for slot in sorted((0, 1), key=lambda s: p if (p := pending[s]) is not None else -1):
                if (waiting := pending[slot]) is not None:
                    self._wait_acks(seq, waiting, abort)
                    pending[slot] = None
        except BaseException as e:
            self._broken = True
            self._abort_receivers(seq, published, n, f"{type(e).__name__}: {e}")
            raise
        finally:
            finished.set()
            abort.poke()
            watcher.join(timeout=self.timeout_s)
        stats.seconds = time.perf_counter() - t0
        # Housekeeping off the critical path, on the watcher's own store connection.
        threading.Thread(target=self._forget, args=(seq, n), daemon=True,
                         name="enginehooks-colocated-forget").start()
        stats.extra = {
            "generation": self.gen,
            "slot_bytes": self.bufs[0].numel() if self.bufs else 0,
        }
        return stats

    def _await_signed(self, kind: str, seq: int, index: int | None,
                      directions: tuple[str, ...], timeout_s: float,
                      late: Callable[[list[int], BaseException | None, str], TransportError],
                      abort: Abort | None = None,
                      check: Callable[[int, bytes], None] | None = None) -> None:
        """Wait up to `timeout_s` for every receiver's own verified message of `kind` (a
        join, an ack of bucket `index`), handing each to `check` as it arrives (which
        may raise at once: a receiver's error ends the wait). A message that does not
        verify is noise: logged, and the wait goes on until the genuine one replaces it
        (module docstring). `late(ranks, store error or None, what was ignored)` is the
        error of the ranks that never answered."""
        keys = {r: self.channel.key(kind, seq, r if index is None else index, r)
                for r in self._receivers()}
        deadline = time.monotonic() + timeout_s
        ignored = Ignored()
        while keys:
            try:
                self.store.wait(list(keys.values()),
                                _dt.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            except Exception as e:
                # every rank without a genuine answer yet, whether its key is absent or
                # holds a message that did not verify (a loaded host can time the wait
                # out near the deadline although a forged key is there)
                raise late(list(keys), e, ignored.says()) from None
            for r, raw in zip(list(keys), self.store.multi_get(list(keys.values()))):
                if abort is not None and abort.error is not None:  # the watcher woke us
                    raise PeerLost(f"update aborted: {abort.error}") from abort.error
                try:
                    body = self.channel.open(kind, seq, r if index is None else index, r,
                                             directions, raw)
                except ControlMessageRefused as e:
                    ignored.note(keys[r], raw, e)
                    continue
                if check is not None:
                    check(r, body)
                del keys[r]
            if keys:
                if time.monotonic() >= deadline:
                    raise late(list(keys), None, ignored.says())
                time.sleep(POLL_S)

    def _wait_acks(self, seq: int, index: int, abort: Abort) -> None:
        def ok(r: int, v: bytes) -> None:
            if v != OK:
                raise TransportError(
                    f"{self.transport_name}: receiver rank {r} failed on bucket {index}: "
                    f"{v.decode('utf-8', 'replace')}")

        # Only rank r's own authenticated ack frees the slot (module docstring).
        self._await_signed(
            "ack", seq, index, (TO_TRAINER, TRAINER_SELF), self.timeout_s,
            lambda late, e, ignored: TransportError(
                f"{self.transport_name}: receivers {late} did not acknowledge bucket {index} "
                f"within {self.timeout_s}s{f' ({type(e).__name__})' if e else ''}{ignored}"),
            abort, ok)
        if self.gen not in self._mapped_gens:
            # An ack means that receiver mapped this generation before reading it.
            self._mapped_gens.add(self.gen)
            self._all_mapped(self.gen)

    def _watch(self, abort: Abort, seq: int, n: int, finished: threading.Event) -> threading.Thread:
        """Turn the coordinator's `Abort` into store writes that end the sender's waits."""
        store = self._watch_store

        def run() -> None:
            try:
                while not finished.is_set():
                    abort.wait_for(finished.is_set, self.timeout_s)
            except TransportError as e:
                if store is None or finished.is_set():
                    return
                reason = f"error: update aborted by the coordinator: {e}".encode()
                pairs = [(k, r) for k in range(n) for r in self._receivers()]
                _set_all(store, [self._key(f"u{seq}", "ack", k, r) for k, r in pairs],
                         [self.channel.seal("ack", seq, k, r, TRAINER_SELF, reason)
                          for k, r in pairs])

        t = threading.Thread(target=run, name="enginehooks-colocated-abort", daemon=True)
        t.start()
        return t

    def _abort_receivers(self, seq: int, first: int, n: int, reason: str) -> None:
        """Tell receivers still waiting for buckets `first..n-1` why the update ended."""
        store = self._watch_store or self.store
        keys = [self._key(f"u{seq}", "ready", k) for k in range(first, n)]
        body = json.dumps({"abort": reason}).encode()
        _set_all(store, keys, [self.channel.seal("ready", seq, k, EVERY_RECEIVER, TO_ENGINE, body)
                               for k in range(first, n)])

    def _forget(self, seq: int, n: int) -> None:
        """Drop the finished update's keys so the store does not grow with every push."""
        store = self._watch_store
        if store is None:
            return
        keys = [self._key(f"u{seq}", "ready", k) for k in range(n)]
        keys += [self._key(f"u{seq}", "ack", k, r) for k in range(n) for r in self._receivers()]
        try:
            for k in keys:
                store.delete_key(k)
        except Exception:
            pass

    @property
    def broken(self) -> bool:
        return self._broken

    def close(self) -> None:
        if self.world_size and not self._broken:
            self._broken = True
        try:
            self._release()
        finally:
            self.bufs = []
            self._watch_store = None


class ColocatedReceiver(Receiver):
    """Engine side: maps the sender's buffers once per generation and caches them.

    Subclasses implement `_map` (descriptor -> two tensors on this side) and `_unmap`.
    """

    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        ep = GroupEndpoint.parse(endpoint, rank)
        self.host, self.port, self.group_id = ep.host, ep.port, ep.group
        self.timeout_s, self.world_size, self.transport_name = (
            ep.timeout_s, ep.world_size, ep.transport)
        self.connect_timeout_s = ep.connect_timeout_s
        self.rank = rank
        self.device = device
        self.secret = load_secret()  # this engine process's shared secret, if any
        self.prefix = f"enginehooks/{self.group_id}/"
        self.channel = ControlChannel(self.secret, self.group_id, self.prefix,
                                      f"{self.transport_name} rank {rank}")
        self.store: dist.TCPStore | None = None
        self.seq = 0
        self.gen = 0
        self.bufs: list[torch.Tensor] = []
        self._broken = False

    @abstractmethod
    def _map(self, desc: dict[str, Any]) -> list[torch.Tensor]:
        """The two buffers described by `desc`, mapped into this process."""

    def _unmap(self) -> None:
        """Release the mapping of the current buffers."""

    @property
    def broken(self) -> bool:
        return self._broken

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def connect(self) -> None:
        self.store = client_store(self.host, self.port, self.timeout_s, self.connect_timeout_s)
        self.store.set(self._key("join", self.rank),
                       self.channel.seal("join", 0, self.rank, self.rank, TO_TRAINER, b"1"))  # type: ignore[arg-type]

    def _get(self, key: str, what: str) -> bytes:
        store = self._store()
        try:
            return store.get(key)  # waits for the key, up to the store's timeout
        except Exception as e:
            raise TransferStalled(
                f"{self.transport_name} rank {self.rank}: {what} did not arrive within "
                f"{self.timeout_s}s ({type(e).__name__}: {e})"
            ) from None

    def _genuine(self, kind: str, seq: int, index: int, what: str) -> bytes:
        """The body of the verified message of `kind` (the trainer's, to every receiver),
        waiting for it up to `timeout_s`: a message there that does not verify is
        logged and ignored, and the key read again until the genuine one replaces it."""
        key = self.channel.key(kind, seq, index, EVERY_RECEIVER)
        deadline = time.monotonic() + self.timeout_s
        ignored = Ignored()
        while True:
            raw = self._get(key, what)
            try:
                return self.channel.open(kind, seq, index, EVERY_RECEIVER, (TO_ENGINE,), raw)
            except ControlMessageRefused as e:
                ignored.note(key, raw, e)
            if time.monotonic() >= deadline:
                raise TransferStalled(
                    f"{self.transport_name} rank {self.rank}: {what} did not arrive within "
                    f"{self.timeout_s}s{ignored.says()}")
            time.sleep(RECHECK_S)

    def _ready_message(self, seq: int, index: int, mid: int) -> dict[str, Any]:
        """Bucket `index`'s verified ready message for update `seq` (raises on an
        abort, or another update's message; ignores messages that do not verify)."""
        body = self._genuine("ready", seq, index, f"bucket {index}")
        try:
            msg = json.loads(body)
            if not isinstance(msg, dict):
                raise ValueError(type(msg).__name__)
        except ValueError:
            raise TransportError(
                f"bucket {index}: unreadable ready message {body[:80]!r}") from None
        if "abort" in msg:
            raise SenderAborted(f"the sender aborted the update: {msg['abort']}")
        if msg.get("mid") != mid:
            raise TransportError(
                f"bucket {index} belongs to another update (manifest id {msg.get('mid')!r}, "
                f"expected {mid}); the group's update counters drifted"
            )
        return msg

    def _slot(self, seq: int, index: int, mid: int) -> int:
        msg = self._ready_message(seq, index, mid)
        try:
            gen, slot = int(msg["gen"]), int(msg["slot"])
        except (KeyError, TypeError, ValueError):
            raise TransportError(f"bucket {index}: malformed ready message {msg!r:.200}") from None
        if slot != index % 2:
            raise TransportError(f"bucket {index}: ready message names slot {slot}, the "
                                 f"sender packs bucket {index} into slot {index % 2}")
        if gen != self.gen:
            self._unmap()
            self.bufs = []
            body = self._genuine("buffers", 0, gen, f"buffer generation {gen}")
            try:
                desc = json.loads(body)
            except ValueError:
                desc = None
            if not isinstance(desc, dict):
                raise TransportError(f"malformed buffer descriptor {body!r:.200}")
            self.bufs = self._map(desc)
            self.gen = gen
        return slot

    def stream(
        self, manifest: Manifest, into: Callable[[str], torch.Tensor | None] | None = None
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yield the update's tensors; views of bucket k are valid until the caller asks
        for the first tensor of bucket k+1 (this side then syncs and acks bucket k)."""
        if self.store is None or self._broken:
            raise TransportError("receive before connect(), or on a broken group")
        self.seq += 1
        seq, n = self.seq, len(manifest.buckets)
        unpacker = Unpacker(manifest, self.device, into, self.secret)
        mid = manifest_id(manifest)
        index = 0
        try:
            if n == 0:
                yield from unpacker.empties()
            for index in range(n):
                slot = self._slot(seq, index, mid)
                buf = self.bufs[slot][: message_bytes(manifest.buckets[index].nbytes)]
                unpacker.verify(index, buf, check_digest=False)
                # on a GPU: copied into the target's destinations while the digest is
                # computed (`Unpacker.land`), where the target offers them
                placed = unpacker.land(index, buf)
                if placed is None:
                    unpacker.verify_digest(index, buf)
                yield from unpacker.unpack(index, buf, verified=True, placed=placed)
                _sync(self.device)  # the target's copies out of the slot are done
                self.store.set(self._key(f"u{seq}", "ack", index, self.rank),
                               self.channel.seal("ack", seq, index, self.rank, TO_TRAINER, OK))  # type: ignore[arg-type]
        except BaseException as e:
            self._broken = True
            self._fail(seq, index, n, f"error: {type(e).__name__}: {e}")
            raise

    def _store(self) -> dist.Store:
        if self.store is None:
            raise TransportError("this receiver has not connected to the group's store")
        return self.store

    def _fail(self, seq: int, first: int, n: int, reason: str) -> None:
        keys = [self._key(f"u{seq}", "ack", k, self.rank) for k in range(first, n)]
        body = reason.encode()
        _set_all(self._store(), keys, [self.channel.seal("ack", seq, k, self.rank, TO_TRAINER, body)
                                       for k in range(first, n)])

    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        t0 = time.perf_counter()
        it = self.stream(manifest, target.destination)
        target.apply(it)
        # The last ack is sent when the iterator is exhausted: make sure it was.
        leftover = next(it, None)
        if leftover is not None:
            it.close()
            raise TransportError(
                f"the target stopped before consuming the whole update (next: {leftover[0]!r})"
            )
        return {"bytes": manifest.total_bytes, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self._broken = True
        try:
            self._unmap()
        finally:
            self.bufs = []
            self.store = None

"""Broadcast from the trainer's sender rank to every engine worker: `gloo` and `nccl`.

One code path serves both backends; only where buffers live differs (host memory for
gloo, the sender's / receiver's GPU for nccl). Two buffers per side: the sender packs
bucket k+1 while bucket k is on the wire, and a receiver posts the receive of bucket
k+1 before it applies bucket k. A buffer is reused only after the collective that used
it has completed (`Work.wait`, which on NCCL also orders the current stream after the
communication stream), so packing can never tear bytes still being sent.
"""

from __future__ import annotations

import datetime as _dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.buckets import TRAILER_BYTES, Unpacker, pack, write_abort
from enginehooks.errors import TransportError
from enginehooks.manifest import ALIGN, Manifest
from enginehooks.rendezvous import client_store, master_store, new_group
from enginehooks.transports.base import Abort, Receiver, Sender, SendStats, Stream, Target, Transport


def message_bytes(payload: int) -> int:
    """Bytes on the wire for a bucket of `payload` bytes: payload, padding, trailer."""
    return (payload + ALIGN - 1) // ALIGN * ALIGN + TRAILER_BYTES


def _largest_message(manifest: Manifest) -> int:
    return max((message_bytes(b.nbytes) for b in manifest.buckets), default=TRAILER_BYTES)


class _Buffers:
    """Two reusable byte buffers, grown when a manifest needs more."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device, self.pin = device, pin
        self.bufs: list[torch.Tensor] = []

    def get(self, nbytes: int) -> list[torch.Tensor]:
        if not self.bufs or self.bufs[0].numel() < nbytes:
            self.bufs = []  # free the old pair before allocating the new one
            for _ in range(2):
                b = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self.bufs.append(b.pin_memory() if self.pin else b)
        return self.bufs


def _bcast(pg: Any, buf: torch.Tensor, timeout_s: float) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = _dt.timedelta(seconds=timeout_s)
    return pg.broadcast([buf], opts)


def _wait(work: Any, abort: Abort | None, timeout_s: float, what: str) -> None:
    """Wait for a collective, waking early if the coordinator aborts the update."""
    if abort is None:
        work.wait()
        return
    fut = work.get_future()
    fut.add_done_callback(lambda _f: abort.poke())
    if not abort.wait_for(fut.done, timeout_s):
        raise TransportError(f"{what} did not complete within {timeout_s}s")
    work.wait()  # re-raises the collective's own error, and orders streams on NCCL


class BroadcastSender(Sender):
    def __init__(
        self,
        backend: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 120.0,
        device: torch.device | str | None = None,
        **_: Any,
    ) -> None:
        self.backend = backend
        self.host = host
        self.timeout_s = timeout_s
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.store = master_store(host, port, timeout_s)
        self.group_id = uuid.uuid4().hex[:12]
        self.pg: Any = None
        self.world_size = 0
        self._buffers = _Buffers(self.device, pin=False)

    def endpoint(self) -> dict[str, Any]:
        return {
            "transport": self.backend,
            "host": self.host,
            "port": self.store.port,
            "group": self.group_id,
            "timeout_s": self.timeout_s,
        }

    def connect(self, world_size: int) -> None:
        if self.backend == "nccl" and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.world_size = world_size
        self.pg = new_group(
            self.backend, self.store, f"enginehooks/{self.group_id}/", 0, world_size,
            self.timeout_s, self.host,
        )

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        if self.pg is None:
            raise TransportError("send() before connect(): the group has not formed")
        t0 = time.perf_counter()
        bufs = self._buffers.get(_largest_message(manifest))
        pending: list[Any] = [None, None]
        sizes = [message_bytes(b.nbytes) for b in manifest.buckets]

        def next_buffer(index: int) -> torch.Tensor:
            slot = index % 2
            if pending[slot] is not None:
                _wait(pending[slot], abort, self.timeout_s, f"broadcast of bucket {index - 2}")
                pending[slot] = None
            return bufs[slot][: sizes[index]]

        stats = SendStats()
        index = -1
        try:
            for index, buf in pack(manifest, stream, next_buffer):
                pending[index % 2] = _bcast(self.pg, buf, self.timeout_s)
                stats.bytes += manifest.buckets[index].nbytes
                stats.buckets += 1
            for slot in (0, 1):
                if pending[slot] is not None:
                    _wait(pending[slot], abort, self.timeout_s, "the last broadcasts")
                    pending[slot] = None
        except TransportError:
            self._break()
            raise
        except BaseException as e:
            # The stream itself failed (a trainer error, or it broke the plan): tell every
            # receiver why, through the bucket they are waiting for, then fail here.
            self._abort_receivers(manifest, index + 1, pending, f"{type(e).__name__}: {e}")
            raise
        stats.seconds = time.perf_counter() - t0
        return stats

    def _abort_receivers(
        self, manifest: Manifest, index: int, pending: list[Any], reason: str
    ) -> None:
        if index >= len(manifest.buckets):
            return
        try:
            for slot in (0, 1):
                if pending[slot] is not None:
                    pending[slot].wait()
                    pending[slot] = None
            buf = self._buffers.bufs[index % 2][: message_bytes(manifest.buckets[index].nbytes)]
            write_abort(buf, Unpacker(manifest).mid, index, reason)
            _bcast(self.pg, buf, self.timeout_s).wait()
        except Exception:  # noqa: BLE001 - best effort; the receivers time out otherwise
            self._break()

    def _break(self) -> None:
        """After a failed collective the group's state is unknown: drop it for good."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001
                pass

    @property
    def broken(self) -> bool:
        return self.pg is None

    def close(self) -> None:
        self._break()
        self._buffers.bufs = []


class BroadcastReceiver(Receiver):
    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        try:
            self.host = str(endpoint["host"])
            self.port = int(endpoint["port"])
            self.group_id = str(endpoint["group"])
            self.timeout_s = float(endpoint["timeout_s"])
            self.world_size = int(endpoint["world_size"])
            self.backend = str(endpoint["transport"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransportError(f"bad broadcast endpoint {endpoint!r}: {e}") from None
        if not 1 <= rank < self.world_size:
            raise TransportError(f"rank {rank} is outside 1..{self.world_size - 1}")
        self.rank = rank
        self.device = device
        self.pg: Any = None
        self._buffers = _Buffers(device, pin=False)

    def connect(self) -> None:
        if self.backend == "nccl" and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        store = client_store(self.host, self.port, self.timeout_s)
        self.pg = new_group(
            self.backend, store, f"enginehooks/{self.group_id}/", self.rank, self.world_size,
            self.timeout_s, self.host,
        )

    def stream(self, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the update's tensors as buckets arrive; bucket k+1 is already in flight
        while the caller consumes bucket k, so views of bucket k stay valid until the
        caller asks for the first tensor of bucket k+1."""
        if self.pg is None:
            raise TransportError("receive before connect(): the group has not formed")
        unpacker = Unpacker(manifest, self.device)
        n = len(manifest.buckets)
        if n == 0:
            yield from unpacker.empties()
            return
        bufs = self._buffers.get(_largest_message(manifest))
        sizes = [message_bytes(b.nbytes) for b in manifest.buckets]
        work = _bcast(self.pg, bufs[0][: sizes[0]], self.timeout_s)
        try:
            for index in range(n):
                buf = bufs[index % 2][: sizes[index]]
                work.wait()
                if index + 1 < n:
                    work = _bcast(self.pg, bufs[(index + 1) % 2][: sizes[index + 1]],
                                  self.timeout_s)
                yield from unpacker.unpack(index, buf)
        except BaseException:
            # A torn update leaves the group in an unknown state: leave it.
            self.close()
            raise

    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        t0 = time.perf_counter()
        target.apply(self.stream(manifest))
        return {"bytes": manifest.total_bytes, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001
                pass


class GlooTransport(Transport):
    """Broadcast over gloo: CPU tensors, TCP between processes and hosts."""

    name = "gloo"

    def sender(self, **options: Any) -> Sender:
        return BroadcastSender("gloo", **options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return BroadcastReceiver(endpoint, rank, torch.device("cpu"))


class NcclTransport(Transport):
    """Broadcast over NCCL: GPU buffers, NVLink / InfiniBand between GPUs and nodes."""

    name = "nccl"

    def sender(self, **options: Any) -> Sender:
        return BroadcastSender("nccl", **options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return BroadcastReceiver(endpoint, rank, device)

"""verl's `CheckpointEngine` contract on enginehooks' own transports (gloo, nccl).

verl (`verl/checkpoint_engine/base.py`) drives a backend in four steps per weight sync,
every trainer rank and every rollout worker together: `prepare` (each worker's metadata),
the class's `build_topology` (ranks and the master's metadata for everyone),
`init_process_group`, then `send_weights` on the trainer side while each rollout worker
consumes `receive_weights`, and `finalize`. Here the trainer's rank 0 owns an
enginehooks `Sender` (its rendezvous store and group, reused across syncs), every
rollout worker a `Receiver` of that group, and the other trainer ranks sit the
broadcast out (they still walk their weight generator: producing a weight is
collective over the trainer's ranks).

verl hands the sender a generator, whose names and shapes are known only as it yields;
an enginehooks update is planned before a byte moves (a `Manifest`). So the stream is
cut into segments of about one bucket: each segment is planned (`core.manifest.plan`),
its manifest broadcast over the group (signed with the shared secret when one is set,
`core/auth.py`), then its tensors sent by the transport's own sender, in buckets
with trailers and digests (and keyed MACs with a secret) that every receiver checks
before a tensor is handed to verl's server adapter. A digest, signature or transport
failure raises out of `receive_weights` and `send_weights` (verl's sync then fails) and
leaves the group; the next sync forms a new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch

from enginehooks.core.auth import Verifier, load_secret
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ManifestError, TransportError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.plugins import get_transport
from enginehooks.transports.base import Abort
from enginehooks.transports.broadcast import BroadcastReceiver, BroadcastSender, bcast
from enginehooks.wire.segments import MAX_HEADER_BYTES, read_segment, segment_header

log = logging.getLogger("enginehooks.verl")

#: The backend's name in verl's registry (`checkpoint_engine.backend`).
BACKEND = "enginehooks"


def _default_transport() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _local_ip() -> str:
    """This host's address other hosts reach (Ray's view of it), else loopback."""
    try:
        import ray

        return str(ray.util.get_node_ip_address()).strip("[]")
    except Exception:  # no Ray here: one host
        return "127.0.0.1"


def _verl() -> tuple[Any, Any]:
    """verl's `CheckpointEngine` base and its registry; without verl, `object` and None:
    the module still imports (the package's import test), the backend is not registered."""
    try:
        from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    except ImportError:
        return object, None
    return CheckpointEngine, CheckpointEngineRegistry


_Base, _Registry = _verl()


class EngineHooksCheckpointEngine(_Base):  # type: ignore[misc,valid-type]
    """verl's checkpoint engine "enginehooks".

    Args (verl passes `bucket_size`, `is_master` on trainer ranks, and
    `checkpoint_engine.engine_kwargs.enginehooks`):
        bucket_size: bytes per bucket (verl's `update_weights_bucket_megabytes`).
        is_master: this process is trainer rank 0, the one that sends.
        transport: "gloo" (CPU) or "nccl" (GPU); default by whether CUDA is there.
        host: the address the rendezvous store listens on and receivers connect to;
            default this node's address as Ray sees it.
        timeout_s: bounds every wait of a sync (docs/transports.md).
        checksum: bucket digest name; default the transport's.
        rebuild_group: form a new group for every sync (verl's nccl option of that name).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, transport: str | None = None,
                 host: str | None = None, timeout_s: float = 300.0,
                 checksum: str | None = "auto", rebuild_group: bool = False) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.transport = get_transport(transport or _default_transport())
        if self.transport.name not in ("gloo", "nccl"):
            raise TransportError(f"enginehooks' verl backend runs over gloo or nccl, not "
                                 f"{self.transport.name!r}")
        self.host = host
        self.timeout_s = float(timeout_s)
        self.checksum = self.transport.default_checksum if checksum == "auto" else checksum
        self.rebuild_group = rebuild_group
        self.secret = load_secret()
        self.rank: int | None = None
        self.world_size: int | None = None
        self._sender: BroadcastSender | None = None
        self._receiver: BroadcastReceiver | None = None
        self._group: str | None = None
        self._verifier = Verifier(self.secret) if self.secret else None

    # -- verl's contract: topology ---------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Trainer rank 0 opens its sender (kept across syncs until it breaks) and
        answers its endpoint; everyone else has nothing to say."""
        if not self.is_master:
            return {}
        if self._sender is None or self._sender.broken:
            self._close()
            sender = self.transport.sender(
                host=self.host or _local_ip(), timeout_s=self.timeout_s, secret=self.secret,
                device=self._device())
            assert isinstance(sender, BroadcastSender)  # gloo and nccl (checked above)
            self._sender = sender
        return {"endpoint": self._sender.endpoint()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Trainer rank 0 is the group's rank 0, rollout worker i its rank i + 1; the
        other trainer ranks get -1 (not in the group)."""
        endpoint = (metadata[0] or {}).get("endpoint")
        if endpoint is None:
            raise TransportError("enginehooks: trainer rank 0 did not open a sender (it "
                                 "must be built with is_master=True)")
        world = 1 + rollout_world_size
        endpoint = {**endpoint, "world_size": world}
        actor: dict[str, list[Any]] = {"rank": [0] + [-1] * (actor_wg_world_size - 1),
                 "world_size": [world] * actor_wg_world_size,
                 "endpoint": [endpoint] * actor_wg_world_size}
        rollout: dict[str, list[Any]] = {
            "rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
            "endpoint": [endpoint] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, endpoint: dict[str, Any]) -> None:
        """Form the group, or keep the one formed by an earlier sync."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        if rank == 0:
            sender = self._sender
            if sender is None:
                raise TransportError("enginehooks: init_process_group before prepare")
            if sender.world_size == 0 or sender.broken:
                sender.connect(world_size)
            elif sender.world_size != world_size:
                raise TransportError(
                    f"enginehooks: the group has {sender.world_size} members, this sync "
                    f"{world_size}: set engine_kwargs rebuild_group=True for elastic rollouts")
            return
        receiver = self._receiver
        if receiver is None or receiver.broken or self._group != endpoint.get("group"):
            self._close()
            fresh = self.transport.receiver(dict(endpoint), rank, self._device())
            assert isinstance(fresh, BroadcastReceiver)  # one sender's group
            fresh.connect()
            self._receiver, self._group = fresh, str(endpoint.get("group"))

    def finalize(self) -> None:
        """Keep the group for the next sync unless `rebuild_group`."""
        if self.rebuild_group:
            self._close()

    # -- verl's contract: the data ----------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Send `weights` ((name, tensor) pairs, sync or async) in signed, digested
        segments. Trainer ranks outside the group only walk the generator."""
        if self.rank is None or self.rank > 0:
            raise TransportError("enginehooks: send_weights on a rollout worker, or before "
                                 "init_process_group")
        if self.rank < 0:
            async for _ in _aiter(weights):
                pass
            return {}
        sender = self._sender
        assert sender is not None
        version: int | str = global_steps if global_steps is not None else "verl"
        pending: list[tuple[str, torch.Tensor]] = []
        size = segments = total = 0
        async for name, tensor in _aiter(weights):
            nbytes = tensor.numel() * tensor.element_size()
            if pending and size + nbytes > self.bucket_size:
                await asyncio.to_thread(self._send_segment, sender, pending, version,
                                        segments, False)
                segments, total, pending, size = segments + 1, total + size, [], 0
            pending.append((name, tensor.detach()))
            size += nbytes
        await asyncio.to_thread(self._send_segment, sender, pending, version, segments, True)
        return {"enginehooks/segments": segments + 1, "enginehooks/bytes": total + size}

    def _send_segment(self, sender: BroadcastSender, items: list[tuple[str, torch.Tensor]],
                      version: int | str, index: int, last: bool) -> None:
        """Plan one segment, broadcast its (signed) manifest, send its buckets."""
        specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in items]
        manifest = plan(specs, weight_version=version, bucket_bytes=self.bucket_size,
                        checksum=self.checksum, split=self.transport.split,
                        direct_min=self.transport.direct_min,
                        meta={"verl": {"segment": index, "last": last}})
        header = segment_header(self.secret, manifest.to_json())
        pg = sender.pg
        device = self._device()
        try:
            size = torch.tensor([len(header)], dtype=torch.int64, device=device)
            bcast(pg, size, self.timeout_s).wait()
            body = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
            bcast(pg, body, self.timeout_s).wait()
        except Exception:
            sender.close()
            raise
        sender.send(manifest, iter(items), Abort())

    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield the trainer's tensors as their buckets arrive, each checked (trailer,
        digest, MAC with a secret) first. A tensor is a view valid until the next is
        asked for, as with verl's own backends."""
        receiver = self._receiver
        if receiver is None or receiver.broken:
            raise TransportError("enginehooks: receive_weights before init_process_group")
        while True:
            manifest = self._receive_manifest(receiver)
            for name, tensor in receiver.stream(manifest):
                yield name, tensor
            if manifest.meta.get("verl", {}).get("last"):
                return

    def _receive_manifest(self, receiver: BroadcastReceiver) -> Manifest:
        """The next segment's manifest, its token checked before anything is planned
        from it; a refusal leaves the group (the sender then fails too)."""
        pg = receiver.pg
        device = self._device()
        try:
            size = torch.zeros(1, dtype=torch.int64, device=device)
            bcast(pg, size, self.timeout_s).wait()
            n = int(size.item())
            if not 0 < n <= MAX_HEADER_BYTES:
                raise ManifestError(f"a segment header of {n} bytes (cap {MAX_HEADER_BYTES})")
            body = torch.empty(n, dtype=torch.uint8, device=device)
            bcast(pg, body, self.timeout_s).wait()
            return Manifest.from_json(read_segment(bytes(body.cpu().numpy()), self._verifier))
        except Exception:  # a refused or unreadable header, or a lost peer
            receiver.close()
            raise

    # -- helpers ------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.transport.name == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _close(self) -> None:
        for half in (self._sender, self._receiver):
            if half is not None:
                half.close()
        self._sender = self._receiver = None
        self._group = None


if _Registry is not None:
    _Registry.register(BACKEND)(EngineHooksCheckpointEngine)


async def _aiter(weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[Any]
                 ) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """verl's weights arrive as a sync or an async iterable."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
        return
    it: Iterator[tuple[str, torch.Tensor]] = iter(weights)
    for item in it:
        yield item

"""Process groups of our own, built from a TCPStore rendezvous.

The trainer usually owns torch.distributed's default group already; a weight-sync
group must never touch it. So groups here are constructed directly from a store
(`ProcessGroupGloo(store, rank, size, options)`, likewise NCCL) and live only as long
as the transport that made them. Every step has a timeout: a missing peer becomes an
error naming the rendezvous, never a hang.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from enginehooks.core.errors import TransportError


def _td(seconds: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=seconds)


def master_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The sender's store. `port=0` picks a free port; read it back from `.port`."""
    try:
        return dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_td(timeout_s),
            use_libuv=True,
        )
    except Exception as e:
        raise TransportError(f"cannot open the rendezvous store on {host}:{port}: {e}") from e


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=_td(timeout_s))
    except Exception as e:
        raise TransportError(
            f"cannot reach the rendezvous store at {host}:{port} within {timeout_s}s: {e}"
        ) from e


def new_group(
    backend: str,
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    host: str = "127.0.0.1",
) -> dist.ProcessGroup:
    """A `Backend` object for `backend` ("gloo" or "nccl") over `store` under `prefix`.

    Blocks until every rank has joined, or raises after `timeout_s`.
    """
    pstore = dist.PrefixStore(prefix, store)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            return dist.ProcessGroupGloo(pstore, rank, world_size, opts)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(timeout_s)
            return dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
    except Exception as e:
        raise TransportError(
            f"{backend} group {prefix!r} (rank {rank} of {world_size}) did not form within "
            f"{timeout_s}s: {e}"
        ) from e
    raise TransportError(f"unknown process-group backend {backend!r}")


@dataclass(frozen=True)
class GroupEndpoint:
    """What a receiver reads from a group sender's endpoint (JSON from the coordinator)."""

    transport: str
    host: str
    port: int
    group: str
    timeout_s: float
    world_size: int

    @property
    def prefix(self) -> str:
        return f"enginehooks/{self.group}/"

    @classmethod
    def parse(cls, endpoint: dict[str, Any], rank: int) -> GroupEndpoint:
        """Validate `endpoint` for receiver `rank`; errors say which field is wrong."""
        try:
            ep = cls(
                transport=str(endpoint["transport"]), host=str(endpoint["host"]),
                port=int(endpoint["port"]), group=str(endpoint["group"]),
                timeout_s=float(endpoint["timeout_s"]), world_size=int(endpoint["world_size"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TransportError(f"bad group endpoint {endpoint!r}: {e!r}") from None
        if not 1 <= rank < ep.world_size:
            raise TransportError(f"rank {rank} is outside 1..{ep.world_size - 1}")
        return ep

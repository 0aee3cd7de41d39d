"""The built-in transports, registered as a plugin like any third-party transport."""

from __future__ import annotations

from collections.abc import Callable

from enginehooks.markers import hookimpl
from enginehooks.transports.base import Transport
from enginehooks.transports.collectives import GlooTransport, NcclTransport
from enginehooks.transports.cuda_ipc import CudaIpcTransport
from enginehooks.transports.disk import DiskTransport
from enginehooks.transports.shard_direct import ShardNcclTransport, ShardTransport
from enginehooks.transports.shm import ShmTransport


@hookimpl
def register_transports(register: Callable[[type[Transport]], None]) -> None:
    for cls in (GlooTransport, NcclTransport, CudaIpcTransport, ShmTransport, DiskTransport,
                ShardTransport, ShardNcclTransport):
        register(cls)

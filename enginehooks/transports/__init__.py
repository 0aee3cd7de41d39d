"""Built-in transports, registered as a plugin like any third-party transport."""

from __future__ import annotations

from collections.abc import Callable

from enginehooks.plugins import hookimpl
from enginehooks.transports.base import Receiver, Sender, Transport
from enginehooks.transports.broadcast import GlooTransport, NcclTransport
from enginehooks.transports.cuda_ipc import CudaIpcTransport
from enginehooks.transports.disk import DiskTransport
from enginehooks.transports.shm import ShmTransport

__all__ = [
    "CudaIpcTransport",
    "DiskTransport",
    "GlooTransport",
    "NcclTransport",
    "Receiver",
    "Sender",
    "ShmTransport",
    "Transport",
]


@hookimpl
def register_transports(register: Callable[[type], None]) -> None:
    for cls in (GlooTransport, NcclTransport, CudaIpcTransport, ShmTransport, DiskTransport):
        register(cls)

"""Built-in transports, registered as a plugin like any third-party transport."""

from __future__ import annotations

from collections.abc import Callable

from enginehooks.plugins import hookimpl
from enginehooks.transports.base import Receiver, Sender, Transport
from enginehooks.transports.broadcast import GlooTransport, NcclTransport
from enginehooks.transports.disk import DiskTransport

__all__ = ["DiskTransport", "GlooTransport", "NcclTransport", "Receiver", "Sender", "Transport"]


@hookimpl
def register_transports(register: Callable[[type], None]) -> None:
    for cls in (GlooTransport, NcclTransport, DiskTransport):
        register(cls)

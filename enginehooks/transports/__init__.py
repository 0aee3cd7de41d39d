"""Transports: the data plane. One file per transport; `base.py` declares the contract
(`Transport`, `Sender`, `Receiver`, `Target`), `plugin.py` registers the built-ins."""

from __future__ import annotations

from enginehooks.transports.base import (
    GroupRequest,
    GroupResult,
    GroupUpdate,
    JoinReceiver,
    JoinSender,
    LeaveReceiver,
    LeaveSender,
    Receiver,
    Sender,
    Target,
    Transport,
)
from enginehooks.transports.collectives import GlooTransport, NcclTransport
from enginehooks.transports.cuda_ipc import CudaIpcTransport
from enginehooks.transports.disk import DiskTransport
from enginehooks.transports.shm import ShmTransport

__all__ = [
    "CudaIpcTransport",
    "DiskTransport",
    "GlooTransport",
    "GroupRequest",
    "GroupResult",
    "GroupUpdate",
    "JoinReceiver",
    "JoinSender",
    "LeaveReceiver",
    "LeaveSender",
    "NcclTransport",
    "Receiver",
    "Sender",
    "ShmTransport",
    "Target",
    "Transport",
]

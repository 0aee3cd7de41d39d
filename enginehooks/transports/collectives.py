"""The gloo and NCCL transports: which sender and receiver each side of a push gets.

One trainer rank sends (`broadcast.py`: one broadcast group per update), or several
trainer ranks each send their part (`multisender.py`: one group per sender rank). This
module is the only one that knows both, so neither imports the other.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from enginehooks.transports.base import Receiver, Sender, Transport
from enginehooks.transports.broadcast import BroadcastReceiver, BroadcastSender
from enginehooks.transports.multisender import MultiReceiver, SenderSet


class GlooTransport(Transport):
    """Broadcast over gloo: CPU tensors, TCP between processes and hosts."""

    name = "gloo"
    #: tensors of at least this many bytes travel in direct buckets (`core/manifest.py`):
    #: above it, a broadcast of its own costs less than the packing copy it saves
    direct_min: ClassVar[int | None] = 1 << 20

    def sender(self, **options: Any) -> Sender:
        if options.get("trainer_ranks") is not None:  # several trainer ranks send (issue 23)
            return SenderSet("gloo", **options)
        options.pop("trainer_ranks", None)
        return BroadcastSender("gloo", **options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        if "senders" in endpoint:  # one group per sender rank (transports/multisender.py)
            return MultiReceiver(endpoint, rank, torch.device("cpu"))
        return BroadcastReceiver(endpoint, rank, torch.device("cpu"))


class NcclTransport(Transport):
    """Broadcast over NCCL: GPU buffers, NVLink / InfiniBand between GPUs and nodes."""

    name = "nccl"
    default_checksum = "sum64"

    def sender(self, **options: Any) -> Sender:
        if options.get("trainer_ranks") is not None:  # several trainer ranks send (issue 23)
            return SenderSet("nccl", **options)
        options.pop("trainer_ranks", None)
        return BroadcastSender("nccl", **options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        if "senders" in endpoint:  # one group per sender rank (multisender.py)
            return MultiReceiver(endpoint, rank, device)
        return BroadcastReceiver(endpoint, rank, device)

"""The gloo and NCCL transports: which sender and receiver each side of a push gets.

Every sending trainer rank has one `BroadcastSender` (`broadcast.py`): one trainer rank
sends, or several each send their part over a group of their own, driven by trainer
rank 0's `WeightSync` (`control/senders.py`). An engine worker receives one sender's
group with a `BroadcastReceiver`, or every sender's group with a `MultiReceiver`
(`multisender.py`), chosen by its endpoint. This module is the only one that knows both
receivers, so neither imports the other.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from enginehooks.transports.base import Receiver, Sender, Transport
from enginehooks.transports.broadcast import BroadcastReceiver, BroadcastSender
from enginehooks.transports.multisender import MultiReceiver


class GlooTransport(Transport):
    """Broadcast over gloo: CPU tensors, TCP between processes and hosts."""

    name = "gloo"
    several_senders: ClassVar[bool] = True
    #: tensors of at least this many bytes travel in direct buckets (`core/manifest.py`):
    #: above it, a broadcast of its own costs less than the packing copy it saves
    direct_min: ClassVar[int | None] = 1 << 20

    def sender(self, **options: Any) -> Sender:
        return BroadcastSender("gloo", **options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        if "senders" in endpoint:  # one group per sender rank (transports/multisender.py)
            return MultiReceiver(endpoint, rank, torch.device("cpu"))
        return BroadcastReceiver(endpoint, rank, torch.device("cpu"))


class NcclTransport(Transport):
    """Broadcast over NCCL: GPU buffers, NVLink / InfiniBand between GPUs and nodes."""

    name = "nccl"
    several_senders: ClassVar[bool] = True
    default_checksum = "sum64"
    #: a tensor that fills a bucket travels in direct buckets: broadcast from its own
    #: storage and received into its destination (no pack copy, no unpack copy); smaller
    #: ones are packed, where one launch per bucket beats a collective per tensor
    direct_min: ClassVar[int | None] = 1 << 62
    #: measured on H100/H200 (docs/transports.md): larger buckets amortise the per-bucket
    #: latency of a collective; memory is `SENDER_SLOTS` buffers on the trainer, two on
    #: each engine worker
    default_bucket_bytes: ClassVar[int] = 1 << 30

    def sender(self, **options: Any) -> Sender:
        return BroadcastSender("nccl", **options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        if "senders" in endpoint:  # one group per sender rank (multisender.py)
            return MultiReceiver(endpoint, rank, device)
        return BroadcastReceiver(endpoint, rank, device)

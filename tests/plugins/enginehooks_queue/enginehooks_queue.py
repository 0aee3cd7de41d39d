"""A third-party transport shipped as its own package: buckets through an in-process
queue. Exists to prove that a plugin on the `enginehooks` entry point adds a transport
usable by name, with nothing in enginehooks changed."""

from __future__ import annotations

import queue
from typing import Any

import torch

from enginehooks import hookimpl
from enginehooks.core.buckets import Unpacker, message_bytes, pack
from enginehooks.transports.base import Receiver, Sender, SendStats, Transport

_QUEUES: dict[str, queue.Queue] = {}


class QueueSender(Sender):
    def __init__(self, timeout_s: float = 10.0, **_: Any) -> None:
        self.key, self.timeout_s = f"q{id(self)}", timeout_s
        _QUEUES[self.key] = queue.Queue(maxsize=2)  # two buckets in flight, like the others

    def endpoint(self) -> dict[str, Any]:
        return {"transport": "queue", "key": self.key}

    def connect(self, world_size: int) -> None:
        pass

    def send(self, manifest, stream, abort) -> SendStats:
        stats = SendStats()
        for index, buf in pack(manifest, stream, lambda i: torch.empty(
                message_bytes(manifest.buckets[i].nbytes), dtype=torch.uint8)):
            _QUEUES[self.key].put((index, buf), timeout=self.timeout_s)
            stats.buckets += 1
            stats.bytes += manifest.buckets[index].nbytes
        return stats


class QueueReceiver(Receiver):
    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        self.q = _QUEUES[endpoint["key"]]

    def connect(self) -> None:
        pass

    def deliver(self, manifest, target) -> dict[str, Any]:
        un = Unpacker(manifest)

        def tensors():
            for _ in manifest.buckets:
                index, buf = self.q.get(timeout=10)
                yield from un.unpack(index, buf)

        target.apply(tensors())
        return {"bytes": manifest.total_bytes}


class QueueTransport(Transport):
    name = "queue"

    def sender(self, **options: Any) -> Sender:
        return QueueSender(**options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return QueueReceiver(endpoint, rank, device)


@hookimpl
def register_transports(register) -> None:
    register(QueueTransport)

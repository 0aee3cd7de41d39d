"""`cuda_ipc`: the colocated transport for a trainer and an engine on the same GPU.

The protocol is `colocated.py`'s; this module only allocates the two bucket buffers on
the sender's GPU and shares them by CUDA IPC handle, once per buffer generation. The
handle fields that `torch.multiprocessing` would pickle (`UntypedStorage._share_cuda_()`)
are written out explicitly as JSON, bytes in base64, and rebuilt on the receiver with
`UntypedStorage._new_shared_cuda` (never pickle: the descriptor crosses the store).
The receiver maps each buffer once and caches the mapping until the generation
changes (a larger manifest) or it closes.

Memory: the sender allocates exactly two slots; the receiver maps them (no new device
memory) and, through torch's IPC reference counter, keeps the sender's blocks from
being reused while mapped. Both sides call `torch.cuda.ipc_collect()` when they drop
buffers, which is how the producer reclaims blocks whose consumers have let go.

Same GPU only: the descriptor carries the GPU's UUID, and a receiver on another GPU
gets a clear error (use `nccl` there). A receiver in the sender's own process (CUDA
refuses to open one's own IPC handle) uses the sender's tensors directly.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import torch

from enginehooks.core.errors import TransportError
from enginehooks.transports.base import Receiver, Sender, Transport
from enginehooks.transports.colocated import ColocatedReceiver, ColocatedSender

# Buffers of senders in this process, for receivers in the same process.
_LOCAL: dict[tuple[str, int], list[torch.Tensor]] = {}


def _b64(v: bytes | None) -> str | None:
    return None if v is None else base64.b64encode(v).decode("ascii")


def _unb64(v: str | None) -> bytes | None:
    return None if v is None else base64.b64decode(v.encode("ascii"), validate=True)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def describe(buf: torch.Tensor) -> dict[str, Any]:
    """The IPC handle of `buf`'s storage, field by field, as JSON-able values."""
    (
        _device,
        handle,
        storage_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = buf.untyped_storage()._share_cuda_()
    return {
        "handle": _b64(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle) if event_handle is not None else None,
        "event_sync_required": bool(event_sync_required),
        "tensor_offset": int(buf.storage_offset()),
        "numel": int(buf.numel()),
    }


def rebuild(desc: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Open the handle described by `describe` on `device`: a uint8 tensor."""
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            _unb64(desc["handle"]),
            int(desc["storage_bytes"]),
            int(desc["storage_offset_bytes"]),
            _unb64(desc["ref_counter_handle"]),
            int(desc["ref_counter_offset"]),
            _unb64(desc["event_handle"]),
            bool(desc["event_sync_required"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TransportError(f"bad cuda_ipc buffer descriptor: {e}") from None
    except RuntimeError as e:
        raise TransportError(f"cannot open the sender's CUDA IPC handle on {device}: {e}") from e
    t = torch.empty(0, dtype=torch.uint8, device=device)
    t.set_(storage, int(desc["tensor_offset"]), (int(desc["numel"]),), (1,))
    return t


def _cuda_device(device: torch.device | str | None) -> torch.device:
    d = torch.device(device or "cuda")
    if d.type != "cuda":
        raise TransportError(f"cuda_ipc needs a CUDA device, got {d}")
    if d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class CudaIpcSender(ColocatedSender):
    transport_name = "cuda_ipc"

    def _default_device(self, device: torch.device | str | None) -> torch.device:
        return _cuda_device(device)

    def _allocate(self, nbytes: int, gen: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        _LOCAL[(self.group_id, gen)] = bufs
        return bufs, {
            "pid": os.getpid(),
            "group": self.group_id,
            "gen": gen,
            "gpu_uuid": gpu_uuid(self.device),
            "buffers": [describe(b) for b in bufs],
        }

    def _release(self) -> None:
        if self.bufs:
            _LOCAL.pop((self.group_id, self.gen), None)
            self.bufs = []
            torch.cuda.ipc_collect()


class CudaIpcReceiver(ColocatedReceiver):
    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        super().__init__(endpoint, rank, _cuda_device(device))

    def connect(self) -> None:
        torch.cuda.set_device(self.device)
        super().connect()

    def _map(self, desc: dict[str, Any]) -> list[torch.Tensor]:
        mine = gpu_uuid(self.device)
        if desc.get("gpu_uuid") != mine:
            raise TransportError(
                f"cuda_ipc: the sender's buffers are on GPU {desc.get('gpu_uuid')}, this worker "
                f"runs on {mine} ({self.device}); cuda_ipc is for one GPU shared by trainer and "
                f"engine, use nccl between GPUs"
            )
        if desc.get("pid") == os.getpid():
            local = _LOCAL.get((str(desc.get("group")), int(desc.get("gen", -1))))
            if local is None:
                raise TransportError("cuda_ipc: same-process sender buffers are gone")
            return list(local)
        with torch.cuda.device(self.device):
            return [rebuild(d, self.device) for d in desc["buffers"]]

    def _unmap(self) -> None:
        if self.bufs:
            self.bufs = []
            torch.cuda.ipc_collect()


class CudaIpcTransport(Transport):
    """Colocated transport on one GPU: two IPC-shared device buffers, acks via the store."""

    name = "cuda_ipc"
    default_checksum = "sum64"

    def sender(self, **options: Any) -> Sender:
        return CudaIpcSender(**options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return CudaIpcReceiver(endpoint, rank, device)

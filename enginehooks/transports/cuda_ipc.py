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

**Single copy** (the default where it applies: Triton on the GPU, `checksum` `sum64` or
none, no expandable segments): the sender packs nothing. It hands over the trainer's own
tensors by naming, for every piece, the CUDA allocation that holds it and the offset
inside it; each allocation's IPC handle is taken once and announced once, and each
receiver opens it once and caches the mapping (cuIpcOpenMemHandle through the driver).
A push is **one doorbell**: one signed `ready/0` message listing every piece of the
update once the trainer's stream is exhausted, answered by one signed `ack/0` once the
receiver's copies are done; the receiver resolves its destinations while it waits for
the doorbell, so that loop overlaps the trainer's stream (option `window_bytes` cuts the update into several
doorbells, `ready/<w>` / `ack/<w>`, at most two outstanding, to bound how many of the
stream's temporaries the sender holds). The receiver copies every piece with one launch
of the fused copy+digest kernel (`core/fused_copy.py`) straight into the target's
`destination(name)`, computing each bucket's digest in the same pass; for a target
without one it yields views of the trainer's memory, which the target's own load path
copies (still one copy), and the digest is a read of those views. The sender's digest of
each (virtual, zero-padded) bucket is a read of its sources on a side stream, launched
right after the doorbell, so it runs beside the engine's copy rather than before it; it
travels as soon as those reads are done (`ready/<last>`), so it is waiting when the
receiver's copy ends; the receiver compares it with its own after its copy and answers
one final ack (in `deliver`, on a thread, while the target's apply finishes: its
post-load steps and verification overlap that round trip): a corrupted or torn bucket
ends the update with `ChecksumError` naming it, after its bytes landed (the engine is
then `torn`, never `current`, as after any failure mid-update). Memory: the sender
holds references to the stream's tensors until their doorbell is acked (nothing for
parameters themselves; gathered temporaries stay alive until then, which
`window_bytes` bounds); the receiver allocates nothing but its tables. Mappings are
dropped when the trainer's allocator has freed a segment since the last push (its
`segment.all.freed` counter), so a reused address never reads through a stale mapping;
a freed segment stays mapped until then. Option `single_copy=False`
(`WeightSync(transport_options=...)`) keeps the two-buffer path.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import functools
import itertools
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch

from enginehooks.core.buckets import Unpacker, check_tensor, manifest_id
from enginehooks.core.dtypes import torch_dtype
from enginehooks.core.errors import ChecksumError, ManifestError, TransportError
from enginehooks.core.manifest import Manifest, TensorEntry
from enginehooks.transports.base import (
    Abort,
    Receiver,
    Sender,
    SendStats,
    Stream,
    Target,
    Transport,
    WireLanding,
)
from enginehooks.transports.colocated import (
    EVERY_RECEIVER,
    OK,
    TO_ENGINE,
    TO_TRAINER,
    ColocatedReceiver,
    ColocatedSender,
)

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


# -- the CUDA driver calls single copy needs (ctypes: no extra dependency) -----------------
class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Driver:
    """cuMemGetAddressRange / cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle
    on the primary context of the device torch uses."""

    _lock = threading.Lock()
    _one: _Driver | None = None

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, p64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
        self.range = lib.cuMemGetAddressRange_v2
        self.range.argtypes = [p64, ctypes.POINTER(ctypes.c_size_t), u64]
        self.get = lib.cuIpcGetMemHandle
        self.get.argtypes = [ctypes.POINTER(_Handle), u64]
        self.open_ = lib.cuIpcOpenMemHandle_v2
        self.open_.argtypes = [p64, _Handle, ctypes.c_uint]
        self.close_ = lib.cuIpcCloseMemHandle
        self.close_.argtypes = [u64]
        self.ctx_get = lib.cuCtxGetCurrent
        self.ctx_get.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.ctx_set = lib.cuCtxSetCurrent
        self.ctx_set.argtypes = [ctypes.c_void_p]
        self.retain = lib.cuDevicePrimaryCtxRetain
        self.retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self.err = lib.cuGetErrorString
        self.err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    @classmethod
    def get_driver(cls) -> _Driver:
        with cls._lock:
            if cls._one is None:
                cls._one = cls()
            return cls._one

    def check(self, rc: int, what: str) -> None:
        if rc:
            msg = ctypes.c_char_p()
            self.err(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown"
            raise TransportError(f"cuda_ipc: {what} failed: CUDA error {rc} ({text})")

    def context(self, device: torch.device) -> None:
        """Make the device's primary context current on this thread (torch's threads
        have it; a coordinator's worker thread may not)."""
        ctx = ctypes.c_void_p()
        self.check(self.ctx_get(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            torch.cuda.init()
            self.check(self.retain(ctypes.byref(ctx), int(device.index or 0)),
                       "cuDevicePrimaryCtxRetain")
            self.check(self.ctx_set(ctx), "cuCtxSetCurrent")

    def allocation(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.range(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
        return int(base.value), int(size.value)

    def handle(self, base: int) -> bytes:
        h = _Handle()
        self.check(self.get(ctypes.byref(h), base),
                   "cuIpcGetMemHandle (allocations of expandable segments cannot be shared "
                   "this way: pass transport_options={'single_copy': False})")
        return bytes(h)  # all 64 bytes (.reserved stops at the first NUL)

    def open(self, handle: bytes) -> int:
        h = _Handle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self.check(self.open_(ctypes.byref(ptr), h, 1), "cuIpcOpenMemHandle")
        return int(ptr.value)

    def close(self, ptr: int) -> None:
        self.close_(ptr)


def _freed_segments(device: torch.device) -> int:
    """How many segments the trainer's caching allocator has returned to CUDA so far.
    Read from the nested statistics (`memory_stats` flattens several hundred entries
    first: half a millisecond, twice a push)."""
    st = torch.cuda.memory.memory_stats_as_nested_dict(device)
    if "num_device_free" in st:
        return int(st["num_device_free"])
    return int(st.get("segment", {}).get("all", {}).get("freed", 0))


def _expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get(
        "PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


class _CudaView:
    """A device buffer at a raw address, for `torch.as_tensor` (zero copy)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3,
            "strides": None,
        }


def _fused() -> Any:
    from enginehooks.core import fused_copy

    return fused_copy




class _TableCache:
    """The device table of each bucket's launch, kept across pushes: in a training loop
    the trainer's and the engine's addresses repeat, so a push whose runs equal the last
    push's (compared as arrays) launches the table already on the device."""

    def __init__(self) -> None:
        self.by_bucket: dict[int, tuple[tuple[np.ndarray, ...], Any]] = {}

    def get(self, k: int, src: np.ndarray, dst: np.ndarray, nb: np.ndarray, w: np.ndarray,
            bucket: np.ndarray, dev: torch.device, stager: Any) -> Any:
        fused = _fused()
        key = (src, dst, nb, w, bucket)
        hit = self.by_bucket.get(k)
        if hit is not None and all(a.shape == b.shape and np.array_equal(a, b)
                                   for a, b in zip(hit[0], key, strict=True)):
            return hit[1]
        batch = fused.build(src, dst, nb, w, bucket, dev)  # its own table, not a ring slot
        self.by_bucket[k] = (tuple(np.array(a) for a in key), batch)
        return batch
_MASK = (1 << 64) - 1


@dataclass
class _Layout:
    """A manifest's pieces as arrays sorted by (bucket, offset), and per tensor its
    first and last bucket: what both halves of single copy index per push."""

    tensors: tuple[TensorEntry, ...]
    dtypes: list[torch.dtype]
    first: list[int]
    last: list[int]
    split: list[bool]
    empties: bool
    p_t: np.ndarray
    p_start: np.ndarray
    p_n: np.ndarray
    p_w: np.ndarray
    p_b: np.ndarray
    lo: list[int]
    hi: list[int]
    starts_in: list[list[int]]
    ends_in: list[list[int]]
    #: per tensor: its name and shape (what the sender checks the stream against)
    names: list[str]
    shapes: list[tuple[int, ...]]
    #: per tensor, the first bucket it or a tensor before it starts in (non-decreasing:
    #: a tensor without pieces takes its predecessor's), for searching window ends
    first_run: np.ndarray


def _total_bytes(manifest: Manifest) -> int:
    """The update's payload bytes (pieces cover every byte once; no per-tensor products)."""
    return int(_layout(manifest).p_n.sum()) if manifest.buckets else manifest.total_bytes


def _layout(manifest: Manifest) -> _Layout:
    memo = getattr(manifest, "__dict__", None)
    cached = memo.get("_enginehooks_layout") if memo is not None else None
    if cached is not None:
        return cast(_Layout, cached)
    ts = manifest.tensors
    n = len(manifest.buckets)
    rows = [(i, p.bucket, p.offset, p.start, p.nbytes) for i, e in enumerate(ts) for p in e.pieces]
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    arr = arr[np.lexsort((arr[:, 2], arr[:, 1]))]
    buckets = np.ascontiguousarray(arr[:, 1])
    first = [e.pieces[0].bucket if e.pieces else -1 for e in ts]
    last = [e.pieces[-1].bucket if e.pieces else -1 for e in ts]
    starts_in: list[list[int]] = [[] for _ in range(n)]
    ends_in: list[list[int]] = [[] for _ in range(n)]
    for i, (f, g) in enumerate(zip(first, last, strict=True)):
        if f >= 0:
            starts_in[f].append(i)
            ends_in[g].append(i)
    ks = np.arange(n)
    dt = {e.dtype: torch_dtype(e.dtype) for e in ts}
    lay = _Layout(
        tensors=ts, dtypes=[dt[e.dtype] for e in ts], first=first, last=last,
        split=[len(e.pieces) > 1 for e in ts], empties=any(not e.pieces for e in ts),
        p_t=np.ascontiguousarray(arr[:, 0]), p_start=np.ascontiguousarray(arr[:, 3]),
        p_n=np.ascontiguousarray(arr[:, 4]), p_w=np.ascontiguousarray(arr[:, 2] // 4),
        p_b=buckets,
        lo=np.searchsorted(buckets, ks, side="left").tolist(),
        hi=np.searchsorted(buckets, ks, side="right").tolist(),
        starts_in=starts_in, ends_in=ends_in, names=[e.name for e in ts],
        shapes=[tuple(e.shape) for e in ts],
        first_run=np.maximum.accumulate(np.maximum(np.asarray(first, dtype=np.int64), 0))
        if ts else np.zeros(0, dtype=np.int64))
    if memo is not None:
        memo["_enginehooks_layout"] = lay  # frozen dataclass: a memo, not a field
    return lay


def doorbell_windows(manifest: Manifest, window_bytes: int | None,
                     window_tensors: int | None) -> list[tuple[int, int]]:
    """Consecutive bucket ranges, one doorbell each: a window closes at the end of the
    bucket that brings it to `window_tensors` tensors (counted where they start), or
    before the bucket that would take it past `window_bytes` (None: no bound of that
    kind). With neither, the whole update: one doorbell.

    Why one doorbell is the default, though cutting by tensor count lets the engine
    resolve and copy one window while the sender walks the next: measured on 1x H200
    (`bench_e2e.py --arch qwen3_moe --window-tensors`, docs/transports.md), windows
    paid while the host work per tensor was high (7863 MoE tensors: 4 windows 57 ms,
    12 windows 61 ms, one doorbell 74 ms) and no longer once it was checked as lists
    (`CudaIpcSender._sources`, `_Dests`): 47.6 ms in 4 windows against 46.4 ms in one,
    and 1968 tensors 16.9 ms in 3 against 14.95 ms in one."""
    n = len(manifest.buckets)
    if window_bytes is None and window_tensors is None:
        return [(0, n)]
    starts = _layout(manifest).starts_in
    out: list[tuple[int, int]] = []
    start = used = count = 0
    for k, b in enumerate(manifest.buckets):
        if k > start and window_bytes is not None and used + b.nbytes > window_bytes:
            out.append((start, k))
            start, used, count = k, 0, 0
        used += b.nbytes
        count += len(starts[k])
        if window_tensors is not None and count >= window_tensors and k + 1 < n:
            out.append((start, k + 1))
            start, used, count = k + 1, 0, 0
    out.append((start, n))
    return out


def _arrived(store: Any, key: str) -> bool:
    """Whether `key` is in the store now (no wait); True where the store cannot say,
    so that the caller goes on to its own wait, which reports the failure."""
    try:
        return bool(store.check([key]))
    except Exception:
        return True


class _Dests:
    """Each tensor's destination in the engine's target, where the bytes can land as
    they are (same dtype and shape, contiguous, 4-byte aligned, on this GPU), resolved
    bucket by bucket in order (a tensor with the bucket it starts in): `dests` (the
    tensors), `dptr` (their addresses), `has` (one was found), `lazy` (cut across
    buckets with none: rejoined in a tensor of its own once its first bucket arrives).

    Thousands of tensors take milliseconds of host time here (a call into the target
    each), so the receiver resolves ahead while it would otherwise wait: for a doorbell,
    and while a window's copy runs on the device (`ahead`), and only what a window
    needs right before its launch (`through`)."""

    #: tensors resolved between two looks at whether to stop (`ahead`): a look costs a
    #: store round trip or an event query
    CHUNK = 256

    def __init__(self, lay: _Layout,
                 into: Callable[[Sequence[str]], list[torch.Tensor | None]] | None,
                 device: torch.device) -> None:
        self.lay, self.into = lay, into
        # `get_device()` of a tensor on this device (-1: the host's, where a test runs this)
        self.devidx = device.index if device.type == "cuda" else -1
        T = len(lay.tensors)
        self.dests: list[torch.Tensor | None] = [None] * T
        self.dptr = np.zeros(T, dtype=np.int64)
        self.has = np.zeros(T, dtype=bool)
        self.lazy = np.zeros(T, dtype=bool)
        self.upto = 0  # buckets whose starting tensors are resolved
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return self.upto >= len(self.lay.starts_in)

    def restart(self) -> None:
        """Resolve again from the first bucket (the target offers destinations now)."""
        self.upto = 0
        self.dests = [None] * len(self.dests)
        self.has[:] = False
        self.lazy[:] = False

    def ahead(self, stop: Callable[[], bool]) -> None:
        """Resolve bucket after bucket until `stop()` (asked every `CHUNK` tensors)."""
        starts = self.lay.starts_in
        while not self.done and not stop():
            k, count = self.upto, 0
            while k < len(starts) and count < self.CHUNK:
                count += len(starts[k])
                k += 1
            self.through(k)

    def through(self, end: int) -> None:
        """Resolve every tensor that starts in a bucket before `end`: the target asked
        for all of them at once (`Target.destinations`), checked as lists; where one
        fails, tensor by tensor."""
        if end <= self.upto:
            return
        c0 = time.perf_counter()
        lay, devidx = self.lay, self.devidx
        idx = [i for k in range(self.upto, end) for i in lay.starts_in[k]]
        self.upto = end
        if self.into is None or not idx:
            self.seconds += time.perf_counter() - c0
            return
        ds = self.into([lay.names[i] for i in idx])
        ptrs = [d.data_ptr() if d is not None else 1 for d in ds]
        if (all(d is not None for d in ds)  # (`None in ds` would compare tensors by value)
                and [d.dtype for d in ds] == [lay.dtypes[i] for i in idx]  # type: ignore[union-attr]
                and [d.shape for d in ds] == [lay.shapes[i] for i in idx]  # type: ignore[union-attr]
                and all(d.is_contiguous() for d in ds)  # type: ignore[union-attr]
                and [d.get_device() for d in ds] == [devidx] * len(ds)  # type: ignore[union-attr]
                and not any(p % 4 for p in ptrs)):
            at = np.asarray(idx, dtype=np.int64)
            self.has[at] = True
            self.dptr[at] = ptrs
            for i, d in zip(idx, ds, strict=True):
                self.dests[i] = d
        else:
            for i, d, p in zip(idx, ds, ptrs, strict=True):
                self._one(i, d, p)
        self.seconds += time.perf_counter() - c0

    def _one(self, i: int, d: torch.Tensor | None, p: int) -> None:
        lay = self.lay
        if (p % 4 == 0 and d is not None and d.dtype is lay.dtypes[i]
                and d.get_device() == self.devidx
                and d.shape == lay.shapes[i] and d.is_contiguous()):
            self.dests[i] = d
            self.has[i] = True
            self.dptr[i] = p
        else:
            self.lazy[i] = lay.split[i]  # rejoined in a tensor of its own; else views


class CudaIpcSender(ColocatedSender):
    transport_name = "cuda_ipc"

    def __init__(self, *, single_copy: bool = True, window_bytes: int | None = None,
                 window_tensors: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.single_copy = bool(single_copy)
        # single copy: a doorbell's window closes (at a bucket's end) once it holds
        # `window_bytes` bytes or `window_tensors` tensors (`doorbell_windows`; None, the
        # default: no bound of that kind, one doorbell per push). Bytes bound how many of
        # the stream's temporaries the sender holds until acked; tensors let the engine
        # copy one window while the sender walks the next (measured: `doorbell_windows`)
        self.window_bytes = None if window_bytes is None else max(1, int(window_bytes))
        self.window_tensors = None if not window_tensors else max(1, int(window_tensors))
        self._bases: list[int] = []  # sorted allocation bases seen
        self._allocs: dict[int, tuple[int, int]] = {}  # base -> (size, id)
        self._announce: list[dict[str, Any]] = []
        self._next_id = 0
        self._epoch = 0
        self._freed = -1
        self._dstream: torch.cuda.Stream | None = None
        self._arr: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._stager: Any = None
        self._tables = _TableCache()

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

    # -- single copy ---------------------------------------------------------------------
    def _single_copy_applies(self, manifest: Manifest) -> bool:
        return (self.single_copy and len(manifest.buckets) > 0
                and manifest.checksum in (None, "sum64") and not _expandable_segments()
                and _fused().available(self.device))

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        if not self._single_copy_applies(manifest):
            return super().send(manifest, stream, abort)
        if self.world_size < 2 or self._watch_store is None:
            raise TransportError("send() before connect(): the group has not formed")
        if self._broken:
            raise TransportError("this group failed an earlier update; rebuild it")
        with torch.cuda.device(self.device):
            return self._send_refs(manifest, stream, abort)

    def _check_epoch(self) -> None:
        freed = _freed_segments(self.device)
        if freed != self._freed:
            # A segment went back to CUDA: a new allocation may reuse its address.
            self._bases, self._allocs, self._announce, self._arr = [], {}, [], None
            self._epoch += 1
            self._freed = freed

    def _locate(self, ptr: int) -> tuple[int, int]:
        """(allocation id, offset) of device address `ptr`, announcing new allocations."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            base = self._bases[i]
            size, aid = self._allocs[base]
            if ptr < base + size:
                return aid, ptr - base
        drv = _Driver.get_driver()
        base, size = drv.allocation(ptr)
        handle = drv.handle(base)
        aid = self._next_id
        self._next_id += 1
        bisect.insort(self._bases, base)
        self._allocs[base] = (size, aid)
        self._announce.append({"id": aid, "handle": _b64(handle), "size": size, "base": base})
        return aid, ptr - base

    def _source(self, t: torch.Tensor) -> torch.Tensor:
        if t.device != self.device:
            t = t.to(self.device)
        if not t.is_contiguous():
            t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
        return t

    def _sources(self, lay: _Layout, got: list[tuple[str, torch.Tensor]], i0: int, i1: int,
                 devidx: int) -> list[torch.Tensor]:
        """The stream's tensors `i0..` of the manifest (`got`: what it yielded), each
        as it is read in place: contiguous, 16-byte aligned, on this GPU (`_source` where
        one is not). Checked a window at a time, as lists (a check per tensor in a loop
        costs the sender a few microseconds each, thousands of times a push); a window
        that fails is checked tensor by tensor, which names the first that differs."""
        k = len(got)
        if i0 + k < i1:
            raise ManifestError(
                f"stream ended before tensor {lay.tensors[i0 + k].name!r} of the manifest")
        ts = [t for _, t in got]
        if ([name for name, _ in got] != lay.names[i0:i0 + k]
                or [t.dtype for t in ts] != lay.dtypes[i0:i0 + k]
                or [t.shape for t in ts] != lay.shapes[i0:i0 + k]):
            for entry, (name, t) in zip(lay.tensors[i0:i0 + k], got, strict=True):
                check_tensor(entry, name, t)
        if (all(map(torch.Tensor.is_contiguous, ts))
                and [t.get_device() for t in ts] == [devidx] * k
                and not any(t.data_ptr() % 16 for t in ts)):
            return ts
        return [t if (t.is_contiguous() and t.get_device() == devidx
                      and not t.data_ptr() % 16) else self._source(t) for t in ts]

    def _locate_many(self, src: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(allocation ids, offsets) of many device addresses at once."""
        for attempt in range(2):
            b_arr, s_arr, i_arr = self._arrays()
            idx = np.searchsorted(b_arr, src, side="right") - 1
            ok = idx >= 0
            safe = np.where(ok, idx, 0)
            if len(b_arr):
                ok &= src + nbytes <= b_arr[safe] + s_arr[safe]
            if ok.all():
                return i_arr[safe], src - b_arr[safe]
            if attempt:
                bad = int(src[~ok][0])
                raise TransportError(f"cuda_ipc: the tensor at {bad:#x} does not lie in one "
                                     f"CUDA allocation")
            for ptr in src[~ok].tolist():
                self._locate(int(ptr))
        raise AssertionError("unreachable")

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._arr is None or len(self._arr[0]) != len(self._bases):
            b = np.asarray(self._bases, dtype=np.int64)
            self._arr = (b, np.asarray([self._allocs[x][0] for x in self._bases], dtype=np.int64),
                         np.asarray([self._allocs[x][1] for x in self._bases], dtype=np.int64))
        return self._arr

    def _windows(self, manifest: Manifest) -> list[tuple[int, int]]:
        return doorbell_windows(manifest, self.window_bytes, self.window_tensors)

    def _send_refs(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        fused = _fused()
        t0 = time.perf_counter()
        self.seq += 1
        seq, n = self.seq, len(manifest.buckets)
        mid = manifest_id(manifest)
        lay = _layout(manifest)
        windows = self._windows(manifest)
        n_win = len(windows)
        _Driver.get_driver().context(self.device)
        self._check_epoch()
        epoch, pid, dev = self._epoch, os.getpid(), self.device
        devidx = dev.index
        checksum = manifest.checksum
        main = torch.cuda.current_stream(dev)
        if self._dstream is None:
            self._dstream = torch.cuda.Stream(dev)
        dstream = self._dstream
        if self._stager is None:
            self._stager = fused.Stager(dev)
        stager = self._stager
        digests = torch.zeros(n, dtype=torch.int64, device=dev) if checksum else None
        finished = threading.Event()
        watcher = self._watch(abort, seq, n + 1, finished)  # up to n + 1 doorbells' acks
        ptrs = np.zeros(len(lay.tensors), dtype=np.int64)
        held: dict[int, list[torch.Tensor]] = {}  # window -> its tensors, until acked
        inflight: deque[int] = deque()
        stats = SendStats()
        published = 0
        ph: dict[str, float] = {"setup": 0.0, "produce": 0.0, "digest_launch": 0.0,
                                "publish": 0.0, "wait_acks": 0.0, "final": 0.0,
                                "teardown": 0.0}
        clock = time.perf_counter
        ph["setup"] = clock() - t0

        def digest_window(w: int, src: np.ndarray, lo: int, hi: int) -> None:
            """The sender's digest of window w's buckets: one launch on a side stream,
            after the doorbell went out, so it runs beside the engine's copy instead of
            delaying it; compared after the engine's ack (`ready/<final>`)."""
            if digests is None or hi == lo:
                return
            c0 = clock()
            dstream.wait_stream(main)
            with torch.cuda.stream(dstream):
                z = np.zeros(hi - lo, dtype=np.int64)
                fused.launch(self._tables.get(w, src, z, lay.p_n[lo:hi], lay.p_w[lo:hi],
                                              lay.p_b[lo:hi], dev, stager), digests, copy=False)
            ph["digest_launch"] += clock() - c0

        def publish(w: int) -> None:
            """One doorbell: every piece of window w's buckets, as (allocation, offset)."""
            nonlocal published
            c0 = clock()
            b0, b1 = windows[w]
            lo, hi = lay.lo[b0], lay.hi[b1 - 1]
            src = ptrs[lay.p_t[lo:hi]] + lay.p_start[lo:hi]
            aid, off = self._locate_many(src, lay.p_n[lo:hi])
            main.synchronize()  # the sources are final
            body = json.dumps({"mid": mid, "epoch": epoch, "pid": pid, "allocs": self._announce,
                               "buckets": [b0, b1], "aid": aid.tolist(), "off": off.tolist()},
                              separators=(",", ":")).encode()
            self.store.set(self._key(f"u{seq}", "ready", w),
                           self.channel.seal("ready", seq, w, EVERY_RECEIVER, TO_ENGINE, body))  # type: ignore[arg-type]
            self._announce = []
            published = w + 1
            ph["publish"] += clock() - c0
            digest_window(w, src, lo, hi)
            c0 = clock()
            inflight.append(w)
            for k in range(b0, b1):
                stats.bytes += manifest.buckets[k].nbytes
            stats.buckets += b1 - b0
            ph["publish"] += clock() - c0
            while len(inflight) >= 2:  # at most two windows held
                retire()

        def retire() -> None:
            w = inflight.popleft()
            c0 = clock()
            self._wait_acks(seq, w, abort)
            ph["wait_acks"] += clock() - c0
            main.wait_stream(dstream)  # the digest reads are ordered before any reuse
            held.pop(w, None)

        # window w needs the stream's tensors [ends[w - 1], ends[w]) (every tensor that
        # starts in its buckets); a tensor is held until the window of its last bucket
        # is acked
        ends = np.searchsorted(lay.first_run, [b1 for _, b1 in windows], side="left")
        ends[-1] = len(lay.tensors)
        win_of = np.zeros(n, dtype=np.int64)
        for w, (b0, b1) in enumerate(windows):
            win_of[b0:b1] = w
        last = np.asarray(lay.last, dtype=np.int64)
        held_by = np.where(last >= 0, win_of[np.maximum(last, 0)], -1)
        try:
            it = iter(stream)
            i0 = 0
            for w in range(n_win):
                i1 = int(ends[w])
                c0 = clock()
                got = list(itertools.islice(it, i1 - i0))
                ph["produce"] += clock() - c0
                ts = self._sources(lay, got, i0, i1, devidx)
                ptrs[i0:i1] = [t.data_ptr() for t in ts]
                keep = held_by[i0:i1]
                if (keep == w).all():
                    held[w] = ts
                else:  # empties hold nothing; a tensor cut across windows, until its last
                    for j in np.nonzero(keep >= 0)[0].tolist():
                        held.setdefault(int(keep[j]), []).append(ts[j])
                del got, ts
                publish(w)
                i0 = i1
            leftover = next(it, None)
            if leftover is not None:
                raise ManifestError(
                    f"stream yielded {leftover[0]!r}, which the manifest does not plan")

            def send_final(final: list[int] | None) -> None:
                nonlocal published
                body = json.dumps({"mid": mid, "digests": final}).encode()
                self.store.set(self._key(f"u{seq}", "ready", n_win),
                               self.channel.seal("ready", seq, n_win, EVERY_RECEIVER, TO_ENGINE, body))  # type: ignore[arg-type]
                published = n_win + 1

            c0 = clock()
            if digests is not None:
                # The sender's digests go out as soon as its own reads are done, while the
                # engine still copies: the receiver finds them waiting when its copy ends
                # (one round trip less than sending them after the copy's ack). The
                # receiver compares only after its copy; the trainer's memory stays as
                # it is until the last ack.
                dstream.synchronize()
                send_final([((v & _MASK) ^ (b.nbytes << 40)) & _MASK
                            for v, b in zip(digests.tolist(), manifest.buckets, strict=True)])
            ph["final"] += clock() - c0
            while inflight:
                retire()
            c0 = clock()
            if _freed_segments(dev) != self._freed:
                self._freed = -1  # drop every mapping next push
                if digests is None:
                    raise TransportError(
                        "cuda_ipc: the trainer's allocator returned GPU memory to CUDA during "
                        "the update, and without a checksum the receivers' reads cannot be "
                        "vouched for; push again (or use checksum='sum64')")
            if digests is None:
                send_final(None)
            self._wait_acks(seq, n_win, abort)
            ph["final"] += clock() - c0
        except BaseException as e:
            self._broken = True
            self._abort_receivers(seq, published, n + 1, f"{type(e).__name__}: {e}")
            raise
        finally:
            c0 = clock()
            finished.set()
            abort.poke()
            watcher.join(timeout=self.timeout_s)
            inflight.clear()
            held.clear()
            ph["teardown"] = clock() - c0
        stats.seconds = time.perf_counter() - t0
        threading.Thread(target=self._forget, args=(seq, n + 1), daemon=True,
                         name="enginehooks-colocated-forget").start()
        total = stats.seconds - sum(ph.values())
        stats.extra = {"mode": "single_copy", "allocations": len(self._allocs),
                       "epoch": epoch, "doorbells": n_win,
                       "phases_ms": {"stream_loop": round(total * 1e3, 2),
                                     **{k: round(v * 1e3, 2) for k, v in ph.items()}}}
        return stats


@dataclass(frozen=True)
class _LandingKept:
    """A window's landing description as the receiver last gave it (`_landing`): the
    layout, the columns it was made from (copies), and what was made of them."""

    lay: _Layout
    cols: tuple[np.ndarray, ...]
    names: dict[str, tuple[int, int]]
    by_bucket: dict[int, list[str]]


class CudaIpcReceiver(ColocatedReceiver):
    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        super().__init__(endpoint, rank, _cuda_device(device))
        self._opened: list[int] = []
        self._epoch = 0
        self._base_by_id = np.zeros(0, dtype=np.int64)  # allocation id -> address here
        self._size_by_id = np.zeros(0, dtype=np.int64)
        self._known = np.zeros(0, dtype=bool)
        self.phases: dict[str, float] = {}
        self._stager: Any = None
        self._tables = _TableCache()
        #: the target while `deliver` runs (its `wire_landed`)
        self._witness: Target | None = None
        #: window -> its last landing description (`_landing`)
        self._landings: dict[int, _LandingKept] = {}
        #: while `deliver` runs: the last exchange goes to `_final_pool` (`_final_job`)
        self._defer_final = False
        self._final_job: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None

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

    def _unmap_refs(self) -> None:
        if self._opened:
            torch.cuda.synchronize(self.device)
            drv = _Driver.get_driver()
            for ptr in self._opened:
                drv.close(ptr)
        self._opened = []
        self._base_by_id = np.zeros(0, dtype=np.int64)
        self._size_by_id = np.zeros(0, dtype=np.int64)
        self._known = np.zeros(0, dtype=bool)

    def close(self) -> None:
        try:
            self._unmap_refs()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
            super().close()

    # -- single copy ---------------------------------------------------------------------
    def stream(
        self, manifest: Manifest, into: Callable[[str], torch.Tensor | None] | None = None
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        n = len(manifest.buckets)
        if self.store is None or self._broken or n == 0:
            return super().stream(manifest, into)
        # Where tensors land is resolved while the first message is awaited: that loop
        # (a call into the target per tensor) overlaps the trainer's stream, and stops
        # once the doorbell is there (the rest is resolved window by window).
        pre = None
        if _fused().available(self.device):
            pre = _Dests(_layout(manifest), self._into_many(into), self.device)
            key = self.channel.key("ready", self.seq + 1, 0, EVERY_RECEIVER)
            pre.ahead(lambda: _arrived(self._store(), key))
        # The sender says which way this update travels in its first ready message.
        try:
            # verified (a message there that does not verify is ignored: `_genuine`)
            body = self._genuine("ready", self.seq + 1, 0, "bucket 0")
        except BaseException as e:
            self.seq += 1
            self._broken = True
            self._fail(self.seq, 0, n + 1, f"error: {type(e).__name__}: {e}")
            raise
        if b'"aid"' not in body:
            return super().stream(manifest, into)
        return self._stream_refs(manifest, into, pre)

    def _ready(self, seq: int, index: int, mid: int) -> dict[str, Any]:
        return self._ready_message(seq, index, mid)

    def _into_many(self, into: Callable[[str], torch.Tensor | None] | None
                   ) -> Callable[[Sequence[str]], list[torch.Tensor | None]] | None:
        """`into` for many names at once: the target's own `destinations` where `into`
        is its `destination` (what `deliver` passes), else a call per name."""
        target = self._witness
        if into is None:
            return None
        if target is not None and into == target.destination:
            return target.destinations
        return lambda names: [into(n) for n in names]

    def _open_allocs(self, msg: dict[str, Any]) -> None:
        epoch = int(msg["epoch"])
        if epoch != self._epoch:
            self._unmap_refs()
            self._epoch = epoch
        same = msg.get("pid") == os.getpid()
        drv = _Driver.get_driver()
        for a in msg.get("allocs", ()):
            aid, size = int(a["id"]), int(a["size"])
            if same:  # CUDA refuses to open one's own handle: the address is valid here
                self._set_alloc(aid, int(a["base"]), size)
                continue
            handle = _unb64(a["handle"])
            if handle is None or len(handle) != 64:
                raise TransportError(f"cuda_ipc: bad allocation handle for id {aid}")
            ptr = drv.open(handle)
            self._opened.append(ptr)
            _base, real = drv.allocation(ptr)
            self._set_alloc(aid, ptr, min(size, real))

    def _set_alloc(self, aid: int, ptr: int, size: int) -> None:
        if aid < 0 or aid > 1 << 24:
            raise TransportError(f"cuda_ipc: allocation id {aid} out of range")
        old = len(self._known)
        if aid >= old:
            grow = max(aid + 1, 2 * old)
            self._base_by_id = np.resize(self._base_by_id, grow)
            self._size_by_id = np.resize(self._size_by_id, grow)
            self._known = np.resize(self._known, grow)
            self._base_by_id[old:], self._size_by_id[old:], self._known[old:] = 0, -1, False
        self._base_by_id[aid], self._size_by_id[aid] = ptr, size
        self._known[aid] = True

    def _stream_refs(
        self, manifest: Manifest, into: Callable[[str], torch.Tensor | None] | None,
        pre: _Dests | None = None,
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        fused = _fused()
        if not fused.available(self.device):
            raise TransportError(
                f"cuda_ipc rank {self.rank}: the trainer hands tensors over by handle (single "
                f"copy), which needs Triton in the engine's environment; install it or set "
                f"transport_options={{'single_copy': False}} on the trainer")
        self.seq += 1
        seq, n = self.seq, len(manifest.buckets)
        mid = manifest_id(manifest)
        lay = _layout(manifest)
        dev = self.device
        if self._stager is None:
            self._stager = fused.Stager(dev)
        stager = self._stager
        # [:n] each bucket's pieces landed in the target's own tensors (`WireLanding`),
        # [n:] the rest of it: the sender's digest is compared with their sum
        digests = torch.zeros(2 * n, dtype=torch.int64, device=dev)
        target = self._witness
        witness = (target.wire_landed if target is not None and target.landing_wanted()
                   else None)
        landed_sums = digests[:n]
        res = pre if pre is not None else _Dests(lay, self._into_many(into), dev)
        if into is not None and res.upto and not res.has.any():
            # a target that offers destinations only while its apply runs (an engine's
            # `ApplyTarget` once its copy plan is verified): asked again, now that it does
            res.restart()
        dests, dptr, has, lazy = res.dests, res.dptr, res.has, res.lazy
        w = 0  # the doorbell (window of buckets) being served; its ack is `ack/<w>`
        ph = self.phases = {"ready": 0.0, "dests": res.seconds, "launch": 0.0, "target": 0.0,
                            "sync": 0.0, "final": 0.0}
        res.seconds = 0.0
        store = self._store()
        clock = time.perf_counter
        _Driver.get_driver().context(dev)
        try:
            with torch.cuda.device(dev):
                b0 = 0  # the first bucket of window w
                while b0 < n:
                    if not res.done:  # resolved while this doorbell is awaited
                        res.ahead(functools.partial(
                            _arrived, store, self.channel.key("ready", seq, w, EVERY_RECEIVER)))
                    c0 = clock()
                    msg = self._ready(seq, w, mid)
                    ph["ready"] += clock() - c0
                    self._open_allocs(msg)
                    try:
                        wb0, b1 = (int(x) for x in msg["buckets"])
                        aid = np.asarray(msg["aid"], dtype=np.int64)
                        off = np.asarray(msg["off"], dtype=np.int64)
                    except (KeyError, TypeError, ValueError):
                        raise TransportError(f"doorbell {w}: malformed ready message") from None
                    if wb0 != b0 or not b0 < b1 <= n:
                        raise TransportError(
                            f"doorbell {w} announces buckets {wb0}..{b1 - 1}; bucket {b0} of "
                            f"{n} is next")
                    lo, hi = lay.lo[b0], lay.hi[b1 - 1]
                    if aid.shape != (hi - lo,) or off.shape != (hi - lo,):
                        raise TransportError(
                            f"doorbell {w}: the sender describes {aid.size} pieces, the "
                            f"manifest plans {hi - lo}")
                    nb = lay.p_n[lo:hi]
                    if aid.size and (aid.min() < 0 or aid.max() >= len(self._known)
                                     or not self._known[aid].all()
                                     or (off < 0).any()
                                     or (off + nb > self._size_by_id[aid]).any()):
                        raise TransportError(
                            f"doorbell {w}: a piece refers to bytes outside the trainer's "
                            f"allocations it announced")
                    src = self._base_by_id[aid] + off
                    res.through(b1)  # every tensor that starts in this window
                    c0 = clock()
                    for k in range(b0, b1):
                        for i in lay.starts_in[k]:  # split tensors without a destination
                            if lazy[i]:
                                e = lay.tensors[i]
                                rj = torch.empty(e.shape, dtype=lay.dtypes[i], device=dev)
                                dests[i], has[i], dptr[i] = rj, True, rj.data_ptr()
                    c1 = clock()
                    ph["dests"] += c1 - c0
                    t_idx = lay.p_t[lo:hi]
                    wd = lay.p_w[lo:hi]
                    bk = lay.p_b[lo:hi]
                    m = has[t_idx]
                    # every piece of the window in one launch, each digest into its bucket
                    if m.any():
                        own = m & ~lazy[t_idx]  # into the target's own tensor
                        at = dptr[t_idx[m]] + lay.p_start[lo:hi][m]
                        slot = np.where(own[m], bk[m], bk[m] + n)
                        fused.launch(self._tables.get(
                            w, src[m], at, nb[m], wd[m], slot, dev, stager), digests, copy=True)
                        if witness is not None and own.any():
                            witness(self._landing(w, landed_sums, lay, t_idx[own],
                                                  dptr[t_idx[own]], at[own[m]], nb[own],
                                                  wd[own], bk[own]))
                    views: dict[int, torch.Tensor] = {}
                    if not m.all():  # no destination: the target copies from views
                        r = ~m
                        if manifest.checksum is not None:
                            z = np.zeros(int(r.sum()), dtype=np.int64)
                            fused.launch(fused.build(src[r], z, nb[r], wd[r], bk[r] + n, dev,
                                                     stager), digests, copy=False)
                        for j in np.nonzero(r)[0].tolist():
                            i = int(t_idx[j])
                            e = lay.tensors[i]
                            v = torch.as_tensor(_CudaView(int(src[j]), int(nb[j])), device=dev)
                            views[i] = v.view(lay.dtypes[i]).view(e.shape)
                    c2 = clock()
                    ph["launch"] += c2 - c1
                    if b0 == 0 and lay.empties:
                        yield from Unpacker(manifest, dev, into, self.secret).empties()
                    for k in range(b0, b1):
                        for i in lay.ends_in[k]:
                            d = dests[i]
                            if d is None:
                                d = views[i]
                            else:
                                dests[i] = None
                            yield lay.tensors[i].name, d
                    del views
                    c3 = clock()
                    ph["target"] += c3 - c2
                    if not res.done:  # the next windows' destinations, while this one copies
                        copied = torch.cuda.Event()
                        copied.record()
                        res.ahead(copied.query)
                        c3 = clock()
                    # the copies out of the trainer's memory are done: ack the doorbell
                    torch.cuda.current_stream(dev).synchronize()
                    self._ack(seq, w)
                    ph["sync"] += clock() - c3
                    w, b0 = w + 1, b1
                ph["dests"] += res.seconds
                # what this receiver read, per bucket (the copies are done: no wait)
                total = ((digests[:n] + digests[n:]).tolist()
                         if manifest.checksum is not None else None)
                final = functools.partial(self._final, seq, w, mid, manifest, lay, total)
                if self._defer_final:
                    # `deliver`: the sender's digests are awaited on a thread while the
                    # target's apply goes on (its post-load steps and verification), and
                    # compared before `deliver` returns
                    self._final_job = self._final_pool().submit(final)
                    return
        except BaseException as e:
            self._broken = True
            self._fail(seq, w, n + 1, f"error: {type(e).__name__}: {e}")
            raise
        final()

    def _final(self, seq: int, w: int, mid: int, manifest: Manifest, lay: _Layout,
               total: list[int] | None) -> None:
        """The last exchange of a single-copy update: the sender's digest of every
        bucket (sent once its reads were done) against `total`, what this receiver read
        as it copied; one final ack. A bucket that differs ends the update with
        `ChecksumError` naming its tensors (its bytes landed: the engine is torn)."""
        n = len(manifest.buckets)
        c0 = time.perf_counter()
        try:
            msg = self._ready(seq, w, mid)
            want = msg.get("digests")
            if total is not None:
                if not isinstance(want, list) or len(want) != n:
                    raise TransportError(f"malformed digests message {msg!r:.200}")
                for k, (v, wv) in enumerate(zip(total, want, strict=True)):
                    mine = ((v & _MASK) ^ (manifest.buckets[k].nbytes << 40)) & _MASK
                    if mine != int(wv):
                        names = [lay.tensors[int(i)].name
                                 for i in lay.p_t[lay.lo[k]:lay.hi[k]][:4]]
                        raise ChecksumError(
                            f"bucket {k}: sum64 {mine:#x} != sender's {int(wv):#x}; tensors "
                            f"{names}... (single copy: the bytes landed before the check)")
            self._ack(seq, w)
        except BaseException as e:
            self._broken = True
            self._fail(seq, w, n + 1, f"error: {type(e).__name__}: {e}")
            raise
        finally:
            self.phases["final"] = time.perf_counter() - c0

    def _final_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="enginehooks-cuda-ipc-final")
        return self._pool

    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        """The update into `target`. A single-copy update's last exchange (the sender's
        digests, the final ack: `_final`) waits on a thread while the target's apply
        goes on after the last tensor (its post-load steps and its verification, which
        re-reads the landed bytes on the device): the wait for the sender's message and
        that work overlap. Nothing is reported before both are done: `deliver` returns
        (and the engine says `current`) only once the digests matched, and a mismatch
        fails the update (torn) whatever the apply did meanwhile."""
        t0 = time.perf_counter()
        self.phases = {}
        self._witness, self._defer_final, self._final_job = target, True, None
        failed: BaseException | None = None
        try:
            it = self.stream(manifest, target.destination)
            target.apply(it)
            # The last ack is sent when the iterator is exhausted: make sure it was.
            leftover = next(it, None)
            if leftover is not None:
                it.close()
                raise TransportError(
                    f"the target stopped before consuming the whole update (next: "
                    f"{leftover[0]!r})")
        except BaseException as e:
            failed = e
        finally:
            self._witness, self._defer_final = None, False
            job, self._final_job = self._final_job, None
        if job is not None:
            try:
                job.result()  # (bounded: `_ready` waits at most the transport's timeout)
            except BaseException as e:
                if failed is None:
                    raise
                raise e from failed  # the transport's check names the cause first
        if failed is not None:
            raise failed
        out: dict[str, Any] = {"bytes": _total_bytes(manifest),
                               "seconds": time.perf_counter() - t0}
        if self.phases:  # single copy: where the receiver's time went
            out["phases_ms"] = {k: round(v * 1e3, 2) for k, v in self.phases.items()}
        return out

    def _landing(self, w: int, sums: torch.Tensor, lay: _Layout, t_idx: np.ndarray,
                 base: np.ndarray, at: np.ndarray, nb: np.ndarray, wd: np.ndarray,
                 bk: np.ndarray) -> WireLanding:
        """Window w's pieces landed in the target's own tensors, for verification (which
        re-reads them after the load with the same weights and buckets). In a training
        loop a window lands the same pieces at the same addresses push after push: the
        last description is given again where every column is the same (no loop over
        the pieces again); only `sums` is this push's."""
        cols = (t_idx, base, at, nb, wd, bk)
        kept = self._landings.get(w)
        if kept is None or kept.lay is not lay or not all(
                a.shape == b.shape and np.array_equal(a, b)
                for a, b in zip(kept.cols, cols, strict=True)):
            names: dict[str, tuple[int, int]] = {}
            by_bucket: dict[int, list[str]] = {}
            for i, p, k, b in zip(t_idx.tolist(), base.tolist(), bk.tolist(), nb.tolist(),
                                  strict=True):
                name = lay.tensors[i].name
                names[name] = (p, names.get(name, (p, 0))[1] + b)
                by_bucket.setdefault(k, []).append(name)
            kept = self._landings[w] = _LandingKept(
                lay, tuple(np.array(a, dtype=np.int64) for a in cols), names, by_bucket)
        _, _, at_k, nb_k, wd_k, bk_k = kept.cols
        return WireLanding(sums, kept.names, kept.by_bucket, at_k, nb_k, wd_k, bk_k)

    def _ack(self, seq: int, index: int) -> None:
        self._store().set(self._key(f"u{seq}", "ack", index, self.rank),
                          self.channel.seal("ack", seq, index, self.rank, TO_TRAINER, OK))  # type: ignore[arg-type]


class CudaIpcTransport(Transport):
    """Colocated transport on one GPU: the trainer's tensors by handle (single copy), or
    two IPC-shared device buffers; acks via the store."""

    name = "cuda_ipc"
    default_checksum = "sum64"
    #: single copy: a bucket is only the digest's unit (a push is one doorbell), and 1 GiB
    #: measured as fast as larger ones; the two-buffer path holds two of them
    default_bucket_bytes: ClassVar[int] = 1 << 30

    def sender(self, **options: Any) -> Sender:
        return CudaIpcSender(**options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return CudaIpcReceiver(endpoint, rank, device)

"""Copy many byte runs and compute their `sum64` digests in the same pass (CUDA, Triton).

A *run* is `nbytes` bytes at device address `src`, copied to device address `dst`, that
sit at byte `4 * word_base` of a bucket whose digest is wanted (the bucket may be
virtual: `cuda_ipc` hands tensors over without packing them, and the digest is then
defined as `sum64` of the bucket those runs would have formed, padding zero). One kernel
launch handles every run of a batch: each program takes a chunk of one run, loads each
32-bit word once, stores it (unless digest-only) and accumulates
`word * (((bucket word index + 1) % 65521) + 1)` modulo 2**64, the same definition as
`core/checksums.py` (`_sum64` without the length term, which callers add). A run whose
length is not a multiple of 4 contributes its last bytes as one zero-padded word, as
the padded bucket would.

This module imports Triton lazily: `available(device)` is False on CPU machines, on
GPUs without Triton, and when the kernel disagrees with the torch definition on its
first use (checked once per process against `checksums.sum64_tensor`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from enginehooks.core.errors import ChecksumError, ConfigError

log = logging.getLogger(__name__)

MOD = 65521
_BLOCK = 8192  # words per tile (32 KiB)
_WARPS = 16
_HINTS = True  # alignment hints where a batch is 16-byte aligned
CHUNK_BYTES = 1 << 18  # bytes of one run that one program handles (a multiple of 4)

_kernel: Any = None
_state = "unknown"  # unknown | ok | off
_state_reason = ""


def _build() -> Any:
    import triton
    import triton.language as tl

    # Triton reads a kernel's annotations (tl.constexpr): the other parameters stay bare.
    @triton.jit
    def _tile(src, dst, offs, r0, lane, acc, COPY: tl.constexpr,  # type: ignore[no-untyped-def]
              MOD: tl.constexpr, mask):
        if mask is None:
            v = tl.load(src + offs)
            if COPY:
                tl.store(dst + offs, v)
        else:
            v = tl.load(src + offs, mask=mask, other=0)
            if COPY:
                tl.store(dst + offs, v, mask=mask)
        # weight ((bucket word + 1) % MOD) + 1 from the tile's first weight: r0 < MOD and
        # lane < BLOCK < MOD, so one conditional subtraction reduces it
        t = r0 + lane
        t = tl.where(t >= MOD, t - MOD, t) + 1
        x = v.to(tl.uint32, bitcast=True).to(tl.uint64)
        return acc + x * t.to(tl.uint64)

    @triton.jit
    def copy_digest_kernel(tab_ptr, part_ptr, COPY: tl.constexpr,  # type: ignore[no-untyped-def]
                           PAD: tl.constexpr,
                           ALIGNED: tl.constexpr, MOD: tl.constexpr, BLOCK: tl.constexpr):
        # One row of the table per program: src, dst, nbytes, first word index in the
        # bucket, bucket (read by the host's reduction, not here).
        pid = tl.program_id(0)
        row = tab_ptr + pid.to(tl.int64) * 5
        src_addr = tl.load(row)
        dst_addr = tl.load(row + 1)
        nbytes = tl.load(row + 2)
        wbase = tl.load(row + 3)
        if ALIGNED:  # every address of the batch is 16-byte aligned: vector loads
            src_addr = tl.multiple_of(src_addr, 16)
            dst_addr = tl.multiple_of(dst_addr, 16)
        src = src_addr.to(tl.pointer_type(tl.int32))
        dst = dst_addr.to(tl.pointer_type(tl.int32))
        nwords = nbytes // 4
        nmain = nwords // BLOCK * BLOCK
        lane = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for start in range(0, nmain, BLOCK):
            r0 = ((wbase + start + 1) % MOD).to(tl.int32)
            acc = _tile(src, dst, start + lane, r0, lane, acc, COPY, MOD, None)
        r0 = ((wbase + nmain + 1) % MOD).to(tl.int32)
        acc = _tile(src, dst, nmain + lane, r0, lane, acc, COPY, MOD, nmain + lane < nwords)
        total = tl.sum(acc, axis=0)
        # The last 1-3 bytes of a run: one zero-padded little-endian word.
        tail = nbytes - nwords * 4
        b = tl.arange(0, 4)
        bm = b < tail
        src8 = src_addr.to(tl.pointer_type(tl.uint8))
        dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
        tb = tl.load(src8 + nwords * 4 + b, mask=bm, other=0)
        if COPY:
            if PAD:  # packing into a bucket: the partial word's padding bytes become zero
                tl.store(dst8 + nwords * 4 + b, tb, mask=(b < 4) & (tail > 0))
            else:
                tl.store(dst8 + nwords * 4 + b, tb, mask=bm)
        tword = tl.sum(tb.to(tl.uint64) << (8 * b).to(tl.uint64), axis=0)
        tw = ((wbase + nwords + 1) % MOD + 1).to(tl.uint64)
        total += tword * tw
        tl.store(part_ptr + pid, total.to(tl.int64, bitcast=True))

    return copy_digest_kernel


@dataclass
class Batch:
    """Runs laid out for one launch: the device table and, per program, its bucket."""

    table: torch.Tensor  # int64 [programs, 5] on the device (contiguous rows)
    bucket_of: torch.Tensor  # int64 [programs] on the device (slot in the digest vector)
    programs: int
    aligned: bool  # every source and destination address is 16-byte aligned


class Stager:
    """Reused pinned host and device memory for the tables of successive launches on one
    stream (a ring of three slots), so a launch costs no host allocation and no sync."""

    SLOTS = 16  # a slot is reused 16 uploads later: its event has long completed

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows = 0
        self.host: list[torch.Tensor] = []
        self.dev: list[torch.Tensor] = []
        self.done: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.slot = 0

    def upload(self, tab: np.ndarray) -> torch.Tensor:
        """Host `tab` [rows, 5] on the device (valid until this slot comes round again)."""
        rows = len(tab)
        if rows > self.rows:
            self.rows = max(rows, 2 * self.rows, 4096)
            self.host = [torch.empty((self.rows, 5), dtype=torch.int64).pin_memory()
                         for _ in range(self.SLOTS)]
            self.dev = [torch.empty((self.rows, 5), dtype=torch.int64, device=self.device)
                        for _ in range(self.SLOTS)]
            self.done = [None] * self.SLOTS
        k = self.slot
        self.slot = (k + 1) % self.SLOTS
        ev = self.done[k]
        if ev is not None:
            ev.synchronize()  # that slot's last upload has left the pinned buffer
        self.host[k][:rows].numpy()[:] = tab
        d = self.dev[k][:rows]
        d.copy_(self.host[k][:rows], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.done[k] = ev
        return d


_STAGERS: dict[tuple[torch.device, int], Stager] = {}


def stager_for(device: torch.device) -> Stager:
    """This thread's reused staging ring for launches on `device` (a receive loop or a
    pack builds a table per bucket: without a ring each would pin fresh host memory,
    which costs a driver call and, on some systems, a sync)."""
    import threading

    key = (torch.device(device), threading.get_ident())
    st = _STAGERS.get(key)
    if st is None:
        st = _STAGERS[key] = Stager(torch.device(device))
    return st


def build(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, word_base: np.ndarray,
          bucket: np.ndarray, device: torch.device, stager: Stager | None = None) -> Batch:
    """Cut every run into chunks of at most `CHUNK_BYTES` (one program each) and upload
    the table (through `stager` when given). All arrays are int64 of one length;
    zero-length runs are dropped."""
    keep = nbytes > 0
    src, dst, nbytes, word_base, bucket = (a[keep] for a in (src, dst, nbytes, word_base, bucket))
    chunks = np.maximum((nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES, 1)
    rep = np.repeat(np.arange(len(nbytes)), chunks)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    k = np.arange(len(rep)) - first  # chunk number inside its run
    off = k * CHUNK_BYTES
    tab = np.empty((len(rep), 5), dtype=np.int64)
    tab[:, 0] = src[rep] + off
    tab[:, 1] = dst[rep] + off
    tab[:, 2] = np.minimum(nbytes[rep] - off, CHUNK_BYTES)
    tab[:, 3] = word_base[rep] + off // 4
    tab[:, 4] = bucket[rep]
    aligned = bool(np.all(tab[:, 0] % 16 == 0) and np.all(tab[:, 1] % 16 == 0))
    if stager is not None and device.type == "cuda":
        d = stager.upload(tab)
    else:
        host = torch.from_numpy(tab)
        if device.type == "cuda":
            host = host.pin_memory()
        d = host.to(device, non_blocking=True)
    return Batch(d, d[:, 4], len(rep), aligned)


def launch(batch: Batch, digests: torch.Tensor, copy: bool = True, pad: bool = False) -> None:
    """Run `batch` on the current stream, adding each run's partial digest into
    `digests[bucket]` (an int64 device vector; additions wrap modulo 2**64). `pad`: the
    destinations are bucket slots, and a run that ends inside a 32-bit word also zeroes
    the rest of that word (what the bucket's digest counts as padding)."""
    if not batch.programs:
        return
    part = torch.empty(batch.programs, dtype=torch.int64, device=digests.device)
    _kernel[(batch.programs,)](batch.table, part, COPY=copy, PAD=pad,
                               ALIGNED=batch.aligned and _HINTS,
                               MOD=MOD, BLOCK=_BLOCK, num_warps=_WARPS)
    digests.index_add_(0, batch.bucket_of, part)


class Replay:
    """A digest-only launch of one kept table, made again and again (verification's
    re-read of the same landings push after push, `engine.verify.DigestCheck.reread`):
    captured once as a CUDA graph (zero the digests, the kernel, the per-bucket sums)
    and replayed, one launch instead of four. On the H200 host a replay and the
    comparison cost ~20 us of host time against ~80 us launched (hot), 200-270 us as
    measured inside a push; the re-read itself (the device reading every landed byte)
    is the same either way.

    The first `differs` launches as usual (the kernel is compiled and warm), the second
    captures; where capture fails (a device or driver that cannot capture here), the
    launch goes on as usual, logged once. Capture is thread-local: another thread's
    CUDA calls (an engine serving meanwhile) neither break it nor are broken by it."""

    def __init__(self, batch: Batch, buckets: int, device: torch.device) -> None:
        import threading

        self.batch, self.device = batch, device
        self.out = torch.zeros(buckets, dtype=torch.int64, device=device)
        self.graph: Any = None
        self.calls = 0
        self.failed = ""
        self._lock = threading.Lock()  # `out` is this object's: one use at a time

    def differs(self, want: torch.Tensor) -> torch.Tensor:
        """Per bucket, whether the table's runs now sum to other than `want` (a bool
        device vector, ordered on the current stream after the re-read; no sync)."""
        with self._lock:
            self.calls += 1
            if self.graph is None and self.calls == 2 and not self.failed:
                self._capture()
            if self.graph is not None:
                self.graph.replay()
            else:
                self.out.zero_()
                launch(self.batch, self.out, copy=False)
            return self.out.ne(want)

    def _capture(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()  # nothing of ours pending
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.out.zero_()
                launch(self.batch, self.out, copy=False)
        except Exception as e:  # launched as usual from now on
            self.failed = f"{type(e).__name__}: {e}"
            log.info("enginehooks: the re-read is launched, not replayed: %s", self.failed)
            return
        self.graph = graph

    @property
    def captured(self) -> bool:
        """Whether the re-read is replayed from a captured graph."""
        return self.graph is not None


def copy_digest(dst: torch.Tensor, src: torch.Tensor, word_base: int = 0,
                copy: bool = True) -> torch.Tensor:
    """Copy the bytes of contiguous `src` into contiguous `dst` (same byte size, both
    4-byte aligned) and return their digest term as a 0-dim int64 device tensor, the
    run starting at word `word_base` of its bucket. Digest only when `copy` is False."""
    if not available(src.device):
        raise ConfigError(f"fused copy+digest is not available on {src.device}: {_state_reason}")
    return _copy_digest(dst, src, word_base, copy)


def _copy_digest(dst: torch.Tensor, src: torch.Tensor, word_base: int, copy: bool) -> torch.Tensor:
    n = src.numel() * src.element_size()
    one = np.array
    batch = build(one([src.data_ptr()]), one([dst.data_ptr()]), one([n]), one([word_base]),
                  one([0]), src.device)
    out = torch.zeros(1, dtype=torch.int64, device=src.device)
    launch(batch, out, copy)
    return out[0]


def aligned(addr: int) -> bool:
    return addr % 4 == 0


def available(device: torch.device | str) -> bool:
    """Whether the fused kernel runs on `device` (built and checked once per process)."""
    global _kernel, _state, _state_reason
    device = torch.device(device)
    if device.type != "cuda" or _state == "off":
        return False
    if _state == "ok":
        return True
    try:
        _kernel = _build()
        _self_check(device)
        _state = "ok"
    except Exception as e:  # no triton, no compiler, or a wrong result: say so once
        _state, _state_reason = "off", f"{type(e).__name__}: {e}"
        log.warning("enginehooks: fused copy+digest unavailable on %s: %s", device, _state_reason)
    return _state == "ok"


def _self_check(device: torch.device) -> None:
    from enginehooks.core.checksums import sum64_tensor

    g = torch.Generator(device="cpu").manual_seed(7)
    for size, base in ((3, 0), (4 * _BLOCK + 7, 5), (CHUNK_BYTES * 2 + 6, 65519)):
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).to(device)
        dst = torch.zeros_like(src)
        got = int(_copy_digest(dst, src, base, True))
        padded = torch.zeros(base * 4 + size, dtype=torch.uint8, device=device)
        padded[base * 4:] = src
        want = int(sum64_tensor(padded))
        if got != want or not torch.equal(dst, src):
            raise ChecksumError(f"fused kernel disagrees with sum64 on {size} bytes at word {base}")

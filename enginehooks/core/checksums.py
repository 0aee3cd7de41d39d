"""Bucket digests, by name, so that a manifest can say which one its sender used.

Digests exist to catch silent corruption on the data plane (peers have shipped weights
torn by a missing stream sync, or overwritten by a transport's own magic bytes), so
receivers verify each bucket before applying it. `crc32` runs on the host; on a GPU
buffer it costs a device-to-host copy of the whole bucket (~20 GB/s), which `sum64`
avoids: it is computed where the buffer lives and only 8 bytes come back.

`sum64` is defined once (see `_sum64`) and computed three ways that give the same
value: in bounded-size chunks with torch ops (CPU, and GPUs without Triton), and in a
single pass with a Triton kernel on CUDA. The Triton path checks itself against the
torch path on first use and is dropped, with a warning, if they ever disagree.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Any

import torch

from enginehooks.core.errors import ChecksumError, ManifestError

_MASK64 = (1 << 64) - 1
_MOD = 65521  # weights are ((word index + 1) % _MOD) + 1, so they stay below 2**16
# Words per chunk of the torch path: a multiple of _MOD, so every chunk sees the same
# weight pattern and one cached weight table serves them all; 4.2 M words = 16.8 MB of
# payload, 34 MB of int64 temporaries, whatever the bucket size.
_CHUNK_WORDS = _MOD * 64

log = logging.getLogger(__name__)


def _crc32(buf: torch.Tensor) -> int:
    if buf.device.type != "cpu":
        buf = buf.cpu()
    return zlib.crc32(buf.numpy().data)  # the array's buffer, as bytes (no copy)


_weights: dict[torch.device, torch.Tensor] = {}


def _weight_table(device: torch.device) -> torch.Tensor:
    w = _weights.get(device)
    if w is None:
        w = torch.arange(1, _CHUNK_WORDS + 1, device=device, dtype=torch.int64) % _MOD + 1
        _weights[device] = w
    return w


def _tail_word(buf: torch.Tensor, n_words: int) -> torch.Tensor:
    """The last 1-3 bytes as one zero-padded little-endian word, times its weight."""
    tail = buf[n_words * 4 :].to(torch.int64)
    shifts = torch.tensor([1, 1 << 8, 1 << 16], device=buf.device, dtype=torch.int64)
    return (tail * shifts[: tail.numel()]).sum() * ((n_words + 1) % _MOD + 1)


def _words(buf: torch.Tensor, n_words: int) -> torch.Tensor:
    head = buf[: n_words * 4]
    if head.storage_offset() % 4:
        head = head.clone()  # an int32 view needs 4-byte alignment
    return head.view(torch.int32)


def _sum64_torch(buf: torch.Tensor) -> torch.Tensor:
    """The digest as a 0-dim int64 tensor on `buf`'s device, chunk by chunk."""
    n = buf.numel()
    n_words = n // 4
    words = _words(buf, n_words)
    table = _weight_table(buf.device)
    total = torch.zeros((), dtype=torch.int64, device=buf.device)
    for start in range(0, n_words, _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS].to(torch.int64)
        chunk.bitwise_and_(0xFFFFFFFF)
        chunk.mul_(table[: chunk.numel()])
        total += chunk.sum()  # int64 arithmetic wraps: the sum is exact mod 2**64
    if n % 4:
        total += _tail_word(buf, n_words)
    return total


# -- Triton: one pass over the bucket, int64 partial sums per block ----------------------
_triton_kernel: Any = None
_triton_state = "unknown"  # unknown | ok | off
_BLOCK = 4096


def _build_triton() -> Any:
    import triton
    import triton.language as tl

    # Triton reads a kernel's annotations (tl.constexpr): the other parameters stay bare.
    @triton.jit
    def sum64_kernel(  # type: ignore[no-untyped-def]
            words_ptr, partial_ptr, slot, n_words, MOD: tl.constexpr, BLOCK: tl.constexpr,
            ATOMIC: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK
        lane = tl.arange(0, BLOCK)
        offs = start + lane
        x = tl.load(words_ptr + offs, mask=offs < n_words, other=0)
        # weight ((word + 1) % MOD) + 1 from the block's first weight, in 32-bit: r0 < MOD
        # and lane < BLOCK < MOD, so one conditional subtraction reduces it (a 64-bit
        # modulo per word made this kernel ~5x slower than the memory it reads)
        t = ((start + 1) % MOD).to(tl.int32) + lane
        t = tl.where(t >= MOD, t - MOD, t) + 1
        xu = x.to(tl.uint32, bitcast=True).to(tl.uint64)  # the word as unsigned 32-bit
        part = tl.sum(xu * t.to(tl.uint64), axis=0).to(tl.int64, bitcast=True)  # exact
        if ATOMIC:  # every block into one slot: additions wrap modulo 2**64
            tl.atomic_add(partial_ptr + slot, part)
        else:
            tl.store(partial_ptr + pid, part)

    return sum64_kernel


def _sum64_triton(buf: torch.Tensor) -> torch.Tensor:
    n = buf.numel()
    n_words = n // 4
    total = torch.zeros((), dtype=torch.int64, device=buf.device)
    if n_words:
        words = _words(buf, n_words)
        grid = (n_words + _BLOCK - 1) // _BLOCK
        partial = torch.empty(grid, dtype=torch.int64, device=buf.device)
        with torch.cuda.device(buf.device):
            _triton_kernel[(grid,)](words, partial, 0, n_words, MOD=_MOD, BLOCK=_BLOCK,
                                    ATOMIC=False)
        total += partial.sum()
    if n % 4:
        total += _tail_word(buf, n_words)
    return total


def _sum64_into_triton(buf: torch.Tensor, out: torch.Tensor, slot: int) -> None:
    n = buf.numel()
    n_words = n // 4
    if n_words:
        grid = (n_words + _BLOCK - 1) // _BLOCK
        with torch.cuda.device(buf.device):
            _triton_kernel[(grid,)](_words(buf, n_words), out, slot, n_words, MOD=_MOD,
                                    BLOCK=_BLOCK, ATOMIC=True)
    if n % 4:
        out[slot] += _tail_word(buf, n_words)


_atomic_state = "unknown"  # unknown | ok | off


def sum64_into(buf: torch.Tensor, out: torch.Tensor, slot: int) -> None:
    """Add `sum64_tensor(buf)` into `out[slot]` (an int64 device vector) in one kernel
    launch where Triton runs (its blocks add atomically into the slot): no temporaries,
    no sync. For callers that digest many tensors one at a time as they arrive and
    compare them all at once (engine/verify.py), where `sum64_tensor`'s four launches
    and allocations per tensor cost more than the read. Checked against `sum64_tensor`
    on first use, like the Triton path itself."""
    global _atomic_state
    if _atomic_state != "off" and _use_triton(buf.device):
        if _atomic_state == "ok":
            _sum64_into_triton(buf, out, slot)
            return
        try:
            g = torch.Generator(device="cpu").manual_seed(1)
            for size in (3, 4 * _BLOCK + 7, 3 * 65536 + 1):
                probe = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).to(buf.device)
                got = torch.zeros(2, dtype=torch.int64, device=buf.device)
                _sum64_into_triton(probe, got, 1)
                if int(got[1]) != int(_sum64_triton(probe)) or int(got[0]) != 0:
                    raise ChecksumError(f"atomic sum64 disagrees on {size} bytes")
            _atomic_state = "ok"
        except Exception as e:
            log.warning("enginehooks: sum64_into falls back to sum64_tensor on %s: %s",
                        buf.device, e)
            _atomic_state = "off"
        sum64_into(buf, out, slot)
        return
    out[slot] += sum64_tensor(buf)


def _use_triton(device: torch.device) -> bool:
    """Build the kernel once and check it against the torch path on random bytes."""
    global _triton_kernel, _triton_state
    if device.type != "cuda" or _triton_state == "off":
        return False
    if _triton_state == "ok":
        return True
    try:
        _triton_kernel = _build_triton()
        g = torch.Generator(device="cpu").manual_seed(0)
        try:
            for size in (3, 4 * _BLOCK + 7, 3 * 65536 + 1):
                probe = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).to(device)
                if int(_sum64_triton(probe)) != int(_sum64_torch(probe)):
                    raise ChecksumError(f"triton sum64 disagrees with torch on {size} bytes")
        finally:
            _weights.pop(device, None)  # the torch path's table: not needed from now on
        _triton_state = "ok"
    except Exception as e:
        log.warning("enginehooks: sum64 falls back to torch ops on %s: %s", device, e)
        _triton_state = "off"
    return _triton_state == "ok"


def sum64_tensor(buf: torch.Tensor) -> torch.Tensor:
    """`sum64` of `buf` without the XOR of its length, as a 0-dim int64 tensor on
    `buf`'s device (no host sync: callers that can keep it on the device do)."""
    if _use_triton(buf.device):
        return _sum64_triton(buf)
    return _sum64_torch(buf)


def _xxh3(buf: torch.Tensor) -> int:
    import xxhash

    if buf.device.type != "cpu":
        buf = buf.cpu()
    return xxhash.xxh3_64_intdigest(buf.numpy().data)


def _sum64(buf: torch.Tensor) -> int:
    """Position-weighted sum of 32-bit words, computed where the buffer lives.

    The payload is zero-padded to whole little-endian words w_i (read as unsigned);
    the digest is (sum_i w_i * (((i + 1) % 65521) + 1) mod 2**64) XOR (nbytes << 40).
    Weighting by position catches swapped or shifted runs that a plain sum would
    miss; modular addition makes the value independent of the reduction order, so
    CPU, GPU and Triton agree bit for bit.
    """
    n = buf.numel()
    total = int(sum64_tensor(buf).item())
    return (total ^ (n << 40)) & _MASK64


CHECKSUMS: dict[str, Callable[[torch.Tensor], int]] = {
    "xxh3": _xxh3, "crc32": _crc32, "sum64": _sum64,
}


def digest(name: str | None, buf: torch.Tensor) -> int:
    """Digest of a 1-D uint8 tensor with the named algorithm; 0 when `name` is None."""
    if name is None:
        return 0
    try:
        fn = CHECKSUMS[name]
    except KeyError:
        raise ManifestError(
            f"unknown checksum {name!r}; known: {sorted(CHECKSUMS)} or null"
        ) from None
    return fn(buf) & _MASK64


def check_name(name: str | None) -> None:
    if name is not None and name not in CHECKSUMS:
        raise ManifestError(f"unknown checksum {name!r}; known: {sorted(CHECKSUMS)} or null")

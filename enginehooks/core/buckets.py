"""Packing a lazy `(name, tensor)` stream into byte buckets, and unpacking them.

The sender fills one bucket buffer while the transport ships the other; the receiver
turns a filled buffer back into zero-copy views (rejoining tensors that were cut across
buckets). Every bucket buffer ends in a small trailer (`TRAILER_BYTES`) that says which
update and which bucket it is, whether the sender aborted, and the payload's digest,
so a receiver never applies bytes it cannot vouch for.

Direct buckets (`Manifest` format 2): a bucket that is one piece of one tensor is not
copied into a bucket buffer. `pack` digests it where it lies, writes its trailer into
the bucket's buffer as usual and yields the tensor's own bytes as the payload; a
transport that frames direct buckets (broadcast) sends the trailer first, as its own
message, then the payload from the tensor's storage, and the receiver, once the trailer
checked out, receives the payload straight into the destination (`Unpacker.landing`).
Only transports that declare `direct_min` get manifests with direct buckets.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from enginehooks.core.auth import AuthError, bucket_mac
from enginehooks.core.checksums import digest
from enginehooks.core.dtypes import dtype_name, torch_dtype
from enginehooks.core.errors import ChecksumError, ManifestError, SenderAborted, TransportError
from enginehooks.core.manifest import ALIGN, MID_MEMO, SHAPE_MEMO, Manifest, TensorEntry

TRAILER_BYTES = 64
#: `Unpacker.land` runs by default for packed buckets of at least this many pieces, or
#: whose pieces average at most `FUSED_UNPACK_MAX_PIECE_BYTES`, or of at least
#: `FUSED_UNPACK_MIN_BUCKET_BYTES` (`fused_landing_pays`; measured, see there)
FUSED_UNPACK_MIN_PIECES = 16
FUSED_UNPACK_MAX_PIECE_BYTES = 16 << 20
FUSED_UNPACK_MIN_BUCKET_BYTES = 512 << 20
#: The longest abort reason a direct bucket's notice may announce.
MAX_REASON_BYTES = 4096
_MAGIC = 0x45484231  # "EHB1"
STATUS_OK = 0
STATUS_ABORT = 1
_MASK64 = (1 << 64) - 1


def fused_landing_pays(pieces: int, nbytes: int) -> bool:
    """Whether the fused landing (one launch: copies into the destinations and the
    digest) is not slower than a copy per piece plus a digest pass, for a packed bucket
    of `pieces` pieces and `nbytes` bytes. From `benchmarks/bench_fused_landing.py` on
    2x H200 (2026-11-27, `benchmarks/results/issue37-run1-h200x2-2026-11-27-fused-landing.json`):
    the fused launch is 0.01-0.16 x the separate way for pieces of 64 KiB-1 MiB, 0.6-0.77 x
    for 8 MiB pieces, 0.86-0.88 x for any piece size in 1 GiB buckets, and 1.4 x (slower)
    only for a 256 MiB bucket of one to four pieces of 64-256 MiB."""
    return pieces >= FUSED_UNPACK_MIN_PIECES or nbytes >= FUSED_UNPACK_MIN_BUCKET_BYTES or (
        pieces > 0 and nbytes // pieces <= FUSED_UNPACK_MAX_PIECE_BYTES)


def message_bytes(payload: int) -> int:
    """Bytes a sealed bucket of `payload` bytes occupies in a transport buffer: the
    payload, padding to `ALIGN`, and the trailer (which sits at the end)."""
    return (payload + ALIGN - 1) // ALIGN * ALIGN + TRAILER_BYTES


def buffer_bytes(manifest: Manifest) -> int:
    """Size of one transport buffer for this manifest: its largest sealed bucket."""
    return max((message_bytes(b.nbytes) for b in manifest.buckets), default=TRAILER_BYTES)


def manifest_id(manifest: Manifest) -> int:
    """A 63-bit fingerprint of the manifest, stamped on every bucket of its update.

    It is the digest of two parts: the manifest without its weight version (its layout:
    every tensor, piece and bucket, the options, the meta) and the version. The first part
    is computed once per layout (`core/layout.with_version` carries it to the next
    version's manifest): serialising a 4719-tensor MoE manifest takes tens of
    milliseconds, which every side would otherwise pay on every push. Cached per manifest
    object (a manifest is immutable)."""
    memo = getattr(manifest, "__dict__", None)
    cached = memo.get(MID_MEMO) if memo is not None else None
    if cached is not None:
        return int(cached)
    shape = memo.get(SHAPE_MEMO) if memo is not None else None
    if shape is None:
        body = manifest.to_dict()
        body.pop("weight_version", None)
        shape = hashlib.blake2b(json.dumps(body, separators=(",", ":")).encode(),
                                digest_size=16).digest()
        if memo is not None:
            memo[SHAPE_MEMO] = shape  # frozen dataclass: a memo, not a field
    version = json.dumps(manifest.weight_version).encode()
    h = hashlib.blake2b(shape + b"\x00" + version, digest_size=8).digest()
    mid = int.from_bytes(h, "little") >> 1
    if memo is not None:
        memo[MID_MEMO] = mid
    return mid


def _to_i64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


class _PinnedRing:
    """Small pinned host rows for non-blocking uploads of trailers (and reads of them)
    on one device: a row is reused `ROWS` uploads later, when the copy that used it has
    long completed (its event is checked, so reuse never races). A pageable copy would
    make the host wait for the stream (a sync per bucket)."""

    ROWS = 64

    def __init__(self) -> None:
        self.host = torch.empty((self.ROWS, TRAILER_BYTES // 8), dtype=torch.int64).pin_memory()
        self.done: list[torch.cuda.Event | None] = [None] * self.ROWS
        self.k = 0

    def upload(self, fields: list[int], dst: torch.Tensor) -> None:
        k = self.k
        self.k = (k + 1) % self.ROWS
        ev = self.done[k]
        if ev is not None:
            ev.synchronize()
        self.host[k].numpy()[:] = fields
        dst.copy_(self.host[k].view(torch.uint8), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.done[k] = ev


_RINGS: dict[tuple[torch.device, int], _PinnedRing] = {}


def _ring(device: torch.device) -> _PinnedRing:
    import threading

    key = (device, threading.get_ident())
    r = _RINGS.get(key)
    if r is None:
        r = _RINGS[key] = _PinnedRing()
    return r


def write_trailer(
    buf: torch.Tensor, *, mid: int, index: int, nbytes: int, dig: int, status: int = STATUS_OK,
    secret: bytes | None = None,
) -> None:
    """The bucket's last 64 bytes: magic, status, update id, index, size, digest, and,
    with a shared secret, an HMAC of those (`core/auth.py`)."""
    mac = bucket_mac(secret, mid, index, nbytes, dig) if secret else (0, 0)
    fields = [_MAGIC, status, mid, index, nbytes, _to_i64(dig), *mac]
    if buf.device.type == "cuda":  # through pinned memory: the host does not wait
        with torch.cuda.device(buf.device):
            _ring(buf.device).upload(fields, buf[-TRAILER_BYTES:])
        return
    buf[-TRAILER_BYTES:].copy_(torch.tensor(fields, dtype=torch.int64).view(torch.uint8))


def write_trailer_device(buf: torch.Tensor, *, mid: int, index: int, nbytes: int,
                         raw: torch.Tensor) -> None:
    """The trailer of a bucket whose `sum64` is still on the device: `raw` (int64 [1],
    the weighted sum without the length term) is finished and written into the digest
    field by the device, after the pack that computes it, so the host never waits for
    the pack. Unsigned only: a signature covers the digest, which the host would then
    have to read (`pack` does, with a secret)."""
    t64 = buf[-TRAILER_BYTES:].view(torch.int64)
    write_trailer(buf, mid=mid, index=index, nbytes=nbytes, dig=0)
    torch.bitwise_xor(raw.view(1), _to_i64(nbytes << 40), out=t64[5:6])


def finish_sum64(raw: int, nbytes: int) -> int:
    """`sum64`'s value from the weighted sum of a bucket's words and its length."""
    return ((raw & _MASK64) ^ (nbytes << 40)) & _MASK64


def parse_trailer(raw: list[int]) -> tuple[int, int, int, int, int, tuple[int, int]]:
    """(status, manifest id, index, nbytes, digest, mac) of a trailer's eight int64."""
    if raw[0] != _MAGIC:
        raise TransportError("received a bucket without an enginehooks trailer (bad magic)")
    return raw[1], raw[2], raw[3], raw[4], raw[5] & _MASK64, (raw[6], raw[7])


def read_trailer(buf: torch.Tensor) -> tuple[int, int, int, int, int, tuple[int, int]]:
    """(status, manifest id, index, nbytes, digest, mac) of a filled buffer."""
    return parse_trailer(read_trailer_raw(buf))


def read_trailer_raw(buf: torch.Tensor) -> list[int]:
    """The eight int64 of `buf`'s trailer, read to the host."""
    raw: list[int] = buf[-TRAILER_BYTES:].cpu().view(torch.int64).tolist()
    return raw


def write_abort(buf: torch.Tensor, mid: int, index: int, reason: str,
                secret: bytes | None = None) -> None:
    """Turn `buf` into an abort notice carrying `reason`, for receivers of bucket `index`."""
    msg = reason.encode("utf-8", "replace")[: max(0, buf.numel() - TRAILER_BYTES)]
    if msg:
        buf[: len(msg)].copy_(torch.frombuffer(bytearray(msg), dtype=torch.uint8))
    write_trailer(buf, mid=mid, index=index, nbytes=len(msg), dig=0, status=STATUS_ABORT,
                  secret=secret)


def direct_abort(trailer: torch.Tensor, mid: int, index: int, reason: str,
                 secret: bytes | None = None) -> torch.Tensor:
    """Turn `trailer` into the abort notice of direct bucket `index`; returns the reason
    (at most `MAX_REASON_BYTES`), which travels after it as a message of its own."""
    msg = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    write_trailer(trailer, mid=mid, index=index, nbytes=len(msg), dig=0, status=STATUS_ABORT,
                  secret=secret)
    return torch.frombuffer(bytearray(msg), dtype=torch.uint8) if msg else torch.empty(
        0, dtype=torch.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def check_tensor(entry: TensorEntry, name: str, t: torch.Tensor) -> None:
    """The stream must yield exactly what the manifest planned, in the same order."""
    if name != entry.name:
        raise ManifestError(f"stream yielded {name!r} where the manifest expects {entry.name!r}")
    if dtype_name(t.dtype) != entry.dtype or tuple(t.shape) != entry.shape:
        raise ManifestError(
            f"tensor {name!r}: stream yielded {dtype_name(t.dtype)}{list(t.shape)}, "
            f"manifest expects {entry.dtype}{list(entry.shape)}"
        )


def pack(
    manifest: Manifest,
    stream: Iterable[tuple[str, torch.Tensor]],
    next_buffer: Callable[[int], torch.Tensor],
    secret: bytes | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Fill buckets in order from `stream`; yield `(index, buffer)` once each is complete.

    `next_buffer(index)` hands out a free buffer of at least `buffer_bytes(manifest)`
    (called once per bucket, in order); the caller decides when a buffer is free again
    (after its send completed), which is what bounds memory to the buffers it owns. The
    stream is consumed one tensor at a time and checked against the plan as it goes.

    For a direct bucket the buffer gets only the trailer (at its end, as always) and
    what is yielded is the payload: `nbytes` bytes of the tensor's own storage where it
    lies on the buffer's device and is contiguous, else a copy at the buffer's front.
    The caller must keep that tensor alive and unmodified until its send completed
    (holding the yielded view does), and the stream must not write into a tensor it
    yielded before then.
    """
    mid = manifest_id(manifest)
    it = iter(stream)
    n_buckets = len(manifest.buckets)
    fused: _FusedPack | None = None
    buf: torch.Tensor | None = None  # the open packed bucket's buffer (bucket `index`)

    def open_bucket(i: int) -> torch.Tensor:
        nonlocal fused, buf
        buf = next_buffer(i)
        fused = _FusedPack.open(manifest, buf)
        return buf

    def seal(i: int) -> tuple[int, torch.Tensor]:
        nonlocal fused, buf
        b = buf if buf is not None else open_bucket(i)  # a bucket with no pieces
        nbytes = manifest.buckets[i].nbytes
        # fused: the copies and the digest in one pass, launched now; without a secret
        # the digest goes into the trailer on the device (no host sync per bucket)
        if fused is not None:
            raw = fused.seal(nbytes)
            if manifest.checksum is None:  # the launch copied; its digest is not wanted
                write_trailer(b, mid=mid, index=i, nbytes=nbytes, dig=0, secret=secret)
            elif secret is None:
                write_trailer_device(b, mid=mid, index=i, nbytes=nbytes, raw=raw)
            else:  # the signature covers the digest: the host reads it
                write_trailer(b, mid=mid, index=i, nbytes=nbytes,
                              dig=finish_sum64(int(raw.item()), nbytes), secret=secret)
        else:
            write_trailer(b, mid=mid, index=i, nbytes=nbytes,
                          dig=digest(manifest.checksum, b[:nbytes]), secret=secret)
        buf, fused = None, None
        return i, b

    def direct(i: int, data: torch.Tensor, start: int, nbytes: int) -> tuple[int, torch.Tensor]:
        b = next_buffer(i)
        payload = data[start : start + nbytes]
        if payload.device != b.device:
            b[:nbytes].copy_(payload)
            payload = b[:nbytes]
        if _device_sum64(manifest.checksum, payload) and secret is None:
            from enginehooks.core.checksums import sum64_tensor

            write_trailer_device(b, mid=mid, index=i, nbytes=nbytes,
                                 raw=sum64_tensor(payload))
        else:
            dig = digest(manifest.checksum, payload)
            write_trailer(b, mid=mid, index=i, nbytes=nbytes, dig=dig, secret=secret)
        return i, payload

    if not n_buckets:  # only zero-size tensors: they travel in no bucket
        for entry in manifest.tensors:
            check_tensor(entry, *_next(it, entry))
        _expect_end(it)
        return
    index = 0  # the next bucket to yield
    for entry in manifest.tensors:
        name, t = _next(it, entry)
        check_tensor(entry, name, t)
        t = t.contiguous()
        data: torch.Tensor | None = None  # its flat bytes, made only where needed: a
        # view costs microseconds, and a MoE update streams thousands of tensors
        for piece in entry.pieces:
            while piece.bucket > index:
                yield seal(index)
                index += 1
            if manifest.buckets[index].direct:
                data = as_bytes(t) if data is None else data
                yield direct(index, data, piece.start, piece.nbytes)
                index += 1
                continue
            b = buf if buf is not None else open_bucket(index)
            if fused is None or not fused.add(t, piece.start, piece.offset, piece.nbytes):
                data = as_bytes(t) if data is None else data
                b[piece.offset : piece.offset + piece.nbytes].copy_(
                    data[piece.start : piece.start + piece.nbytes]
                )
                if fused is not None:
                    fused.copied(piece.offset, piece.nbytes)
        del data, t
    _expect_end(it)
    while index < n_buckets:
        yield seal(index)
        index += 1


def _device_sum64(checksum: str | None, buf: torch.Tensor) -> bool:
    """Whether `buf`'s digest is `sum64` computed where it lies, on a GPU (it can then
    stay on the device: written into a trailer by the device, compared by the device)."""
    return checksum == "sum64" and buf.device.type == "cuda"


class _FusedPack:
    """Packing one bucket on a CUDA device with the fused copy+digest kernel
    (`core/fused_copy.py`): the pieces' copies wait until the bucket is sealed and run as
    one launch that also computes its `sum64`; the padding between pieces is zeroed in
    the same launch, so the value equals `sum64` of the sealed payload, which any
    receiver can check with the plain definition. It holds references to the bucket's
    source tensors until then (at most one bucket of the stream's temporaries). Pieces
    the kernel cannot take (another device, unaligned) are copied with `copy_` at once
    and digested in the same launch, reading the bucket."""

    _zeros: dict[torch.device, torch.Tensor] = {}

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.base = buf.data_ptr()
        self.copy_runs: list[tuple[int, int, int, int]] = []  # src, dst, nbytes, word
        self.read_runs: list[tuple[int, int, int]] = []  # addr, nbytes, word
        self.covered: list[tuple[int, int]] = []  # (offset, nbytes) of every piece
        self.refs: list[torch.Tensor] = []

    @classmethod
    def open(cls, manifest: Manifest, buf: torch.Tensor) -> _FusedPack | None:
        # without a checksum the launch is still one copy for the whole bucket (its
        # digest is dropped): a MoE bucket of thousands of pieces is one launch, not
        # thousands of `copy_` calls
        if (manifest.checksum not in ("sum64", None) or buf.device.type != "cuda"
                or buf.data_ptr() % 64
                or os.environ.get("ENGINEHOOKS_FUSED_PACK", "1") == "0"):
            return None
        from enginehooks.core import fused_copy

        return cls(buf) if fused_copy.available(buf.device) else None

    def add(self, data: torch.Tensor, start: int, offset: int, nbytes: int) -> bool:
        """Queue bytes `start:start + nbytes` of contiguous `data` (any dtype) for the
        bucket's launch at `offset`; False where the kernel cannot take them."""
        src = data.data_ptr() + start
        if data.device != self.buf.device or src % 4:
            return False
        self.copy_runs.append((src, self.base + offset, nbytes, offset // 4))
        self.covered.append((offset, nbytes))
        self.refs.append(data)
        return True

    def copied(self, offset: int, nbytes: int) -> None:
        """A piece copied with `copy_`: digest it where it now lies (its partial last
        word, if any, is completed with zeros first, as the digest counts it)."""
        end = offset + nbytes
        if end % 4:
            self.buf[end : (end + 3) // 4 * 4].zero_()
        self.read_runs.append((self.base + offset, nbytes, offset // 4))
        self.covered.append((offset, nbytes))

    def seal(self, nbytes: int) -> torch.Tensor:
        import numpy as np

        from enginehooks.core import fused_copy

        dev = self.buf.device
        zero = self._zeros.get(dev)
        if zero is None:
            zero = self._zeros[dev] = torch.zeros(ALIGN, dtype=torch.uint8, device=dev)
        # zero every whole word of padding: between pieces (a piece's partial last word is
        # completed by its own run) and up to the payload's end
        gaps: list[tuple[int, int, int, int]] = []
        end = 0
        for off, n in [*sorted(self.covered), (nbytes, 0)]:
            gap_start = (end + 3) // 4 * 4
            while gap_start < off:
                step = min(off - gap_start, ALIGN)
                gaps.append((zero.data_ptr(), self.base + gap_start, step, gap_start // 4))
                gap_start += step
            end = max(end, off + n)
        digests = torch.zeros(1, dtype=torch.int64, device=dev)
        with torch.cuda.device(dev):
            stager = fused_copy.stager_for(dev)
            for runs in (self.copy_runs, gaps):  # apart: the pieces' launch stays aligned
                if runs:
                    a = np.asarray(runs, dtype=np.int64)
                    fused_copy.launch(fused_copy.build(a[:, 0], a[:, 1], a[:, 2], a[:, 3],
                                                       np.zeros(len(a), dtype=np.int64), dev,
                                                       stager),
                                      digests, copy=True, pad=True)
            if self.read_runs:
                r = np.asarray(self.read_runs, dtype=np.int64)
                z = np.zeros(len(r), dtype=np.int64)
                fused_copy.launch(fused_copy.build(r[:, 0], z, r[:, 1], r[:, 2], z, dev, stager),
                                  digests, copy=False)
        self.refs.clear()
        return digests  # the weighted sum, on the device (`finish_sum64` adds the length)


def _next(it: Iterator[tuple[str, torch.Tensor]], entry: TensorEntry) -> tuple[str, torch.Tensor]:
    try:
        return next(it)
    except StopIteration:
        raise ManifestError(f"stream ended before tensor {entry.name!r} of the manifest") from None


def _expect_end(it: Iterator[tuple[str, torch.Tensor]]) -> None:
    leftover = next(it, None)
    if leftover is not None:
        raise ManifestError(f"stream yielded {leftover[0]!r}, which the manifest does not plan")


class Unpacker:
    """Turns received buckets back into `(name, tensor)`, verifying each bucket first.

    Tensors that live whole in one bucket come out as views of the buffer: the caller
    must finish with them before the buffer is reused. Tensors cut across buckets are
    rejoined into a fresh tensor on `device`, unless `into(name)` returns a
    destination for them (a target that holds the weight in checkpoint layout, such as
    a torch model): then each piece is copied straight into it and the destination
    itself is yielded, which keeps the receiver's extra memory at its two buffers
    instead of two buffers plus the largest split tensor (1.1 GB for a 7B model's
    embedding).

    Direct buckets: the transport asks `landing(index)` where to receive the payload
    (the destination's bytes, or the rejoin tensor, or None: its own buffer), checks
    the trailer that came first (`check_header`) before receiving into it, and then
    `verify_digest(index, payload, trailer)` before `unpack(..., landed=True)`. A bad
    digest there raises after the bytes landed in the destination: the caller fails
    the update, and the engine side marks the replica torn (`engine/side.py`).
    """

    def __init__(
        self,
        manifest: Manifest,
        device: torch.device | str = "cpu",
        into: Callable[[str], torch.Tensor | None] | None = None,
        secret: bytes | None = None,
        target: Any = None,
    ) -> None:
        self.manifest = manifest
        #: the receiving `Target` (its `landing_wanted` / `wire_landed`), where known
        self.target = target
        self.secret = secret
        self.mid = manifest_id(manifest)
        self.device = torch.device(device)
        self.into = into
        self._per_bucket = manifest.by_bucket()
        self._partial: dict[str, torch.Tensor] = {}
        self._empty = [t for t in manifest.tensors if not t.pieces]
        # deferred digests (`defer`): each bucket's weighted sum as the device computed
        # it, and the value its trailer announced; compared by `finish`, once per push.
        # [:n] what landed in the target's own tensors (`WireLanding`), [n:] the rest
        self._sums: torch.Tensor | None = None
        self._want: dict[int, int] = {}

    def defer(self) -> bool:
        """Whether this update's digests are compared on the device and read once, by
        `finish` (`sum64` on a GPU), rather than bucket by bucket on the host."""
        return self.manifest.checksum == "sum64" and self.device.type == "cuda"

    def _sum_slot(self, index: int) -> torch.Tensor:
        """Bucket `index`'s slot (int64 [1], zero) in the device vector of sums."""
        n = len(self.manifest.buckets)
        if self._sums is None:
            self._sums = torch.zeros(2 * n, dtype=torch.int64, device=self.device)
            self._landed = self._sums[:n]
        return self._sums[n + index : n + index + 1]

    def defer_digest(self, index: int, payload: torch.Tensor, dig: int) -> None:
        """Digest bucket `index`'s payload on the device; `dig` (its trailer's) is
        compared by `finish`."""
        from enginehooks.core.checksums import sum64_tensor

        self._sum_slot(index).add_(sum64_tensor(payload).view(1))
        self._want[index] = dig

    def finish(self) -> None:
        """Compare every deferred digest of the update at once (the one host read of the
        push): a mismatch raises `ChecksumError` naming the first bad bucket. The bytes
        have landed by then; the caller's failure makes the engine side mark the
        replica torn, as for any failure once data moved."""
        if not self._want:
            return
        assert self._sums is not None
        wanted, self._want = self._want, {}
        idx = sorted(wanted)
        n = self.manifest.buckets
        want = torch.tensor([_to_i64(wanted[k] ^ (n[k].nbytes << 40)) for k in idx],
                            dtype=torch.int64)
        both = self._sums[: len(n)] + self._sums[len(n) :]
        got = both[torch.tensor(idx, device=self.device)].cpu()
        bad = (got != want).nonzero().flatten().tolist()
        if bad:
            k = idx[bad[0]]
            mine = finish_sum64(int(got[bad[0]]), n[k].nbytes)
            raise ChecksumError(
                f"bucket {k}: sum64 {mine:#x} != sender's {wanted[k]:#x} (compared on the "
                f"device once the update's bytes had landed; {len(bad)} bad bucket(s)); "
                f"tensors {[e.name for e, _ in self._per_bucket[k]][:4]}..."
            )

    def verify_raw(self, index: int, raw: list[int]) -> tuple[int, int]:
        """`verify(..., check_digest=False)` of a trailer already on the host (its eight
        int64, read without a sync by the receive loop): (nbytes, digest)."""
        status, mid, got_index, nbytes, dig, mac = parse_trailer(raw)
        self._check_mac(index, mid, got_index, nbytes, dig, mac)
        if status == STATUS_ABORT:
            return -1 - nbytes, dig
        self._check_fields(index, mid, got_index, nbytes)
        return nbytes, dig

    def empties(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Zero-size tensors, which travel in no bucket (yielded with bucket 0)."""
        for e in self._empty:
            yield e.name, torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=self.device)

    def verify(self, index: int, buf: torch.Tensor, check_digest: bool = True) -> int:
        """Check bucket `index`'s trailer and (unless `check_digest` is False) its
        digest; return its payload size. The trailer check is cheap (64 bytes) and is
        what a receiver needs before posting its next receive; the digest may follow
        while that receive is in flight (`verify_digest`)."""
        status, mid, got_index, nbytes, dig, mac = read_trailer(buf)
        self._check_mac(index, mid, got_index, nbytes, dig, mac)
        if status == STATUS_ABORT:
            self.aborted(buf[:nbytes])
        self._check_fields(index, mid, got_index, nbytes)
        if check_digest:
            self._check_digest(index, buf, nbytes, dig)
        return nbytes

    def check_header(self, index: int, trailer: torch.Tensor) -> int:
        """Direct bucket `index`'s trailer, received ahead of its payload: signature,
        update, index and size are checked before the payload may be received into a
        destination. Returns -1, or, for an abort notice, the length of the sender's
        reason, which follows as a message of its own (`aborted`)."""
        return self.check_header_raw(index, read_trailer_raw(trailer))[0]

    def check_header_raw(self, index: int, raw: list[int]) -> tuple[int, int]:
        """`check_header` of a trailer already on the host (its eight int64): (-1 or
        the abort reason's length, the digest it announces)."""
        status, mid, got_index, nbytes, dig, mac = parse_trailer(raw)
        self._check_mac(index, mid, got_index, nbytes, dig, mac)
        if status == STATUS_ABORT:
            if nbytes > MAX_REASON_BYTES:
                raise TransportError(f"abort notice of bucket {index} announces a reason of "
                                     f"{nbytes} bytes (at most {MAX_REASON_BYTES})")
            return nbytes, dig
        self._check_fields(index, mid, got_index, nbytes)
        return -1, dig

    def aborted(self, reason: torch.Tensor) -> None:
        """Raise the sender's abort notice, whose reason is `reason`'s bytes."""
        text = bytes(reason.cpu().numpy()).decode("utf-8", "replace")
        raise SenderAborted(f"the sender aborted the update: {text}")

    def _check_mac(self, index: int, mid: int, got_index: int, nbytes: int, dig: int,
                   mac: tuple[int, int]) -> None:
        if self.secret is not None and mac != bucket_mac(self.secret, mid, got_index, nbytes, dig):
            raise AuthError(f"bucket {index} is not signed with the shared secret: it did not "
                            "come from this update's trainer")

    def _check_fields(self, index: int, mid: int, got_index: int, nbytes: int) -> None:
        if mid != self.mid:
            raise TransportError(
                f"bucket {got_index} belongs to another update (manifest id {mid:#x}, "
                f"expected {self.mid:#x})"
            )
        if got_index != index or nbytes != self.manifest.buckets[index].nbytes:
            raise TransportError(
                f"expected bucket {index} of {self.manifest.buckets[index].nbytes} bytes, got "
                f"bucket {got_index} of {nbytes} bytes"
            )

    def verify_digest(self, index: int, buf: torch.Tensor,
                      trailer: torch.Tensor | None = None) -> None:
        """Check bucket `index`'s payload (the front of `buf`) against the digest in its
        trailer (the end of `buf`, or `trailer` for a direct bucket's own message)."""
        _status, _mid, _index, nbytes, dig, _mac = read_trailer(buf if trailer is None
                                                                else trailer)
        self._check_digest(index, buf, nbytes, dig)
        checksum = self.manifest.checksum
        if (checksum is not None and self.manifest.buckets[index].direct
                and self.target is not None and self.target.landing_wanted()):
            # one piece of one tensor, checked just now: its digest is the sender's
            ((entry, piece),) = self._per_bucket[index]
            self.target.arrived_piece(entry.name, piece.start, piece.nbytes, checksum, dig)

    def landing(self, index: int) -> torch.Tensor | None:
        """Where direct bucket `index`'s payload should be received: its bytes in the
        target's own tensor (`into`), or in the tensor a split tensor is rejoined in;
        None for a packed bucket or where no such tensor lies on this device (the
        payload then goes to the transport's buffer, and `unpack` copies it)."""
        if not self.manifest.buckets[index].direct:
            return None
        ((entry, piece),) = self._per_bucket[index]
        whole = self._partial.get(entry.name)
        if whole is None:
            dt = torch_dtype(entry.dtype)
            if len(entry.pieces) > 1:
                whole = self._destination(entry, dt)
            else:
                whole = self._matching(entry, dt)
                if whole is None or whole.device != self.device:
                    return None
            self._partial[entry.name] = whole
        if whole.device != self.device:
            return None
        return whole[piece.start : piece.start + piece.nbytes]

    def land(self, index: int, buf: torch.Tensor, dig: int | None = None
             ) -> dict[int, torch.Tensor] | None:
        """Fused verify-and-copy of packed bucket `index`, received in `buf` (CUDA,
        `sum64`): every piece whose destination the target offers (`into`, as for a
        rejoined tensor: same dtype, shape, contiguous, on this device) is copied from
        `buf` straight into it, and the bucket's digest is computed in the same pass
        (`core/fused_copy.py`); the payload bytes no destination takes (pieces the
        target casts or relays, padding) are read once for the digest. The digest is
        then checked against the trailer, which `verify(..., check_digest=False)` has
        vouched for.

        This replaces one copy launch per tensor (and the separate digest pass) with
        one launch per bucket. Measured on 2x H200 over NCCL (docs/benchmarks.md), that
        pays where a bucket holds many tensors (MoE experts: 1.4 -> 3.0 x faster than
        one broadcast per tensor, with the fused pack) and costs where it holds a few
        large ones (Qwen2.5-7B shapes in 256 MiB buckets: 72 -> 104 ms; neutral at
        1 GiB). So by default (`ENGINEHOOKS_FUSED_UNPACK=auto`) it runs where
        `fused_landing_pays` (measured: all but buckets under 512 MiB of a few pieces
        over 16 MiB); `1` always, `0` never.

        A bad digest raises after bytes landed in the destinations, as for a direct
        bucket: the update fails and the engine side marks the replica torn, as it does
        for any failure once data moved.

        Returns the positions (in the bucket's `(tensor, piece)` list) now in place,
        with the tensor each landed in (the target's own tensor for a whole one, the
        flat bytes it is rejoined in for a split one), for `unpack(placed=...)`; None
        where the fused path does not apply (no destinations, another checksum, no
        Triton, too few pieces, `ENGINEHOOKS_FUSED_UNPACK=0`, or two destinations that
        overlap, such as tied aliases, whose order of writes must stay the stream's):
        the caller then verifies and unpacks as before."""
        m = self.manifest
        mode = os.environ.get("ENGINEHOOKS_FUSED_UNPACK", "auto")
        # verification re-reads what lands here instead of digesting each tensor again
        # (`WireLanding`): then this lands every bucket it applies to, and where the
        # fused launch is the slower way (a few large pieces), it lands them `split`:
        # a copy per piece (as unpacking would) and one digest pass over the bucket
        # that sums the landed pieces apart from the rest (as the fused launch does)
        witness = (self.target is not None and dig is not None and mode != "0"
                   and self.target.landing_wanted())
        pays = mode == "1" or fused_landing_pays(len(self._per_bucket[index]),
                                                 m.buckets[index].nbytes)
        split = witness and not pays
        if (self.into is None or m.checksum not in ("sum64", None) or buf.device.type != "cuda"
                or m.buckets[index].direct or buf.data_ptr() % 4 or mode == "0"
                or not (pays or witness)):
            return None
        from enginehooks.core import fused_copy

        if not fused_copy.available(buf.device):
            return None
        base, nbytes = buf.data_ptr(), m.buckets[index].nbytes
        placed: dict[int, torch.Tensor] = {}
        copies: list[tuple[int, int, int, int]] = []  # src, dst, nbytes, word
        views: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # `split`: (bytes, into, piece)
        own: list[bool] = []  # per copy: into the target's own tensor (a whole one)
        spans: list[tuple[int, int, bool]] = []  # every destination's bytes; placed or not
        for pos, (entry, piece) in enumerate(self._per_bucket[index]):
            dt = torch_dtype(entry.dtype)
            if len(entry.pieces) > 1:
                whole = self._partial.get(entry.name)
                if whole is None:
                    whole = self._destination(entry, dt)
            else:  # the tensor itself, not a byte view of it: views cost microseconds,
                # and a MoE bucket holds thousands of tensors
                dest = self.into(entry.name)
                if dest is None:
                    continue
                whole = dest
                if (dest.dtype != dt or tuple(dest.shape) != entry.shape
                        or not dest.is_contiguous()):
                    # the target casts or relays it: where it writes counts for overlaps
                    if dest.device == buf.device and dest.numel():
                        start = dest.data_ptr()
                        spans.append((start, start + dest.numel() * dest.element_size(), False))
                    continue
            dst = whole.data_ptr() + piece.start
            if (whole.device != buf.device or dst % 4 or piece.nbytes % 4
                    or not piece.nbytes):
                if whole.device == buf.device:
                    spans.append((dst, dst + piece.nbytes, False))
                continue
            placed[pos] = whole
            copies.append((base + piece.offset, dst, piece.nbytes, piece.offset // 4))
            if split:
                views.append((buf[piece.offset:piece.offset + piece.nbytes], whole, piece))
            own.append(len(entry.pieces) == 1)
            spans.append((dst, dst + piece.nbytes, True))
        if not placed or _overlap(spans):
            return None
        # the digest-only runs: every payload byte no copy run reads (none without a
        # checksum: the launch is then only the copies)
        reads: list[tuple[int, int, int]] = []
        end = 0
        tail = [] if m.checksum is None else [(base + nbytes, 0, 0, 0)]
        for src, _dst, n, _word in ([] if m.checksum is None else [*sorted(copies), *tail]):
            if src - base > end:
                reads.append((base + end, src - base - end, end // 4))
            end = max(end, src - base + n)
        import numpy as np

        deferred = dig is not None
        nb = len(m.buckets)
        if deferred:  # own pieces add into [index], the rest into [n + index] (`_sums`)
            self._sum_slot(index)
            assert self._sums is not None
            digests, rest = self._sums, nb + index
            slot = np.where(np.asarray(own), index, rest) if witness else np.full(len(own), rest)
        else:
            digests, rest = torch.zeros(1, dtype=torch.int64, device=buf.device), 0
            slot = np.zeros(len(own), dtype=np.int64)
        with torch.cuda.device(buf.device):
            stager = fused_copy.stager_for(buf.device)
            a = np.asarray(copies, dtype=np.int64)
            if split:  # the copies as unpacking makes them, the landed pieces' terms
                # read from the bucket in one digest-only launch (the same sums)
                for got, whole, piece in views:
                    flat = whole.view(-1).view(torch.uint8)
                    flat[piece.start:piece.start + piece.nbytes].copy_(got)
            fused_copy.launch(fused_copy.build(a[:, 0], a[:, 1], a[:, 2], a[:, 3],
                                               slot.astype(np.int64), buf.device, stager),
                              digests, copy=not split)
            if reads:
                r = np.asarray(reads, dtype=np.int64)
                z = np.zeros(len(r), dtype=np.int64)
                fused_copy.launch(fused_copy.build(r[:, 0], z, r[:, 1], r[:, 2], z + rest,
                                                   buf.device, stager),
                                  digests, copy=False)
        if witness and any(own):
            self._witness(index, a[np.asarray(own)], placed)
        for pos, whole in placed.items():
            entry, _piece = self._per_bucket[index][pos]
            if len(entry.pieces) > 1:
                self._partial[entry.name] = whole
        if m.checksum is None:
            return placed
        if dig is not None:  # compared on the device, read once per update (`finish`)
            self._want[index] = dig
            return placed
        mine = finish_sum64(int(digests.item()), nbytes)
        dig = read_trailer(buf)[4]
        if mine != dig:
            raise ChecksumError(
                f"bucket {index}: sum64 {mine:#x} != sender's {dig:#x} (checked while "
                f"copying into the destinations, which now hold the bad bytes); tensors "
                f"{[e.name for e, _ in self._per_bucket[index]][:4]}..."
            )
        return placed

    def _witness(self, index: int, rows: Any, placed: dict[int, torch.Tensor]) -> None:
        """Tell the target what bucket `index` landed in its own (whole) tensors: `rows`
        of (src, dst, nbytes, word), added into `_sums[index]`; before `unpack` yields
        them (`WireLanding`)."""
        import numpy as np

        from enginehooks.core.landing import WireLanding

        names: dict[str, tuple[int, int]] = {}
        for pos, whole in placed.items():
            entry, piece = self._per_bucket[index][pos]
            if len(entry.pieces) == 1:
                names[entry.name] = (whole.data_ptr(), piece.nbytes)
        self.target.wire_landed(WireLanding(
            self._landed, names, {index: list(names)}, rows[:, 1], rows[:, 2], rows[:, 3],
            np.full(len(rows), index, dtype=np.int64)))

    def _check_digest(self, index: int, buf: torch.Tensor, nbytes: int, dig: int) -> None:
        if self.manifest.checksum is None:
            return
        mine = digest(self.manifest.checksum, buf[:nbytes])
        if mine != dig:
            raise ChecksumError(
                f"bucket {index}: {self.manifest.checksum} {mine:#x} != sender's {dig:#x}; "
                f"tensors {[e.name for e, _ in self._per_bucket[index]][:4]}..."
            )

    def unpack(
        self, index: int, buf: torch.Tensor, verified: bool = False, landed: bool = False,
        placed: dict[int, torch.Tensor] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Bucket `index`'s tensors; `landed`: its payload was received where
        `landing(index)` said (verified by the caller), so nothing is copied; `placed`:
        what `land(index, buf)` copied into its destinations already."""
        if not verified:
            if landed:
                raise TransportError("a landed direct bucket must be verified by its receiver")
            if placed:
                raise TransportError("a bucket placed by land() must be verified by it")
            self.verify(index, buf)
        if index == 0:
            yield from self.empties()
        for pos, (entry, piece) in enumerate(self._per_bucket[index]):
            dt = torch_dtype(entry.dtype)
            if placed is not None and pos in placed:
                if len(entry.pieces) == 1:
                    yield entry.name, placed[pos]
                elif piece is entry.pieces[-1]:
                    whole = self._partial.pop(entry.name)
                    yield entry.name, whole.view(dt).view(entry.shape)
                continue
            if landed:
                if piece is entry.pieces[-1]:
                    whole = self._partial.pop(entry.name)
                    yield entry.name, whole.view(dt).view(entry.shape)
                continue
            src = buf[piece.offset : piece.offset + piece.nbytes]
            if len(entry.pieces) == 1:
                yield entry.name, src.view(dt).view(entry.shape)
                continue
            partial = self._partial.get(entry.name)
            if partial is None:
                partial = self._partial[entry.name] = self._destination(entry, dt)
            partial[piece.start : piece.start + piece.nbytes].copy_(src)
            if piece is entry.pieces[-1]:
                del self._partial[entry.name]
                yield entry.name, partial.view(dt).view(entry.shape)

    def _destination(self, entry: TensorEntry, dt: torch.dtype) -> torch.Tensor:
        """Flat bytes to rejoin `entry` in: the target's own tensor where it offers a
        matching contiguous one, else a fresh buffer."""
        dest = self._matching(entry, dt)
        if dest is not None:
            return dest
        return torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)

    def _matching(self, entry: TensorEntry, dt: torch.dtype) -> torch.Tensor | None:
        """The target's own tensor for `entry` as flat bytes, where it has the wire's
        dtype and shape and is contiguous (else the bytes cannot land in it as they are:
        a cast or a relayout is the target's job)."""
        if self.into is None:
            return None
        return _lands_in(self.into(entry.name), entry, dt)


def _lands_in(dest: torch.Tensor | None, entry: TensorEntry, dt: torch.dtype
              ) -> torch.Tensor | None:
    """`dest` as flat bytes where the wire's bytes can land in it as they are."""
    if (
        dest is not None
        and dest.dtype == dt
        and tuple(dest.shape) == entry.shape
        and dest.is_contiguous()
    ):
        return as_bytes(dest)
    return None


def _overlap(spans: list[tuple[int, int, bool]]) -> bool:
    """Whether a placed destination span (start, end, placed) overlaps any other span:
    then the fused copies could reorder writes the stream makes in order."""
    reach = reach_placed = -1  # the furthest end of any span / any placed span so far
    for start, end, placed in sorted(spans):
        if start < (reach if placed else reach_placed):
            return True
        reach = max(reach, end)
        if placed:
            reach_placed = max(reach_placed, end)
    return False

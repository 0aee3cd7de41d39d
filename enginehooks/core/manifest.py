"""The manifest: everything a receiver must know about one update before a byte moves.

A manifest is plain JSON-able data (never pickle: it crosses sockets and HTTP bodies)
and is validated on load, so a receiver can refuse a bad update while the sender is
still waiting to enter the collective. It is planned from names, dtypes and shapes
alone: the trainer never has to gather or materialise a tensor to plan an update.

Layout: tensors are laid into buckets of at most `bucket_bytes` in stream order, each
start aligned to `ALIGN` bytes (so a bucket slice can be viewed as any dtype, and GPU
copies stay vectorised). A tensor larger than a bucket is cut into pieces that fill
whole buckets and is rejoined by the receiver.

Direct buckets (format version 2, planned with `direct_min`): a tensor of at least
`direct_min` bytes gets buckets of its own, each holding one piece at offset 0 and
flagged `direct`. A transport that can (gloo) then sends such a bucket from the
tensor's own storage and receives it straight into the destination, with its trailer
as a separate message (`core/buckets.py`); the flag is in the manifest, which the
trainer signs, so both ends agree on the framing before a byte moves. Any transport may
treat a direct bucket as a packed one: its packed layout is the same bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from enginehooks.core.errors import ManifestError

FORMAT_VERSION = 1
#: The format of a manifest with direct buckets; readers take both.
DIRECT_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, DIRECT_FORMAT_VERSION)
ALIGN = 64
#: Caps checked before anything else is parsed (a manifest arrives from the network):
#: the text, the number of tensors and buckets, one bucket's size, a name's length.
MAX_MANIFEST_CHARS = 256 << 20
MAX_TENSORS = 2_000_000
MAX_BUCKETS = 2_000_000
MAX_BUCKET_BYTES = 64 << 30
MAX_NAME_CHARS = 1024

# Bytes per element of every dtype a manifest may carry (torch names without "torch.").
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of the stream, known before it is produced."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Piece:
    """A run of `nbytes` bytes of a tensor, from byte `start` of the tensor, at `offset`
    of bucket `bucket`."""

    bucket: int
    offset: int
    start: int
    nbytes: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True)
class BucketEntry:
    """One bucket: its payload size, and its digest where the sender knew it in advance
    (disk shards). Streamed transports carry each bucket's digest in-band instead.
    `direct`: the bucket is one piece of one tensor at offset 0 (see the module
    docstring)."""

    index: int
    nbytes: int
    checksum: str | None = None
    direct: bool = False


#: Memos that code derives from a manifest are kept in its `__dict__` (it is frozen, so a
#: memo is not a field). Every memo but the manifest id depends only on the manifest's
#: layout, never on its weight version, so `core/layout.with_version` carries them to the
#: next version's manifest; the id (`core/buckets.manifest_id`) is rebuilt from the
#: carried layout digest and the new version.
MID_MEMO = "_enginehooks_mid"
SHAPE_MEMO = "_enginehooks_shape"
SPECS_MEMO = "_enginehooks_specs"


@dataclass(frozen=True)
class Manifest:
    weight_version: int | str
    bucket_bytes: int
    tensors: tuple[TensorEntry, ...]
    buckets: tuple[BucketEntry, ...]
    checksum: str | None = "crc32"
    format_version: int = FORMAT_VERSION
    meta: Mapping[str, Any] = field(default_factory=dict)

    # -- derived views -------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_bucket(self) -> list[list[tuple[TensorEntry, Piece]]]:
        """For each bucket, the (tensor, piece) pairs it holds, in offset order."""
        out: list[list[tuple[TensorEntry, Piece]]] = [[] for _ in self.buckets]
        for t in self.tensors:
            for p in t.pieces:
                out[p.bucket].append((t, p))
        for lst in out:
            lst.sort(key=lambda tp: tp[1].offset)
        return out

    def specs(self) -> list[TensorSpec]:
        """Each tensor's spec, in order (a new list; the specs are made once per layout:
        a MoE manifest has thousands, and a receiver asks every push)."""
        memo = self.__dict__.get(SPECS_MEMO)
        if memo is None:
            memo = tuple(t.spec for t in self.tensors)
            self.__dict__[SPECS_MEMO] = memo  # frozen dataclass: a memo, not a field
        return list(memo)

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "weight_version": self.weight_version,
            "bucket_bytes": self.bucket_bytes,
            "checksum": self.checksum,
            "meta": dict(self.meta),
            "buckets": [[b.index, b.nbytes, b.checksum, *(["direct"] if b.direct else [])]
                        for b in self.buckets],
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "pieces": [[p.bucket, p.offset, p.start, p.nbytes] for p in t.pieces],
                }
                for t in self.tensors
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        if isinstance(text, (str, bytes)) and len(text) > MAX_MANIFEST_CHARS:
            raise ManifestError(f"manifest of {len(text)} characters exceeds the cap of "
                                f"{MAX_MANIFEST_CHARS}")
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Build and validate; every error names the field or tensor at fault."""
        if not isinstance(data, dict):
            raise ManifestError("manifest must be a JSON object")
        fv = data.get("format_version")
        if fv not in READABLE_VERSIONS or isinstance(fv, bool):
            raise ManifestError(
                f"manifest format_version {fv!r} is not supported (this enginehooks reads "
                f"{', '.join(map(str, READABLE_VERSIONS))})"
            )
        version = data.get("weight_version")
        if not isinstance(version, (int, str)) or isinstance(version, bool):
            raise ManifestError(f"weight_version must be an int or a str, got {version!r}")
        bucket_bytes = _int(data.get("bucket_bytes"), "bucket_bytes", minimum=1)
        if bucket_bytes > MAX_BUCKET_BYTES:
            raise ManifestError(f"bucket_bytes {bucket_bytes} exceeds the cap of "
                                f"{MAX_BUCKET_BYTES} bytes")
        checksum = data.get("checksum")
        if checksum is not None and not isinstance(checksum, str):
            raise ManifestError(f"checksum must be a name or null, got {checksum!r}")
        from enginehooks.core.checksums import check_name  # torch: imported when used

        check_name(checksum)
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ManifestError("meta must be a JSON object")

        raw_buckets = data.get("buckets")
        if not isinstance(raw_buckets, list):
            raise ManifestError("buckets must be a list")
        if len(raw_buckets) > MAX_BUCKETS:
            raise ManifestError(f"{len(raw_buckets)} buckets exceed the cap of {MAX_BUCKETS}")
        buckets = []
        for i, rb in enumerate(raw_buckets):
            direct = isinstance(rb, list) and len(rb) == 4 and rb[3] == "direct"
            if direct and fv < DIRECT_FORMAT_VERSION:
                raise ManifestError(f"bucket {i}: direct buckets need format_version "
                                    f"{DIRECT_FORMAT_VERSION}, the manifest says {fv}")
            if not (isinstance(rb, list) and (len(rb) == 3 or direct)):
                raise ManifestError(f"bucket {i}: expected [index, nbytes, checksum] or "
                                    "[index, nbytes, checksum, \"direct\"]")
            if rb[0] != i:
                raise ManifestError(f"bucket {i}: index {rb[0]!r} out of order")
            nb = _int(rb[1], f"bucket {i} nbytes", minimum=0)
            if nb > bucket_bytes and meta.get("unsplit") is not True:
                raise ManifestError(f"bucket {i}: {nb} bytes exceed bucket_bytes {bucket_bytes}")
            if nb > MAX_BUCKET_BYTES:
                raise ManifestError(f"bucket {i}: {nb} bytes exceed the cap of "
                                    f"{MAX_BUCKET_BYTES} bytes")
            if rb[2] is not None and not (isinstance(rb[2], str) and len(rb[2]) <= 256):
                raise ManifestError(f"bucket {i}: checksum must be a string (at most 256 "
                                    "characters) or null")
            buckets.append(BucketEntry(i, nb, rb[2], direct))

        raw_tensors = data.get("tensors")
        if not isinstance(raw_tensors, list):
            raise ManifestError("tensors must be a list")
        if len(raw_tensors) > MAX_TENSORS:
            raise ManifestError(f"{len(raw_tensors)} tensors exceed the cap of {MAX_TENSORS}")
        tensors = []
        seen: set[str] = set()
        for rt in raw_tensors:
            tensors.append(_tensor_from_dict(rt, buckets, seen))
        m = cls(
            weight_version=version,
            bucket_bytes=bucket_bytes,
            tensors=tuple(tensors),
            buckets=tuple(buckets),
            checksum=checksum,
            format_version=fv,
            meta=meta,
        )
        _check_no_overlap(m)
        return m


def _int(v: Any, what: str, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ManifestError(f"{what} must be an integer >= {minimum}, got {v!r}")
    return v


def _tensor_from_dict(rt: Any, buckets: list[BucketEntry], seen: set[str]) -> TensorEntry:
    if not isinstance(rt, dict):
        raise ManifestError("each tensor must be a JSON object")
    name = rt.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ManifestError(f"tensor name must be a non-empty string of at most "
                            f"{MAX_NAME_CHARS} characters, got {str(name)[:80]!r}")
    if name in seen:
        raise ManifestError(f"tensor {name!r} appears twice")
    seen.add(name)
    dtype = rt.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise ManifestError(f"tensor {name!r}: unsupported dtype {dtype!r}")
    shape = rt.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ManifestError(f"tensor {name!r}: shape must be a list of integers >= 0")
    raw_pieces = rt.get("pieces")
    if not isinstance(raw_pieces, list):
        raise ManifestError(f"tensor {name!r}: pieces must be a list")
    pieces = []
    expect_start = 0
    for rp in raw_pieces:
        if not (isinstance(rp, list) and len(rp) == 4):
            raise ManifestError(f"tensor {name!r}: a piece must be [bucket, offset, start, nbytes]")
        b, off, start, nb = (_int(x, f"tensor {name!r} piece field") for x in rp)
        if b >= len(buckets):
            raise ManifestError(f"tensor {name!r}: piece names bucket {b}, which does not exist")
        if start != expect_start:
            raise ManifestError(f"tensor {name!r}: pieces are not contiguous at byte {start}")
        if off % DTYPE_SIZES[dtype]:
            raise ManifestError(f"tensor {name!r}: piece offset {off} is not aligned")
        if off + nb > buckets[b].nbytes:
            raise ManifestError(f"tensor {name!r}: piece runs past the end of bucket {b}")
        pieces.append(Piece(b, off, start, nb))
        expect_start += nb
    entry = TensorEntry(name, dtype, tuple(shape), tuple(pieces))
    if expect_start != entry.nbytes:
        raise ManifestError(
            f"tensor {name!r}: pieces carry {expect_start} bytes but {dtype}{list(shape)} "
            f"needs {entry.nbytes}"
        )
    return entry


def _check_no_overlap(m: Manifest) -> None:
    for index, pairs in enumerate(m.by_bucket()):
        if m.buckets[index].direct and not (
            len(pairs) == 1 and pairs[0][1].offset == 0
            and pairs[0][1].nbytes == m.buckets[index].nbytes
        ):
            raise ManifestError(f"bucket {index} is direct but does not hold exactly one "
                                "piece filling it from offset 0")
        end = 0
        for t, p in pairs:
            if p.offset < end:
                raise ManifestError(f"tensor {t.name!r} overlaps another in bucket {index}")
            end = p.offset + p.nbytes


#: The manifest's `meta` key listing each sender's run of buckets and tensors (`plan`
#: with `parts`; `core/senders.py` reads it).
SENDERS_KEY = "senders"


def plan(
    specs: Iterable[TensorSpec] = (),
    *,
    weight_version: int | str,
    bucket_bytes: int,
    checksum: str | None = "crc32",
    split: bool = True,
    meta: Mapping[str, Any] | None = None,
    direct_min: int | None = None,
    parts: Sequence[Sequence[TensorSpec]] | None = None,
) -> Manifest:
    """Lay `specs` into buckets in stream order: the one plan of an update, whether one
    trainer rank sends it or several.

    With `split`, a tensor larger than `bucket_bytes` is cut into bucket-sized pieces;
    without it (disk shards, where a file holds whole tensors) it gets a bucket of its own.
    With `direct_min` (split transports that can send from a tensor's own storage), a
    tensor of at least that many bytes, or that fills a bucket, gets direct buckets of
    its own (module docstring): packing it would be a full extra pass over its bytes on
    each side.

    With `parts` (instead of `specs`), the update is sent by `len(parts)` trainer ranks,
    sender j sending `parts[j]` (`docs/scale.md`): each sender's tensors are laid out as
    above in buckets of their own, and `meta["senders"]` lists each sender's run
    `[first_bucket, n_buckets, first_tensor, n_tensors]`, so the signed manifest names
    the sender of every bucket (`core/senders.parts` cuts it back into each sender's
    part). A name planned by two senders is refused.
    """
    if parts is not None:
        if any(True for _ in specs):
            raise ManifestError("plan() takes either specs (one sender) or parts, not both")
        return _plan_parts(parts, weight_version=weight_version, bucket_bytes=bucket_bytes,
                           checksum=checksum, split=split, meta=meta, direct_min=direct_min)
    if bucket_bytes < ALIGN:
        raise ManifestError(f"bucket_bytes must be at least {ALIGN}, got {bucket_bytes}")
    tensors: list[TensorEntry] = []
    sizes: list[int] = []
    used = 0  # bytes used in the open bucket, sizes[-1] once a bucket is open

    def open_bucket() -> None:
        nonlocal used
        sizes.append(0)
        used = 0

    seen: set[str] = set()
    direct: set[int] = set()
    for s in specs:
        if s.dtype not in DTYPE_SIZES:
            raise ManifestError(f"tensor {s.name!r}: unsupported dtype {s.dtype!r}")
        if s.name in seen:
            raise ManifestError(f"tensor {s.name!r} appears twice in the stream")
        seen.add(s.name)
        n = s.nbytes
        pieces: list[Piece] = []
        if split and direct_min is not None and n and n >= min(direct_min, bucket_bytes):
            done = 0
            while done < n:
                open_bucket()
                take = min(bucket_bytes, n - done)
                pieces.append(Piece(len(sizes) - 1, 0, done, take))
                sizes[-1] = take
                direct.add(len(sizes) - 1)
                done += take
            used = bucket_bytes  # closed: the next tensor opens a bucket of its own
        elif n <= bucket_bytes or not split:
            start = _align(used)
            if not sizes or (start + n > bucket_bytes and used > 0):
                open_bucket()
                start = 0
            if n:
                pieces.append(Piece(len(sizes) - 1, start, 0, n))
                used = start + n
                sizes[-1] = used
        else:
            done = 0
            while done < n:
                open_bucket()
                take = min(bucket_bytes, n - done)
                pieces.append(Piece(len(sizes) - 1, 0, done, take))
                used = take
                sizes[-1] = used
                done += take
        tensors.append(TensorEntry(s.name, s.dtype, tuple(s.shape), tuple(pieces)))
    buckets = tuple(BucketEntry(i, nb, None, i in direct) for i, nb in enumerate(sizes))
    merged_meta = dict(meta or {})
    if not split:
        merged_meta["unsplit"] = True
    return Manifest(
        weight_version=weight_version,
        bucket_bytes=bucket_bytes,
        tensors=tuple(tensors),
        buckets=buckets,
        checksum=checksum,
        format_version=DIRECT_FORMAT_VERSION if direct else FORMAT_VERSION,
        meta=merged_meta,
    )


def _plan_parts(parts: Sequence[Sequence[TensorSpec]], *, weight_version: int | str,
                bucket_bytes: int, checksum: str | None, split: bool,
                meta: Mapping[str, Any] | None, direct_min: int | None) -> Manifest:
    """`plan` with several senders: each part planned alone, then concatenated."""
    if not parts:
        raise ManifestError("an update needs at least one sender")
    base = {k: v for k, v in (meta or {}).items() if k != SENDERS_KEY}
    planned = [plan(p, weight_version=weight_version, bucket_bytes=bucket_bytes,
                    checksum=checksum, split=split, meta=base, direct_min=direct_min)
               for p in parts]
    buckets: list[list[Any]] = []
    tensors: list[dict[str, Any]] = []
    ranges: list[list[int]] = []
    version = 1
    for m in planned:
        d = m.to_dict()
        version = max(version, int(d["format_version"]))
        first_b, first_t = len(buckets), len(tensors)
        buckets += [[first_b + rb[0], *rb[1:]] for rb in d["buckets"]]
        for t in d["tensors"]:
            t["pieces"] = [[first_b + p[0], *p[1:]] for p in t["pieces"]]
            tensors.append(t)
        ranges.append([first_b, len(d["buckets"]), first_t, len(d["tensors"])])
    whole = planned[0].to_dict()
    whole.update(format_version=version, buckets=buckets, tensors=tensors,
                 meta={**base, SENDERS_KEY: ranges})
    return Manifest.from_dict(whole)

"""Several trainer ranks sending one update: who sends which tensor, each sender's part of
the one manifest they share, and the order they send its buckets in (pure functions;
`docs/scale.md`).

One update from k senders is **one manifest** (one update id, one signature), planned
by `core/manifest.plan(parts=...)`: sender j's tensors, in its own stream order, packed
into buckets of their own, and the manifest's `meta["senders"]` lists, per sender, its
run of buckets and tensors: `[[first_bucket, n_buckets, first_tensor, n_tensors], ...]`
in sender order. The trainer signs the manifest, so the signature covers which sender
sends which bucket.

Each side derives sender j's **part** from it with `parts`: a manifest of its own
(buckets renumbered from 0, `meta` naming the part and the whole update's id). Sender j
packs its part and receivers unpack it with the ordinary single-sender code, so every
bucket is checked exactly as before (trailer, manifest id, index, size, digest, MAC):
a bucket of part j carries part j's id, which no other part or update has, so it cannot
be replayed as another sender's bucket.

The **send order** (`send_order`, `order_of`): ranks that gather in lockstep send their
buckets in an order fixed by the stream; the coordinator writes it into the manifest
(`meta["order"]`) and NCCL workers receive the buckets of every part in exactly that
order (why: `transports/multisender.py`).

Pure functions of manifests and specs, in `core/` because both sides use them: the
trainer's coordinator (`control/`) and the engine worker's receiver (`transports/`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from enginehooks.core.buckets import manifest_id
from enginehooks.core.errors import ConfigError, ManifestError
from enginehooks.core.manifest import SENDERS_KEY, Manifest, TensorSpec

#: The manifest's `meta` key listing its buckets (global indices) in the send order.
ORDER_KEY = "order"

__all__ = ["ORDER_KEY", "SENDERS_KEY", "assign_balanced", "decide_parts", "only", "order_of",
           "parts", "send_order", "sender_ranges", "split_specs"]

def assign_balanced(specs: Sequence[TensorSpec], senders: int) -> list[int]:
    """The sender of each tensor (in stream order) when every sender holds every tensor
    (FSDP ranks iterate the whole stream in lockstep). Largest first, each to the
    sender with the fewest bytes so far (lowest rank on a tie): the busiest sender ends
    within the largest tensor of the others, wherever the big tensors sit in the stream
    (an embedding first, an untied head last). Tensors of equal size keep their stream
    order, so a run of layers is dealt round robin and the senders' parts interleave
    along the stream (ranks that gather in lockstep all have something to send)."""
    if senders < 1:
        raise ConfigError(f"senders must be >= 1, got {senders}")
    loads = [0] * senders
    owners = [0] * len(specs)
    for i in sorted(range(len(specs)), key=lambda i: -specs[i].nbytes):
        j = min(range(senders), key=lambda r: (loads[r], r))
        owners[i] = j
        loads[j] += max(specs[i].nbytes, 1)
    return owners


def split_specs(specs: Sequence[TensorSpec], owners: Sequence[int],
                senders: int) -> list[list[TensorSpec]]:
    """`specs` grouped by owner, each group in stream order."""
    if len(owners) != len(specs):
        raise ConfigError(f"{len(owners)} owners for {len(specs)} tensors")
    out: list[list[TensorSpec]] = [[] for _ in range(senders)]
    for s, j in zip(specs, owners):
        if not 0 <= j < senders:
            raise ConfigError(f"tensor {s.name!r}: sender {j} is outside 0..{senders - 1}")
        out[j].append(s)
    return out


def decide_parts(per_rank: Sequence[Sequence[TensorSpec]]) -> list[list[TensorSpec]]:
    """Which tensors each trainer rank sends, from what each rank says it can stream:
    every rank the same tensors (ranks that each produce the whole model, such as FSDP
    ranks gathering in lockstep): a balanced assignment (`assign_balanced`); tensors no
    two ranks share (each rank owns its part): its own. Anything else is refused,
    naming a tensor two ranks both offer."""
    if not per_rank:
        raise ManifestError("no trainer rank offered any tensor")
    first = list(per_rank[0])
    if all(list(p) == first for p in per_rank[1:]):
        return split_specs(first, assign_balanced(first, len(per_rank)), len(per_rank))
    seen: dict[str, int] = {}
    for j, specs in enumerate(per_rank):
        for s in specs:
            if s.name in seen:
                raise ManifestError(
                    f"trainer ranks {seen[s.name]} and {j} both stream {s.name!r}, but not the "
                    "same tensors: every rank must stream either the whole model or only the "
                    "tensors it owns")
            seen[s.name] = j
    return [list(p) for p in per_rank]


def sender_ranges(manifest: Manifest) -> list[tuple[int, int, int, int]]:
    """`meta["senders"]` validated: contiguous runs that cover every bucket and tensor
    in order, each tensor's pieces inside its sender's buckets. A manifest without the
    key has one sender."""
    raw = manifest.meta.get(SENDERS_KEY)
    if raw is None:
        return [(0, len(manifest.buckets), 0, len(manifest.tensors))]
    if not isinstance(raw, list) or not raw or len(raw) > 65536:
        raise ManifestError(f"meta.senders must be a non-empty list, got {str(raw)[:200]}")
    out: list[tuple[int, int, int, int]] = []
    nb = nt = 0
    for j, r in enumerate(raw):
        if (not isinstance(r, list) or len(r) != 4
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)):
            raise ManifestError(f"meta.senders[{j}] must be 4 integers >= 0, got {r!r}")
        if r[0] != nb or r[2] != nt:
            raise ManifestError(f"meta.senders[{j}] = {r}: runs must be contiguous (expected "
                                f"buckets from {nb}, tensors from {nt})")
        nb, nt = nb + r[1], nt + r[3]
        out.append((r[0], r[1], r[2], r[3]))
    if nb != len(manifest.buckets) or nt != len(manifest.tensors):
        raise ManifestError(f"meta.senders covers {nb} buckets and {nt} tensors; the manifest "
                            f"has {len(manifest.buckets)} and {len(manifest.tensors)}")
    for j, (fb, cb, ft, ct) in enumerate(out):
        for t in manifest.tensors[ft:ft + ct]:
            if any(not fb <= p.bucket < fb + cb for p in t.pieces):
                raise ManifestError(f"tensor {t.name!r} of sender {j} has a piece outside "
                                    f"that sender's buckets {fb}..{fb + cb - 1}")
    return out


def parts(manifest: Manifest) -> list[Manifest]:
    """Each sender's part of `manifest`, as a manifest of its own (module docstring).
    Both sides derive it from the signed manifest; a manifest of one sender without the
    key is its own single part."""
    if SENDERS_KEY not in manifest.meta:
        return [manifest]
    ranges = sender_ranges(manifest)
    d = manifest.to_dict()
    update = f"{manifest_id(manifest):016x}"
    meta = {k: v for k, v in d["meta"].items() if k != SENDERS_KEY}
    out = []
    for j, (fb, cb, ft, ct) in enumerate(ranges):
        tensors = []
        for t in d["tensors"][ft:ft + ct]:
            tensors.append({**t, "pieces": [[p[0] - fb, *p[1:]] for p in t["pieces"]]})
        part = {**d, "buckets": [[rb[0] - fb, *rb[1:]] for rb in d["buckets"][fb:fb + cb]],
                "tensors": tensors,
                "meta": {**meta, "part": j, "parts": len(ranges), "update": update}}
        out.append(Manifest.from_dict(part))
    return out


def send_order(manifest: Manifest, stream: Sequence[str]) -> list[int] | None:
    """The order in which the trainer ranks send `manifest`'s buckets when every rank
    iterates the same `stream` (tensor names in stream order) in lockstep and sends its
    part with `BroadcastSender.send` (module docstring): `core/buckets.pack` sends a
    bucket while it packs the first tensor with a piece in a later bucket (a direct
    bucket while it packs its tensor), and the rest once the stream has ended. None
    where a tensor of the manifest is not in `stream`."""
    where = {name: i for i, name in enumerate(stream)}
    end = len(stream)
    keyed: list[tuple[int, int, int]] = []  # (stream position, sender, global index)
    for j, (part, (first, _nb, _ft, _nt)) in enumerate(zip(parts(manifest),
                                                             sender_ranges(manifest))):
        index = 0
        for entry in part.tensors:
            if entry.name not in where:
                return None
            at = where[entry.name]
            for piece in entry.pieces:
                while piece.bucket > index:
                    keyed.append((at, j, first + index))
                    index += 1
                if part.buckets[index].direct:
                    keyed.append((at, j, first + index))
                    index += 1
        while index < len(part.buckets):
            keyed.append((end, j, first + index))
            index += 1
    return [g for _at, _j, g in sorted(keyed)]


def order_of(manifest: Manifest) -> list[tuple[int, int]] | None:
    """`meta["order"]` as (sender, bucket of its part) pairs, checked: every bucket once,
    each sender's buckets in their own order. None where the manifest has no order."""
    raw = manifest.meta.get(ORDER_KEY)
    if raw is None:
        return None
    n = len(manifest.buckets)
    if (not isinstance(raw, list) or len(raw) != n
            or not all(isinstance(g, int) and not isinstance(g, bool) for g in raw)
            or sorted(raw) != list(range(n))):
        raise ManifestError(f"meta.{ORDER_KEY} must list each of the {n} buckets once, got "
                            f"{str(raw)[:200]}")
    owner: dict[int, tuple[int, int]] = {}
    for j, (first, count, _ft, _nt) in enumerate(sender_ranges(manifest)):
        for k in range(count):
            owner[first + k] = (j, k)
    out = [owner[g] for g in raw]
    last: dict[int, int] = {}
    for j, k in out:
        if k != last.get(j, -1) + 1:
            raise ManifestError(f"meta.{ORDER_KEY} sends bucket {k} of sender {j} out of "
                                "that sender's order")
        last[j] = k
    return out


def only(stream: Iterable[tuple[str, torch.Tensor]], names: set[str]
         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The items of `stream` named in `names` (the whole stream is still iterated: on a
    sharded trainer each step may be a collective every rank must enter)."""
    for name, t in stream:
        if name in names:
            yield name, t

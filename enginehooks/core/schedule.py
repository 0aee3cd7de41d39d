"""The static schedule (issue 40): which trainer rank sends which bytes of which
checkpoint tensor to which engine rank, so that every engine rank receives only its
slice and every byte crosses the network once (`docs/scale.md`, part 3). Pure functions,
for both sides: computed once per layout on the trainer, shipped in the signed manifest
(`wire/schedule.py`), and read back by every engine rank.

Inputs, both in checkpoint layout (the flat bytes of each checkpoint tensor in its wire
dtype):
- what each trainer rank **holds** (`Slice`s): an FSDP2 rank its dim-0 shard of every
  parameter (`dim0_shards`; `trainer_side/fsdp.py` reads it from the DTensors'
  placements), a replicated parameter on every rank that has it; Megatron's partitions
  through the bridge are not derived yet;
- what each engine rank **needs**: the source bytes its loader reads, learned from the
  engine's own loader by the copy plan (`engine/shard_direct.py` turns each planned
  `Step`'s `src` view into byte runs with `view_slices`). A tensor that stays on the
  loader is needed whole by every rank that loads it.

`schedule` computes it: every byte an engine rank needs is sent to it exactly once, by
one trainer rank that holds it, and no engine rank receives a byte it does not need.
Where several trainer ranks hold a byte, the one with the fewest bytes to send so far
sends it (the egress links are the bottleneck across nodes); ties keep the previous
sender of the same run, so runs stay long.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from enginehooks.core.errors import ConfigError


class ScheduleError(ConfigError):
    """Some bytes an engine rank needs are held by no trainer rank."""


@dataclass(frozen=True, order=True)
class Slice:
    """Bytes [start, stop) of the checkpoint tensor `name`."""

    name: str
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ConfigError(f"slice of {self.name!r}: [{self.start}, {self.stop}) is not a range")


@dataclass(frozen=True, order=True)
class Transfer:
    """Trainer rank `src` sends bytes [start, stop) of `name` to engine rank `dst`."""

    src: int
    dst: int
    name: str
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def view_slices(name: str, offset: int, sizes: Sequence[int], strides: Sequence[int],
                itemsize: int) -> list[Slice]:
    """The byte runs of a strided view (element `offset`, `sizes`, `strides`, as a copy
    plan's `View`) of the contiguous checkpoint tensor `name`, merged where adjacent:
    a dim-0 narrow is one run, a dim-1 narrow of a matrix one run per row."""
    dims = [(s, st) for s, st in zip(sizes, strides) if s != 1]
    if any(s == 0 for s in sizes):
        return []
    # the innermost dims that are contiguous form one run
    run, expected = 1, 1
    while dims and dims[-1][1] == expected:
        s, _ = dims.pop()
        run *= s
        expected *= s
    starts = [offset]
    for s, st in dims:
        starts = [b + i * st for b in starts for i in range(s)]
    out: list[Slice] = []
    for b in sorted(starts):
        lo, hi = b * itemsize, (b + run) * itemsize
        if out and out[-1].stop == lo:
            out[-1] = Slice(name, out[-1].start, hi)
        else:
            out.append(Slice(name, lo, hi))
    return out


def _by_name(per_rank: Mapping[int, Iterable[Slice]]) -> dict[str, list[tuple[int, int, int]]]:
    out: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for rank, slices in per_rank.items():
        for s in slices:
            if s.stop > s.start:
                out[s.name].append((s.start, s.stop, rank))
    return out


def schedule(holds: Mapping[int, Iterable[Slice]],
             needs: Mapping[int, Iterable[Slice]]) -> list[Transfer]:
    """The transfers that give every engine rank exactly the bytes it needs (module
    docstring), sorted by (src, dst, name, start)."""
    held, needed = _by_name(holds), _by_name(needs)
    load: dict[int, int] = defaultdict(int)
    out: list[Transfer] = []
    for name in sorted(needed):
        hs, ns = held.get(name, []), needed[name]
        points = sorted({p for a, b, _ in hs + ns for p in (a, b)})
        last: dict[int, int] = {}  # dst -> the src of its previous run
        for a, b in itertools.pairwise(points):
            holders = sorted({r for s, e, r in hs if s <= a and b <= e})
            for dst in sorted({r for s, e, r in ns if s <= a and b <= e}):
                if not holders:
                    raise ScheduleError(
                        f"engine rank {dst} needs bytes [{a}, {b}) of {name!r}, which no "
                        "trainer rank holds: the trainer's and the engine's layouts disagree")
                prev = last.get(dst)
                src = min(holders, key=lambda r: (load[r] - (1 if r == prev else 0), r))
                load[src] += b - a
                last[dst] = src
                t = out[-1] if out else None
                if t is not None and (t.src, t.dst, t.name, t.stop) == (src, dst, name, a):
                    out[-1] = Transfer(src, dst, name, t.start, b)
                else:
                    out.append(Transfer(src, dst, name, a, b))
    return _merge(sorted(out))


def _merge(transfers: list[Transfer]) -> list[Transfer]:
    out: list[Transfer] = []
    for t in transfers:
        p = out[-1] if out else None
        if p is not None and (p.src, p.dst, p.name, p.stop) == (t.src, t.dst, t.name, t.start):
            out[-1] = Transfer(p.src, p.dst, p.name, p.start, t.stop)
        else:
            out.append(t)
    return out


def link_bytes(transfers: Iterable[Transfer]) -> tuple[dict[int, int], dict[int, int]]:
    """(bytes each trainer rank sends, bytes each engine rank receives)."""
    egress: dict[int, int] = defaultdict(int)
    ingress: dict[int, int] = defaultdict(int)
    for t in transfers:
        egress[t.src] += t.nbytes
        ingress[t.dst] += t.nbytes
    return dict(egress), dict(ingress)


def floor_seconds(transfers: Iterable[Transfer], egress_bps: float, ingress_bps: float) -> float:
    """The link-rate floor of a schedule: its busiest link's bytes over that link's rate
    (bytes per second), each trainer rank's egress and each engine rank's ingress."""
    egress, ingress = link_bytes(transfers)
    return max([b / egress_bps for b in egress.values()]
               + [b / ingress_bps for b in ingress.values()] + [0.0])


def dim0_shards(name: str, shape: Sequence[int], itemsize: int, world: int
                ) -> dict[int, Slice]:
    """The bytes of checkpoint tensor `name` (`shape`, `itemsize` bytes per element)
    that each of `world` ranks holds when it is sharded on dim 0 as FSDP2's `Shard(0)`
    cuts it (`torch.chunk`: ceil(rows / world) rows each, the last ranks short or empty).
    A 0-dim tensor is held whole by rank 0 only (FSDP2 does not shard scalars; every rank
    holds it, and one is enough to send it)."""
    if world < 1:
        raise ConfigError(f"world {world}: at least one rank")
    if len(shape) == 0:
        return {0: Slice(name, 0, itemsize)}
    rows = int(shape[0])
    row_bytes = itemsize
    for s in shape[1:]:
        row_bytes *= int(s)
    chunk = -(-rows // world) if rows else 0
    out: dict[int, Slice] = {}
    for r in range(world):
        lo, hi = min(rows, r * chunk), min(rows, (r + 1) * chunk)
        if hi > lo:
            out[r] = Slice(name, lo * row_bytes, hi * row_bytes)
    return out

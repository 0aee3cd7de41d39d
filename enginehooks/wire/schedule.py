"""The static schedule as it travels (issue 40): `meta["schedule"]` of the signed manifest.

The trainer computes the schedule once per layout (`core/schedule.py`) and writes it into
the manifest it signs, so every engine rank reads, from text the trainer signed, exactly
which trainer rank sends it which bytes of which tensor. Each engine rank refuses a
schedule it cannot trust before a byte moves (`MalformedSchedule`): a transfer naming a
rank outside the group, a tensor the manifest does not carry, a range outside the
tensor, or two transfers giving one engine rank the same byte (a second sender could
overwrite what the first one sent, and the digests of both would pass).

The other half travels the other way: each engine worker's `info` reports, under
`NEEDS_KEY`, the byte runs of every checkpoint tensor its loader reads (from the copy
plan it recorded, `engine/shard_direct.needs_of`), each with the dtype the runs are
counted in (`needs_to_wire`). The trainer reads them with `needs_from_wire`, which
refuses what it cannot schedule from (`MalformedNeeds`): a tensor of the update the
worker says nothing about (its layout for it is unknown: it would be sent nothing), runs
counted in another dtype than the update sends (every byte offset would be wrong), and
runs that are not ranges of the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from enginehooks.core.errors import ConfigError, ManifestError
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.core.schedule import Slice, Transfer

#: The manifest's `meta` key that holds the schedule.
SCHEDULE_KEY = "schedule"


#: The manifest memo (`core/manifest.MID_MEMO`'s comment) holding its schedule as read:
#: a prepared push (`core/layout.with_version`) carries it, so no party reads the
#: schedule of a layout twice.
SCHEDULE_MEMO = "_enginehooks_schedule"

#: `info`'s key: the byte runs each checkpoint tensor this worker's loader reads.
NEEDS_KEY = "needs"

#: `info`'s key: a digest of those needs, in every `info` once they were computed for
#: the worker's current copy plan (a trainer that holds needs under this digest for the
#: same worker asks for them no more: once per layout)
NEEDS_DIGEST_KEY = "needs_key"


class MalformedSchedule(ManifestError):
    """A manifest's schedule that an engine rank cannot follow or trust."""


class MalformedNeeds(ConfigError):
    """An engine worker's reported needs that the trainer cannot schedule from."""


def needs_to_wire(needs: Iterable[Slice], specs: Iterable[TensorSpec]
                  ) -> dict[str, dict[str, Any]]:
    """`info`'s `needs`: for every tensor of `specs` (those the worker's plan recorded),
    its dtype and the byte runs `needs` gives it (none: the loader reads none of it).
    Evenly spaced runs of one length travel as one `[start, stop, step, count]` (a
    row-parallel slice is one run per row: thousands per tensor otherwise); a lone run
    as `[start, stop]`."""
    out: dict[str, dict[str, Any]] = {s.name: {"dtype": s.dtype, "runs": []} for s in specs}
    for n in needs:
        runs = out[n.name]["runs"]
        last = runs[-1] if runs else None
        if last is not None and n.stop - n.start == last[1] - last[0]:
            step = n.start - last[0] if len(last) == 2 else last[2]
            if len(last) == 2 and step > 0:
                runs[-1] = [last[0], last[1], step, 2]
                continue
            if len(last) == 4 and n.start == last[0] + last[3] * step:
                last[3] += 1
                continue
        runs.append([n.start, n.stop])
    return out


def _runs(name: str, run: Any, nbytes: int, who: str) -> list[Slice]:
    """The byte runs of one `runs` item (`needs_to_wire`), checked."""
    ok = isinstance(run, list) and len(run) in (2, 4) and all(_index(v) for v in run) \
        and run[0] < run[1]
    if ok and len(run) == 4:
        start, stop, step, count = run
        ok = step >= stop - start and count >= 1 \
            and stop + (count - 1) * step <= nbytes
        if ok:
            return [Slice(name, start + i * step, stop + i * step) for i in range(count)]
    if not ok or run[1] > nbytes:
        raise MalformedNeeds(f"{who}: {str(run)[:60]} is not a range of "
                             f"{name!r}'s {nbytes} bytes")
    return [Slice(name, run[0], run[1])]


def needs_from_wire(raw: Any, specs: Iterable[TensorSpec], who: str) -> list[Slice]:
    """The byte runs of `specs` (the update's tensors, in their wire dtypes) that worker
    `who` reported in `info`'s `needs`, checked (module docstring)."""
    if not isinstance(raw, dict):
        raise MalformedNeeds(f"{who}: reports no needs (no copy plan recorded yet)")
    out: list[Slice] = []
    for spec in specs:
        item = raw.get(spec.name)
        if not isinstance(item, dict) or not isinstance(item.get("runs"), list):
            raise MalformedNeeds(f"{who}: says nothing about tensor {spec.name!r}: its layout "
                                 "for it is unknown")
        if item.get("dtype") != spec.dtype:
            raise MalformedNeeds(f"{who}: counts the bytes of {spec.name!r} in "
                                 f"{item.get('dtype')!r}; the update sends {spec.dtype}")
        for run in item["runs"]:
            out += _runs(spec.name, run, spec.nbytes, who)
    return out


@dataclass(frozen=True)
class ShardSchedule:
    """Which trainer rank (`src` < `senders`) sends which bytes of which tensor to which
    engine rank (`dst` < `receivers`), in the order both sides post them."""

    senders: int
    receivers: int
    transfers: tuple[Transfer, ...]
    #: engine rank e's worker id (`info`'s `instance`), so each worker finds its rank in
    #: the text the trainer signed (`rank_of`); empty: ranks are given another way
    instances: tuple[str, ...] = ()

    def to_meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "senders": self.senders, "receivers": self.receivers,
            "transfers": [[t.src, t.dst, t.name, t.start, t.stop] for t in self.transfers]}
        if self.instances:
            out["instances"] = list(self.instances)
        return out

    def rank_of(self, instance: str) -> int:
        """The engine rank the schedule gives worker `instance`; a worker it does not
        name refuses it (it would land another worker's bytes, or none)."""
        if instance not in self.instances:
            raise MalformedSchedule(f"the schedule names no engine rank for worker {instance}")
        return self.instances.index(instance)

    def bytes_to(self, dst: int) -> dict[str, int]:
        """How many bytes of each tensor the schedule sends engine rank `dst` (`_kept`).
        Read only."""
        def per_tensor() -> dict[str, int]:
            out: dict[str, int] = {}
            for t in self.transfers:
                if t.dst == dst:
                    out[t.name] = out.get(t.name, 0) + t.nbytes
            return out

        return cast("dict[str, int]", self._kept("bytes_to", dst, per_tensor))

    def count_from(self, src: int) -> int:
        """How many transfers trainer rank `src` sends (`_kept`)."""
        return cast(int, self._kept("count_from", src,
                                    lambda: sum(1 for t in self.transfers if t.src == src)))

    def _kept(self, what: str, rank: int, compute: Callable[[], object]) -> object:
        """`compute()` for one rank: one pass over the transfers per schedule, answer and
        rank, kept with the schedule (a prepared push's schedule is the same object,
        `SCHEDULE_MEMO`)."""
        memo: dict[tuple[str, int], object] = self.__dict__.setdefault("_kept_answers", {})
        key = (what, rank)
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def into(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """`meta` with this schedule under `SCHEDULE_KEY` (for `plan(meta=...)`)."""
        return {**meta, SCHEDULE_KEY: self.to_meta()}

    @staticmethod
    def of(manifest: Manifest) -> ShardSchedule:
        """The schedule of `manifest`, checked against its tensors (module docstring);
        read once per manifest layout (`SCHEDULE_MEMO`)."""
        memo = manifest.__dict__.get(SCHEDULE_MEMO)
        if isinstance(memo, ShardSchedule):
            return memo
        raw = manifest.meta.get(SCHEDULE_KEY)
        if not isinstance(raw, dict):
            raise MalformedSchedule("the manifest carries no schedule")
        sizes = {t.name: t.nbytes for t in manifest.tensors}
        out = ShardSchedule.from_meta(raw, sizes)
        manifest.__dict__[SCHEDULE_MEMO] = out  # frozen dataclass: a memo, not a field
        return out

    @staticmethod
    def from_meta(raw: Mapping[str, Any], sizes: Mapping[str, int]) -> ShardSchedule:
        senders, receivers, items = raw.get("senders"), raw.get("receivers"), raw.get("transfers")
        if not (_count(senders) and _count(receivers) and isinstance(items, list)):
            raise MalformedSchedule(f"a schedule needs senders, receivers and transfers: "
                                    f"{str(dict(raw))[:200]}")
        out = _transfers(items, int(senders), int(receivers), sizes)  # type: ignore[arg-type]
        instances = raw.get("instances", [])
        if not (isinstance(instances, list) and all(isinstance(i, str) for i in instances)
                and len(set(instances)) == len(instances)
                and len(instances) in (0, receivers)):
            raise MalformedSchedule(f"instances {str(instances)[:200]}: not {receivers} "
                                    "distinct worker ids")
        return ShardSchedule(senders, receivers, out,  # type: ignore[arg-type]
                             tuple(instances))


def _transfers(items: list[Any], senders: int, receivers: int, sizes: Mapping[str, int]
               ) -> tuple[Transfer, ...]:
    """`items` checked and read as transfers. A row-parallel schedule is tens of
    thousands of items, read again on every push: the checks run as whole columns
    (`_columns`), and the transfers of the last schedule read are kept and given again
    for the same items (so the compiled peers of `transports/shard_runs.py` find them by
    identity). Anything the column checks do not pass is read item by item, which names
    the first bad one."""
    cols = _columns(items, senders, receivers, sizes)
    if cols is None:
        return _transfers_one_by_one(items, senders, receivers, sizes)
    key = tuple(map(tuple, items))
    last = _LAST_READ[0] if _LAST_READ else None
    if last is not None and last[0] == key:
        return last[1]
    out = tuple(map(Transfer, *cols))
    _LAST_READ[:] = [(key, out)]
    return out


#: the last schedule's items (as tuples) and the transfers read from them
_LAST_READ: list[tuple[tuple[tuple[Any, ...], ...], tuple[Transfer, ...]]] = []


def _columns(items: list[Any], senders: int, receivers: int, sizes: Mapping[str, int]
             ) -> tuple[tuple[Any, ...], ...] | None:
    """The five columns of `items` where every item is a list of five plain ints and a
    str naming a tensor of `sizes`, ranks within the group, ranges within their tensor
    and no byte given twice to one engine rank; else None."""
    import numpy as np

    if not items:
        return None
    if set(map(type, items)) != {list} or set(map(len, items)) != {5}:
        return None
    cols = tuple(zip(*items))
    if any(set(map(type, cols[i])) != {int} for i in (0, 1, 3, 4)) \
            or set(map(type, cols[2])) != {str} or not set(cols[2]) <= sizes.keys():
        return None
    try:
        src, dst, start, stop = (np.array(cols[i], dtype=np.int64) for i in (0, 1, 3, 4))
    except OverflowError:
        return None
    index = {n: i for i, n in enumerate(sizes)}
    name = np.fromiter(map(index.__getitem__, cols[2]), np.int64, len(items))
    size = np.fromiter(map(sizes.__getitem__, cols[2]), np.int64, len(items))
    if not ((src >= 0) & (src < senders) & (dst >= 0) & (dst < receivers)
            & (start >= 0) & (start < stop) & (stop <= size)).all():
        return None
    order = np.lexsort((start, name, dst))  # as `_disjoint` sorts
    same = (dst[order][1:] == dst[order][:-1]) & (name[order][1:] == name[order][:-1])
    if (same & (start[order][1:] < stop[order][:-1])).any():
        return None
    return cols


def _transfers_one_by_one(items: list[Any], senders: int, receivers: int,
                          sizes: Mapping[str, int]) -> tuple[Transfer, ...]:
    out = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 5 and isinstance(item[2], str)
                and all(_index(v) for i, v in enumerate(item) if i != 2)):
            raise MalformedSchedule(f"not a transfer: {str(item)[:100]}")
        src, dst, name, start, stop = item
        if src >= senders or dst >= receivers:
            raise MalformedSchedule(f"transfer {item}: ranks outside {senders} senders "
                                    f"and {receivers} receivers")
        if name not in sizes:
            raise MalformedSchedule(f"transfer {item}: the manifest has no tensor {name!r}")
        if not start < stop <= sizes[name]:
            raise MalformedSchedule(f"transfer {item}: not a range of {name!r}'s "
                                    f"{sizes[name]} bytes")
        out.append(Transfer(src, dst, name, start, stop))
    _disjoint(out)
    return tuple(out)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _disjoint(transfers: Iterable[Transfer]) -> None:
    last: dict[tuple[int, str], Transfer] = {}
    for t in sorted(transfers, key=lambda t: (t.dst, t.name, t.start)):
        prev = last.get((t.dst, t.name))
        if prev is not None and t.start < prev.stop:
            raise MalformedSchedule(
                f"engine rank {t.dst} would receive bytes [{t.start}, {min(t.stop, prev.stop)})"
                f" of {t.name!r} twice (from trainer ranks {prev.src} and {t.src})")
        last[(t.dst, t.name)] = t

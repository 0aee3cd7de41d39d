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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from enginehooks.core.errors import ConfigError, ManifestError
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.core.schedule import Slice, Transfer

#: The manifest's `meta` key that holds the schedule.
SCHEDULE_KEY = "schedule"


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

    def into(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """`meta` with this schedule under `SCHEDULE_KEY` (for `plan(meta=...)`)."""
        return {**meta, SCHEDULE_KEY: self.to_meta()}

    @staticmethod
    def of(manifest: Manifest) -> ShardSchedule:
        """The schedule of `manifest`, checked against its tensors (module docstring)."""
        raw = manifest.meta.get(SCHEDULE_KEY)
        if not isinstance(raw, dict):
            raise MalformedSchedule("the manifest carries no schedule")
        sizes = {t.name: t.nbytes for t in manifest.tensors}
        return ShardSchedule.from_meta(raw, sizes)

    @staticmethod
    def from_meta(raw: Mapping[str, Any], sizes: Mapping[str, int]) -> ShardSchedule:
        senders, receivers, items = raw.get("senders"), raw.get("receivers"), raw.get("transfers")
        if not (_count(senders) and _count(receivers) and isinstance(items, list)):
            raise MalformedSchedule(f"a schedule needs senders, receivers and transfers: "
                                    f"{str(dict(raw))[:200]}")
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
        instances = raw.get("instances", [])
        if not (isinstance(instances, list) and all(isinstance(i, str) for i in instances)
                and len(set(instances)) == len(instances)
                and len(instances) in (0, receivers)):
            raise MalformedSchedule(f"instances {str(instances)[:200]}: not {receivers} "
                                    "distinct worker ids")
        return ShardSchedule(senders, receivers, tuple(out),  # type: ignore[arg-type]
                             tuple(instances))


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

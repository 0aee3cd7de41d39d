"""The coordinator's half of shard-direct's static schedule (issue 40): from what every
engine worker's `info` reports it needs (`wire/schedule.py`, learned from its copy plan)
and what every trainer rank holds (`trainer_side/fsdp.FSDP2Shards.holds`), the schedule,
written into the manifest that the `check` and `receive` tokens sign, so every engine
rank follows, from text the trainer signed, exactly which trainer rank sends it which
bytes.

Engine ranks are numbered as the join numbers a group's members: the replicas in their
registration order, each one's workers in the order its `info` lists them
(`engine_ranks`), the same order `WeightSync` gives rank offsets in.

The schedule binds each engine rank to its worker's id (`info`'s `instance`,
`ShardSchedule.instances`): a worker finds its rank in the signed text, and one the
schedule does not name refuses it.

`ShardPlanner` computes the schedule once per layout: a push whose tensors, holdings and
reported needs are those of the last one reuses its schedule (only the weight version
changes); any difference (an engine restarted with another layout, a trainer resharded)
computes it anew. A worker that reports no needs (no copy plan recorded yet, or the plan
turned off) or needs the trainer cannot schedule from is refused with `MalformedNeeds`,
naming the replica and worker: the caller pushes through the broadcast path then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ConfigError
from enginehooks.core.layout import layout_key
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.schedule import Slice, Transfer, schedule
from enginehooks.trainer_side.fsdp import FSDP2Shards
from enginehooks.wire.schedule import NEEDS_KEY, SCHEDULE_MEMO, ShardSchedule, needs_from_wire


@dataclass(frozen=True)
class EngineRank:
    """One engine rank of the schedule: worker `worker` of replica `replica`."""

    replica: str
    worker: int
    #: the worker's id (`info`'s `instance`): the audience of the tokens it checks
    instance: str | None


def engine_ranks(replicas: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]
                 ) -> list[EngineRank]:
    """The engine ranks of `replicas` ((name, its workers' `info` answers), in
    registration order), in the schedule's order (module docstring)."""
    return [EngineRank(name, w, i.get("instance"))
            for name, infos in replicas for w, i in enumerate(infos)]


class ShardPlanner:
    """Plans shard-direct updates for `senders` trainer ranks (module docstring)."""

    def __init__(self, senders: int) -> None:
        self.senders = senders
        self._key: str | None = None
        self._transfers: tuple[Transfer, ...] | None = None
        #: how many times a schedule was computed (not reused)
        self.computed = 0

    def schedule(self, specs: Sequence[TensorSpec], holds: Mapping[int, Sequence[Slice]],
                 replicas: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]
                 ) -> ShardSchedule:
        """The schedule sending `specs` (in their wire dtypes) from the trainer ranks'
        `holds` to every worker of `replicas`, reused while the layout is the same."""
        ranks = engine_ranks(replicas)
        infos = [i for _, per in replicas for i in per]
        needs = {e: needs_from_wire(info.get(NEEDS_KEY), specs,
                                    f"replica {r.replica!r} worker {r.worker}")
                 for e, (r, info) in enumerate(zip(ranks, infos))}
        key = layout_key([
            self.senders,
            [[s.name, s.dtype, list(s.shape)] for s in specs],
            {str(k): [[s.name, s.start, s.stop] for s in v] for k, v in holds.items()},
            {str(e): [[s.name, s.start, s.stop] for s in v] for e, v in needs.items()},
        ])
        if key != self._key or self._transfers is None:
            self._transfers = tuple(schedule(holds, needs))
            self._key = key
            self.computed += 1
        # each engine rank bound to its worker's id, whenever every worker has one (an
        # engine restarted with the same layout keeps the transfers, not the ids)
        ids = tuple(r.instance for r in ranks if r.instance)
        return ShardSchedule(self.senders, len(ranks), self._transfers,
                             ids if len(ids) == len(ranks) else ())

    def manifest(self, specs: Sequence[TensorSpec], holds: Mapping[int, Sequence[Slice]],
                 replicas: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], *,
                 weight_version: int | str, bucket_bytes: int,
                 meta: Mapping[str, Any] | None = None, **layout: Any) -> Manifest:
        """The update's manifest (`core/manifest.plan`; `layout`: its checksum, ...)
        with the schedule in its `meta` (`wire/schedule.SCHEDULE_KEY`): the text the
        trainer signs."""
        sched = self.schedule(specs, holds, replicas)
        out = plan(list(specs), weight_version=weight_version, bucket_bytes=bucket_bytes,
                   meta=sched.into(dict(meta or {})), **layout)
        # this rank's sender reads the schedule it made, not its text (`SCHEDULE_MEMO`)
        out.__dict__[SCHEDULE_MEMO] = sched
        return out


#: `meta` key of a manifest the `shard` transport broadcasts instead: why no schedule
SCHEDULE_OFF_KEY = "schedule_off"


def shard_source(adapter: Any, rank: int, senders: int) -> FSDP2Shards:
    """Trainer rank `rank`'s own bytes for a schedule of `senders` ranks: the adapter's
    FSDP2 model's local shards under the adapter's checkpoint names, cast to its wire
    dtype (`trainer_side/fsdp.FSDP2Shards`). Refused (`ConfigError`, naming why) where
    the placements are not ones a schedule is derived from, or where the model's mesh
    is not the sender ranks (mesh rank j must be sender j)."""
    model = getattr(adapter, "model", None)
    if model is None:
        raise ConfigError(f"a {type(adapter).__name__} adapter has no model to read "
                          "placements from")
    shards = FSDP2Shards(model, dtype=getattr(adapter, "dtype", None))
    rename = getattr(adapter, "rename", None)
    if callable(rename):
        shards.rename(rename)
    for name, dt in (getattr(adapter, "dtypes", None) or {}).items():
        if name in shards.specs:  # the replicas' exceptions; None: the trainer's own dtype
            shards.specs[name] = (dt or shards.local[name].dtype, shards.specs[name][1])
    if shards.world != senders or shards.rank != rank:
        raise ConfigError(f"the model's mesh has {shards.world} ranks (this one {shards.rank});"
                          f" the senders are {senders} (this one {rank}): shard-direct needs "
                          "mesh rank j to be sender j")
    return shards


def matching(specs: Sequence[TensorSpec], shards: FSDP2Shards) -> None:
    """Refuse (`ConfigError`) a manifest tensor the shards hold in another dtype or
    shape (per-tensor wire dtypes, a conversion on save): the byte offsets would differ."""
    for s in specs:
        held = shards.specs.get(s.name)
        if held is None or dtype_name(held[0]) != s.dtype or tuple(held[1]) != tuple(s.shape):
            raise ConfigError(f"{s.name}: the update sends {s.dtype}{list(s.shape)}; the "
                              f"trainer's shards hold {held}: not schedulable")

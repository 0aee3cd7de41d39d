"""`EngineSide.check` of a manifest with a shard-direct schedule (issue 40): a worker
refuses, at check and before a byte moves, a schedule it cannot follow: malformed, naming
no engine rank for it, with no recorded copy plan to land it with, or leaving bytes its
loader reads unsent. A manifest without a schedule is checked as before.

The workers are `LocalEngine`s over the checkpoint's tensors (so the names, dtypes and
shapes check passes) whose targets hold the copy plan of one rank of a TP=2 module
(`enginehooks_testkit/tp_module.py`), as an engine's `ApplyTarget` holds its own."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from enginehooks.control.shard_schedule import ShardPlanner
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.schedule import Slice, dim0_shards
from enginehooks.engine.copy_plan import PlanState, record_plan
from enginehooks.engine.local import LocalEngine
from enginehooks_testkit import tp_module as tp


def _state() -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in tp.TinyFull(seed=6).state_dict().items()}


def _specs(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()]


def _worker(rank: int, state: dict[str, torch.Tensor], plan_on: bool = True) -> LocalEngine:
    eng = LocalEngine({n: t.clone() for n, t in state.items()}, name=f"w{rank}")
    ps = PlanState("local")
    if plan_on:
        with torch.device("meta"):
            skeleton = tp.TinyTP(rank, 2)
        ps.adopt(record_plan(skeleton, _specs(state), tp.load_weights), None)
    eng.target.plan = ps  # type: ignore[attr-defined]
    return eng


def _setup() -> tuple[list[LocalEngine], Manifest]:
    state = _state()
    workers = [_worker(r, state) for r in range(2)]
    holds: dict[int, list[Slice]] = {0: [], 1: []}
    for n, t in state.items():
        for r, s in dim0_shards(n, tuple(t.shape), t.element_size(), 2).items():
            holds[r].append(s)
    man = ShardPlanner(2).manifest(_specs(state), holds,
                                   [("tp2", [dict(w.side.info(needs=True)) for w in workers])],
                                   weight_version=1, bucket_bytes=1 << 20)
    return workers, man


def _with(man: Manifest, change: Any) -> str:
    raw = copy.deepcopy(dict(man.meta["schedule"]))
    change(raw)
    return dataclasses.replace(man, meta={**man.meta, "schedule": raw}).to_json()


def test_a_schedule_each_worker_can_follow_passes_check() -> None:
    workers, man = _setup()
    for w in workers:
        assert w.side.check(man.to_json()) == []


def test_a_schedule_leaving_a_needed_byte_unsent_is_refused_at_check() -> None:
    workers, man = _setup()
    dropped = man.meta["schedule"]["transfers"][0]  # engine rank dropped[1]'s first range
    text = _with(man, lambda r: r["transfers"].pop(0))
    problems = workers[dropped[1]].side.check(text)
    assert problems and "are not sent to it" in problems[0]
    assert repr(dropped[2]) in problems[0]
    other = workers[1 - dropped[1]].side.check(text)
    assert other == []  # the other rank's bytes are all there


def test_a_schedule_not_naming_this_worker_is_refused_at_check() -> None:
    workers, man = _setup()
    text = _with(man, lambda r: r.update(instances=["x", "y"]))
    assert "no engine rank for worker" in " ".join(workers[0].side.check(text))


def test_a_malformed_schedule_is_refused_at_check() -> None:
    workers, man = _setup()
    text = _with(man, lambda r: r["transfers"].append([5, 0, "embed.weight", 0, 4]))
    assert "ranks outside" in " ".join(workers[0].side.check(text))


def test_a_worker_without_a_plan_refuses_a_schedule_and_checks_plain_manifests() -> None:
    _workers, man = _setup()
    bare = _worker(0, _state(), plan_on=False)
    text = _with(man, lambda r: r.update(instances=[bare.side.instance, "y"]))
    assert "no usable recorded copy plan" in " ".join(bare.side.check(text))
    plain = plan(man.specs(), weight_version=1, bucket_bytes=1 << 20)
    assert bare.side.check(plain.to_json()) == []

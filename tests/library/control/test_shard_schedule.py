"""`control/shard_schedule.py` (issue 40): the coordinator's schedule from the engine
workers' `info` needs and the trainer ranks' holdings, in the manifest the `check` token
signs, computed once per layout. End to end in one process: two workers of one TP=2
module replica (`LocalEngine` with a recorded copy plan) report their needs, the planner
writes the schedule into a signed manifest, each worker verifies the token, reads the
schedule back and lands its transfers (handed over in process; tests/multihost sends
them over gloo), equal to a fresh load."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

from enginehooks import wire
from enginehooks.control.shard_schedule import ShardPlanner, engine_ranks
from enginehooks.core.auth import AuthError, Verifier
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.core.schedule import Slice, dim0_shards
from enginehooks.engine.copy_plan import PlanState, named_tensors, record_plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.shard_direct import ShardLanding
from enginehooks.wire.schedule import NEEDS_KEY, MalformedNeeds, ShardSchedule
from enginehooks_testkit import tp_module as tp

SECRET = b"s" * 32


def _state() -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in tp.TinyFull(seed=4).state_dict().items()}


def _specs(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()]


def _holds(state: dict[str, torch.Tensor], senders: int) -> dict[int, list[Slice]]:
    out: dict[int, list[Slice]] = {r: [] for r in range(senders)}
    for n, t in state.items():
        for r, s in dim0_shards(n, tuple(t.shape), t.element_size(), senders).items():
            out[r].append(s)
    return out


def _worker(rank: int, specs: list[TensorSpec]) -> LocalEngine:
    eng = LocalEngine(tp.TinyTP(rank, 2), name=f"w{rank}")
    with torch.device("meta"):
        skeleton = tp.TinyTP(rank, 2)
    state = PlanState("local")
    state.adopt(record_plan(skeleton, specs, tp.load_weights), None)
    eng.target.plan = state  # type: ignore[attr-defined]
    return eng


def test_info_to_signed_schedule_to_landing_equals_a_fresh_load() -> None:
    state = _state()
    specs = _specs(state)
    workers = [_worker(r, specs) for r in range(2)]
    infos = [dict(w.side.info(needs=True)) for w in workers]
    replicas: list[tuple[str, list[dict[str, Any]]]] = [("tp2", infos)]
    ranks = engine_ranks(replicas)
    assert [(r.replica, r.worker) for r in ranks] == [("tp2", 0), ("tp2", 1)]
    planner = ShardPlanner(senders=2)
    man = planner.manifest(specs, _holds(state, 2), replicas, weight_version=7,
                           bucket_bytes=1 << 20, checksum=None)
    text = man.to_json()
    token = wire.token(SECRET, "check", [r.instance for r in ranks if r.instance],
                       manifest=text)
    sched = ShardSchedule.of(Manifest.from_json(text))
    assert {t.src for t in sched.transfers} == {0, 1}
    for e, w in enumerate(workers):
        wire.verify_token(Verifier(SECRET, audience=[w.side.instance]), "check", token,
                          manifest=text)
        assert sched.rank_of(w.side.instance) == e  # its rank, from the signed text
        model = tp.TinyTP(e, 2)
        plan = w.target.plan.plan  # type: ignore[attr-defined]
        landing = ShardLanding(plan, man.tensors, sched.transfers, e,
                               dict(named_tensors(model)),
                               lambda items, m=model: tp.load_weights(m, items))
        for t in sched.transfers:
            if t.dst == e:
                raw = state[t.name].contiguous().reshape(-1).view(torch.uint8)
                landing.dest(t).copy_(raw[t.start:t.stop])
        landing.finish()
        oracle = tp.fresh(e, 2, state)
        for (n, a), (_, b) in zip(model.named_parameters(), oracle.named_parameters()):
            assert torch.equal(a, b), n
    # each byte once: the model's bytes plus the replicated norms and scales again
    sizes = {s.name: s.nbytes for s in specs}
    sent = sum(t.nbytes for t in sched.transfers)
    replicated = sum(v for n, v in sizes.items() if n.endswith(("norm", "scale")))
    assert sent == sum(sizes.values()) + replicated <= 1.02 * sum(sizes.values())


def test_the_check_token_covers_the_schedule() -> None:
    state = _state()
    specs = _specs(state)
    workers = [_worker(r, specs) for r in range(2)]
    replicas = [("tp2", [dict(w.side.info(needs=True)) for w in workers])]
    man = ShardPlanner(2).manifest(specs, _holds(state, 2), replicas, weight_version=1, bucket_bytes=1 << 20)
    text = man.to_json()
    token = wire.token(SECRET, "check", [], manifest=text)
    raw = copy.deepcopy(man.meta["schedule"])
    first = raw["transfers"][0]
    raw["transfers"][0] = [1 - first[0], *first[1:]]  # another sender for the first range
    tampered = dataclasses.replace(man, meta={**man.meta, "schedule": raw}).to_json()
    assert tampered != text
    ShardSchedule.of(Manifest.from_json(tampered))  # a well-formed schedule: only the MAC
    wire.verify_token(Verifier(SECRET), "check", token, anonymous_ok=True, manifest=text)
    with pytest.raises(AuthError):
        wire.verify_token(Verifier(SECRET), "check", token, anonymous_ok=True, manifest=tampered)


def test_the_schedule_is_computed_once_per_layout() -> None:
    state = _state()
    specs = _specs(state)
    workers = [_worker(r, specs) for r in range(2)]
    replicas = [("tp2", [dict(w.side.info(needs=True)) for w in workers])]
    planner = ShardPlanner(2)
    a = planner.manifest(specs, _holds(state, 2), replicas, weight_version=1, bucket_bytes=1 << 20)
    b = planner.manifest(specs, _holds(state, 2), replicas, weight_version=2, bucket_bytes=1 << 20)
    assert planner.computed == 1
    assert a.meta["schedule"] == b.meta["schedule"] and b.weight_version == 2
    # the same ranks holding other bytes: computed anew
    h = _holds(state, 2)
    d = planner.manifest(specs, {0: h[1], 1: h[0]}, replicas, weight_version=1,
                         bucket_bytes=1 << 20)
    assert planner.computed == 2 and d.meta["schedule"] != a.meta["schedule"]
    # another layout (the trainer resharded over 3 ranks' holdings): computed anew
    planner.senders = 3
    c = planner.manifest(specs, _holds(state, 3), replicas, weight_version=3, bucket_bytes=1 << 20)
    assert planner.computed == 3 and c.meta["schedule"]["senders"] == 3
    # a worker restarted with the same layout: the transfers kept, bound to its new id
    restarted = [("tp2", [dict(replicas[0][1][0]), {**replicas[0][1][1], "instance": "new"}])]
    e = planner.manifest(specs, _holds(state, 3), restarted, weight_version=3,
                         bucket_bytes=1 << 20)
    assert planner.computed == 3
    assert ShardSchedule.of(e).rank_of("new") == 1
    # a worker whose needs changed (restarted as the other TP rank): computed anew
    swapped = [("tp2", list(reversed(replicas[0][1])))]
    planner.manifest(specs, _holds(state, 3), swapped, weight_version=4, bucket_bytes=1 << 20)
    assert planner.computed == 4


def test_a_worker_without_needs_is_refused_naming_it() -> None:
    state = _state()
    specs = _specs(state)
    plain = LocalEngine(tp.TinyTP(1, 2))  # no copy plan recorded: no needs
    replicas = [("tp2", [dict(_worker(0, specs).side.info(needs=True)), dict(plain.side.info(needs=True))])]
    assert NEEDS_KEY not in replicas[0][1][1]
    with pytest.raises(MalformedNeeds, match="replica 'tp2' worker 1"):
        ShardPlanner(2).manifest(specs, _holds(state, 2), replicas, weight_version=1, bucket_bytes=1 << 20)

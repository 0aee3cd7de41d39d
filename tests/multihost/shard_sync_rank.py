"""One trainer rank of a shard-direct push through the public API (issue 40):
`python -m tests.multihost.shard_sync_rank SPEC_JSON`, prints one JSON line.

SPEC: `{"rank", "world" (1: one sender, `WeightSync` without `senders`), "master"
("addr:port" of the trainer's own gloo group), "seed", "timeout_s", "pushes" (versions
pushed, in order), "corrupt" (a trainer rank that flips a byte of its first range after
digesting it, in push "corrupt_push" (an index) or in
every push), "secret", "no_plan", "replan_at" (a push index before which worker 1's
target records its copy plan anew: a new plan object, the same bytes read), "off_at" (a
push index before which worker 1's copy plan is turned off, as verification turns off a
plan it finds wrong), "probe" (after the pushes, rank 0 turns worker 1's plan off and
sends it a signed `receive` naming the prepared layout, as a trainer that did not ask
`info` would: its answer and its state before and after, under "probe")}`.

Every rank builds `enginehooks_testkit/tp_module.TinyFull`, `fully_shard`s it over the
trainer ranks (FSDP2 on CPU) once, writes each version's weights into the same sharded
parameters (as an optimizer step would) and calls
`WeightSync("shard", senders=TrainerRanks(...))
.push(model, version)`, as a training loop would. Rank 0 (the coordinator) also hosts
the engine: one tensor-parallel module replica of two workers (`TPWorker`: each a
`TinyTP` rank behind its own `EngineSide`, registered as two replicas of one worker, in
TP rank order), each worker's target holding the copy plan recorded from its loader
(unless `no_plan`: then the push is broadcast over the same groups). Trainer ranks
count the collectives they run inside their sender's `send` (must be 0).

Answers: rank 0 `{"reports": [{"ok", "error", "type", "bytes", "schedule", "layout",
"rpcs", ...}],
"states": [each worker's state and version after each push], "equal": [bit-exact
equality of each worker to a fresh load after each push]}`; every rank `{"collectives",
"sent"}` (its own sends' collectives and bytes, per push).
"""

from __future__ import annotations

import datetime as _dt
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from enginehooks import WeightSync
from enginehooks.control.handles import EngineHandle
from enginehooks.core.auth import SECRET_ENV
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.contract import EngineBinding, verb_of
from enginehooks.engine.copy_plan import PlanState, record_plan
from enginehooks.engine.expectations import CheckpointExpectations, Expectations
from enginehooks.engine.side import EngineSide
from enginehooks.trainer_side import TrainerRanks
from enginehooks.transports.base import Target
from enginehooks_testkit import tp_module as tp
from tests.multihost.shard_rank import Collectives


class TPTarget(Target):
    """Engine rank `rank` of a TP module replica: the module's own loader applies every
    update (`tp.load_weights`); `plan` is the copy plan recorded from that loader, as an
    engine's `ApplyTarget` holds it (what `EngineSide` reports needs and checks
    schedules from)."""

    def __init__(self, rank: int, world: int, specs: list[TensorSpec], plan: bool) -> None:
        self.device = torch.device("cpu")
        self.model = tp.TinyTP(rank, world)
        self.rank, self.world = rank, world
        self.plan = PlanState("local")
        if plan:
            self.replan(specs)

    def replan(self, specs: list[TensorSpec]) -> None:
        """Record the copy plan from the loader (again: a new plan object)."""
        with torch.device("meta"):
            skeleton = tp.TinyTP(self.rank, self.world)
        self.plan.adopt(record_plan(skeleton, specs, tp.load_weights), None)

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        tp.load_weights(self.model, tensors)


class TPBinding(EngineBinding):
    engine = "local"

    def __init__(self, target: TPTarget, specs: list[TensorSpec]) -> None:
        self._target, self._specs = target, {s.name: s for s in specs}

    def target(self) -> Target:
        return self._target

    def dtype(self) -> str | None:  # type: ignore[override]
        return "float32"

    def expectations(self) -> Expectations:
        return CheckpointExpectations(self._specs)


class TPWorker(EngineHandle):
    """One worker of the replica, in this process (as `LocalEngine`)."""

    def __init__(self, rank: int, world: int, specs: list[TensorSpec], plan: bool) -> None:
        self.name = f"tp{rank}"
        self.target = TPTarget(rank, world, specs, plan)
        self.side = EngineSide(TPBinding(self.target, specs))

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return [self.side.call(verb_of(method), *args)]

    def flush_pending(self) -> bool:
        return False

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        """A module has no cache."""


def count_sends(into: dict[str, list[int]]) -> None:
    """Count, per push, the collectives this process runs inside its `shard` sender's
    `send` (`into["collectives"]`) and the bytes it sends (`into["sent"]`)."""
    import enginehooks.transports.shard_direct as sd

    counter = Collectives()
    send = sd.ShardSender.send

    def counted(self: Any, manifest: Any, stream: Any, abort: Any) -> Any:
        before = counter.count
        with counter.counting():
            stats = send(self, manifest, stream, abort)
        into["collectives"].append(counter.count - before)
        into["sent"].append(stats.bytes)
        return stats

    sd.ShardSender.send = counted  # type: ignore[method-assign]


def probe(sync: WeightSync, worker: TPWorker) -> dict[str, Any]:
    """Worker `worker`'s copy plan turned off, then a signed `receive` naming the
    prepared layout: what it answers, and its state and version before and after."""
    from enginehooks.core.layout import reference

    lay = sync._layout
    assert lay is not None, "no prepared layout to probe"
    worker.target.plan.disable("turned off by the probe")
    before = [worker.side.state, worker.side.version]
    text = reference(lay.id, "probe")
    group = str(worker.side.group)
    try:
        worker.side.receive(text, group, sync._token("receive", worker, manifest=text,
                                                     group=group))
        answer = "took it"
    except Exception as e:
        answer = f"{type(e).__name__}: {e}"
    return {"answer": answer, "before": before,
            "after": [worker.side.state, worker.side.version]}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import enginehooks.transports.shard_direct as sd
    from enginehooks_testkit.tiny import step_in_place

    rank, world = int(spec["rank"]), int(spec["world"])
    timeout_s = float(spec["timeout_s"])
    dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=rank,
                            world_size=world, timeout=_dt.timedelta(seconds=timeout_s * 4))
    if spec.get("secret"):  # the engine workers (in this process) share the trainer's
        os.environ[SECRET_ENV] = spec["secret"]
    control = dist.new_group(backend="gloo")  # the senders' channel, apart from FSDP's
    # one trainer rank: one sender (no `senders`, no other rank to command)
    sync = WeightSync("shard", senders=TrainerRanks(control, timeout_s=timeout_s)
                      if world > 1 else None, timeout_s=timeout_s, secret=spec.get("secret"))
    workers: list[TPWorker] = []
    specs: list[TensorSpec] = []
    if rank == 0:
        full = tp.TinyFull(0).state_dict()
        specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in full.items()]
        workers = [TPWorker(e, 2, specs, not spec.get("no_plan")) for e in range(2)]
        for w in workers:
            sync.add_replica(w)
    sends: dict[str, list[int]] = {"collectives": [], "sent": []}
    count_sends(sends)
    at = [0]  # the push under way
    if spec.get("corrupt") == rank:  # a byte flipped after its range was digested
        seal = sd._seal
        flipped: set[int] = set()

        def late_flip(key: Any, mid: int, index: int, buf: torch.Tensor, checksum: Any
                      ) -> tuple[int, int]:
            sealed = seal(key, mid, index, buf, checksum)
            if mid not in flipped and spec.get("corrupt_push", at[0]) == at[0]:
                flipped.add(mid)
                buf[0] ^= 0xFF
            return sealed
        sd._seal = late_flip  # type: ignore[assignment]
    out: dict[str, Any] = {"reports": [], "states": [], "equal": []}
    model = tp.TinyFull(int(spec["seed"]))
    fully_shard(model, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    for i, version in enumerate(spec["pushes"]):
        at[0] = i
        state = tp.TinyFull(int(spec["seed"]) + i).state_dict()
        step_in_place(model, state)  # the step: new values in the same sharded parameters
        if rank == 0 and spec.get("replan_at") == i:
            workers[1].target.replan(specs)
        if rank == 0 and spec.get("off_at") == i:
            workers[1].target.plan.disable("turned off by the test")
        try:
            report = sync.push(model, version=version)
            rep: dict[str, Any] = {"ok": True, "bytes": report.bytes,
                                   "schedule": report.sender.get("schedule"),
                                   "workers": [r.stats for r in report.replicas],
                                   "layout": report.layout,
                                   "rpcs": [r.rpcs for r in report.replicas]}
        except Exception as e:
            traceback.print_exc()
            rep = {"ok": False, "error": str(e)[:2000], "type": type(e).__name__,
                   "layout": getattr(getattr(e, "report", None), "layout", None)}
        out["reports"].append(rep)
        if rank == 0:
            out["states"].append([[w.side.state, w.side.version] for w in workers])
            out["equal"].append([
                all(torch.equal(a, b) for a, b in zip(
                    w.target.model.state_dict().values(),
                    tp.fresh(e, 2, state).state_dict().values()))
                for e, w in enumerate(workers)])
    out.update(sends)
    out["needs_asked"] = sync.needs_asked
    if rank == 0 and spec.get("probe"):
        out["probe"] = probe(sync, workers[1])
    sync.close()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    from tests.support.ranks import spec_main

    spec_main(main)

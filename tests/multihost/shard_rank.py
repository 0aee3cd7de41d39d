"""One rank of a shard-direct push (issue 40): `python -m tests.multihost.shard_rank
SPEC_JSON`, prints one JSON line with its result.

SPEC: `{"rank", "trainers", "engines", "port" (the TCPStore, on "address" or 127.0.0.1),
"seed", "dims" (`tp_module.Dims`' fields, optional), "reps" (pushes timed, default 1),
"corrupt" (a trainer rank that flips a byte of its first range after digesting it),
"tamper" (rank 0 changes the schedule after signing it), "secret" (the shared secret,
optional), "timeout_s"}`. Ranks 0..trainers-1 are FSDP2 trainer ranks
(`fully_shard` over a gloo group of their own, on CPU); the rest are the engine ranks of
one tensor-parallel module replica (`enginehooks_testkit/tp_module.py`). One gloo group
of every rank carries the data; the TCPStore carries what the library's calls would: each
engine rank's `info` answer (a `LocalEngine` whose target holds its recorded copy plan:
`EngineSide.info` reports its needs), and the manifest rank 0 plans with
`control/shard_schedule.ShardPlanner` with, given a secret, the `check` token over it,
which each engine rank's `EngineSide.check` verifies, with the tensors and whether it
can follow the schedule, before a byte moves (`"refused"`: why it refused; the trainer
ranks send nothing unless every engine rank took it).

Trainer ranks answer `{"sent", "collectives", "control_collectives"}`: bytes sent, the
collectives they ran on any group while sending (must be 0), and those of a
`full_tensor()` under the same counter (must not be: the counter sees a gather). Engine
ranks answer `{"received", "direct", "how", "equal"}` (`equal`: every parameter equals a
fresh load of the trainer's weights, bit for bit) or `{"error", "type"}`; every rank
adds `"seconds"`, each push's time from a barrier of every rank (a trainer rank's send,
an engine rank's receive and landing; `"finish_s"`: its landing's replay and loader).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from enginehooks import wire
from enginehooks.control.shard_schedule import ShardPlanner
from enginehooks.core.auth import SECRET_ENV, AuthError
from enginehooks.core.buckets import manifest_id
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.engine.copy_plan import PlanState, named_tensors, record_plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.shard_direct import ShardLanding
from enginehooks.trainer_side.fsdp import FSDP2Shards
from enginehooks.transports.shard_direct import receive_shards, send_shards
from enginehooks.wire.schedule import ShardSchedule
from enginehooks_testkit import tp_module as tp


class Collectives(TorchDispatchMode):
    """Counts collectives: the functional ones DTensor runs (`_c10d_functional`), the
    dispatcher's `c10d` ones, and the `torch.distributed` calls a gather would make;
    point-to-point sends and receives are not collectives."""

    NAMES = ("all_gather", "all_gather_into_tensor", "gather", "broadcast", "all_reduce",
             "reduce_scatter_tensor", "all_to_all")
    #: the dispatcher's names of the same (its point-to-point `send`/`recv` are not)
    DISPATCHED = ("gather", "broadcast", "allreduce", "all_reduce", "reduce_scatter",
                  "alltoall", "all_to_all")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        op = func._schema.name.split("::")[-1]
        if func.namespace in ("_c10d_functional", "c10d", "c10d_functional") \
                and any(w in op for w in self.DISPATCHED):
            self.count += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def counting(self) -> Iterator[Collectives]:
        saved = {n: getattr(dist, n) for n in self.NAMES}

        def counted(fn: Any) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                self.count += 1
                return fn(*a, **k)
            return run

        for n, fn in saved.items():
            setattr(dist, n, counted(fn))
        try:
            with self:
                yield self
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)


def specs_of(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()]


def main(spec: dict[str, Any]) -> dict[str, Any]:
    rank, k, m = int(spec["rank"]), int(spec["trainers"]), int(spec["engines"])
    timeout_s = float(spec["timeout_s"])
    reps = int(spec.get("reps", 1))
    dims = tp.Dims(**spec.get("dims", {}))
    secret = spec["secret"].encode() if spec.get("secret") else None
    store = dist.TCPStore(spec.get("address", "127.0.0.1"), int(spec["port"]), k + m,
                          rank == 0, timeout=_dt.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=k + m,
                            timeout=_dt.timedelta(seconds=timeout_s))
    trainers = dist.new_group(list(range(k)), backend="gloo")
    full = {n: t.detach().clone()
            for n, t in tp.TinyFull(int(spec["seed"]), dims).state_dict().items()}
    specs = specs_of(full)
    seconds: list[float] = []
    if rank < k:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        model = tp.TinyFull(int(spec["seed"]), dims)
        fully_shard(model, mesh=DeviceMesh.from_group(trainers, "cpu"))
        shards = FSDP2Shards(model)
        if rank == 0:
            infos = [json.loads(store.get(f"info/{e}")) for e in range(m)]
            man = ShardPlanner(k).manifest(specs, shards.holds(), [("tp", infos)],
                                           weight_version=1, bucket_bytes=1 << 20,
                                           checksum=None)
            text = man.to_json()
            token = (wire.token(secret, "check", [i["instance"] for i in infos],
                                manifest=text) if secret else "")
            if spec.get("tamper"):  # another sender for the first range, after signing
                raw = json.loads(text)
                first = raw["meta"]["schedule"]["transfers"][0]
                first[0] = (first[0] + 1) % k
                text = json.dumps(raw)
            store.set("token", token)
            store.set("manifest", text)
        man = Manifest.from_json(store.get("manifest").decode())
        sched = ShardSchedule.of(man)
        verdicts = [store.get(f"check/{e}").decode() for e in range(m)]
        if any(v != "ok" for v in verdicts):
            reps = 0  # refused at check: nothing is sent
        counter = Collectives()
        if spec.get("corrupt") == rank:
            # a byte flipped after its range was digested, before it is sent
            import enginehooks.transports.shard_direct as sd
            first = next(t for t in sched.transfers if t.src == rank)
            seal = sd._seal

            def late_flip(key: Any, mid: int, index: int, buf: torch.Tensor,
                          checksum: Any) -> tuple[int, int]:
                sealed = seal(key, mid, index, buf, checksum)
                if sched.transfers[index] == first:
                    buf[0] ^= 0xFF
                return sealed
            sd._seal = late_flip  # type: ignore[assignment]
        sent = 0
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            with counter.counting():
                sent = send_shards(dist.group.WORLD, sched.transfers, rank, shards.source,
                                   senders=k, mid=manifest_id(man), secret=secret,
                                   timeout_s=timeout_s)
            seconds.append(time.perf_counter() - t0)
        control = Collectives()
        with control.counting():
            next(iter(model.parameters())).full_tensor()
        out: dict[str, Any] = {"sent": sent, "collectives": counter.count,
                               "control_collectives": control.count, "verdicts": verdicts}
    else:
        e = rank - k
        with torch.device("meta"):
            skeleton = tp.TinyTP(e, m, dims)
        cplan = record_plan(skeleton, specs, tp.load_weights)
        if secret:
            os.environ[SECRET_ENV] = spec["secret"]
        engine = tp.TinyTP(e, m, dims)
        # the engine contract's side of this rank: an EngineSide whose expectations are
        # the checkpoint's names, dtypes and shapes (the tensors are never written) and
        # whose target holds the plan recorded, as an engine's ApplyTarget holds it
        worker = LocalEngine(dict(full), name=f"tp{e}")
        worker.target.plan = PlanState("local")  # type: ignore[attr-defined]
        worker.target.plan.adopt(cplan, None)  # type: ignore[attr-defined]
        store.set(f"info/{e}", json.dumps(worker.side.info(needs=True)))
        text = store.get("manifest").decode()
        token = store.get("token").decode() or None
        out = {}
        try:  # the token, the tensors, and a schedule this rank can follow
            problems = worker.side.check(text, token)
            if problems:
                out = {"refused": "; ".join(problems), "type": "ManifestError"}
        except AuthError as err:
            out = {"refused": str(err), "type": type(err).__name__}
        man = Manifest.from_json(text)
        sched = ShardSchedule.of(man)
        if not out and sched.rank_of(worker.side.instance) != e:  # its rank, as signed
            out = {"refused": f"signed as engine rank {sched.rank_of(worker.side.instance)}",
                   "type": "MalformedSchedule"}
        if out:
            reps = 0
        # the check phase's verdict: no byte moves unless every engine rank took it
        store.set(f"check/{e}", out.get("refused", "ok"))
        finish: list[float] = []
        for _ in range(reps):
            landing = ShardLanding(cplan, man.tensors, sched.transfers, e,
                                   dict(named_tensors(engine)),
                                   lambda items: tp.load_weights(engine, items))
            dist.barrier()
            t0 = time.perf_counter()
            try:
                got = receive_shards(dist.group.WORLD, sched.transfers, e, landing.dest,
                                     senders=k, mid=manifest_id(man), secret=secret,
                                     timeout_s=timeout_s)
                t1 = time.perf_counter()
                how = landing.finish()
                finish.append(time.perf_counter() - t1)
            except Exception as err:
                out = {"error": str(err), "type": type(err).__name__}
                break
            seconds.append(time.perf_counter() - t0)
        if not out:
            oracle = tp.fresh(e, m, full, dims)
            equal = all(torch.equal(a, b) for a, b in zip(engine.state_dict().values(),
                                                           oracle.state_dict().values()))
            out = {"received": got, "direct": landing.received_direct, "how": how,
                   "equal": equal, "finish_s": finish}
    out["seconds"] = seconds
    dist.barrier()
    dist.destroy_process_group()
    return out

if __name__ == "__main__":
    from tests.support.ranks import spec_main

    spec_main(main)

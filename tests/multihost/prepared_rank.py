"""One trainer rank of several senders on a prepared layout (issue 37 item 1):
`python -m tests.multihost.prepared_rank SPEC_JSON`, prints one JSON line.

SPEC: `{"rank", "world", "master" ("addr:port" of the trainer's own gloo group),
"timeout_s", "steps"}`; each step `{"version", "model" ("fsdp2" | "owned"), "do"}` with
`do` one of: "" (train, push), "break" (this rank's sender group is closed first: rank 1
only), "restart" (replica r1 restarts first: rank 0 hosts it), "refuse" (r1 restarts
serving a model of other shapes, which refuses the update), "restore" (r1 restarts
serving the right shapes again), "corrupt" (rank 1 flips a
byte of its first bucket after sealing it), "double" (rank 1's owned model becomes
float64), "bonus" (rank 1's owned model gains a tensor), "unbonus" (and loses it).

Every rank builds the same two models from fixed seeds: "fsdp2" is `fully_shard`ed over
the trainer ranks (FSDP2 on CPU, gathered in lockstep); "owned" is a plain module of which
rank 0 sends layer 0 and rank 1 everything else (`include`, the same function every
push: each rank owns its part). Before every push each model is trained one step (every
parameter + 0.5, the same on every rank). Rank 0 also hosts two module replicas
(`LocalEngine`) and answers, per push, `{"ok", "layout", "rpcs", "error", "type",
"states", "equal"}`: the report's layout and calls per replica, each replica's state and
version, and whether each holds the trainer's weights bit for bit.
"""

from __future__ import annotations

import datetime as _dt
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from enginehooks import WeightSync
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.side import EngineSide
from enginehooks.trainer_side import TrainerRanks
from enginehooks.trainer_side.choose import adapter_for


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8))


def corrupting_pack(real: Callable[..., Iterator[tuple[int, torch.Tensor]]]
                    ) -> Callable[..., Iterator[tuple[int, torch.Tensor]]]:
    """`core.buckets.pack`, then one payload byte of bucket 0 flipped after it was sealed
    (digest and trailer computed): bytes torn on the wire. Fault injection into the real
    sender (as `tests/library/transports/test_integrity.corrupting_pack`)."""

    def pack(manifest: Any, stream: Iterable[tuple[str, torch.Tensor]],
             next_buffer: Callable[[int], torch.Tensor], secret: bytes | None = None
             ) -> Iterator[tuple[int, torch.Tensor]]:
        for index, buf in real(manifest, stream, next_buffer, secret):
            if index == 0:
                buf[3] ^= 0x5A
            yield index, buf

    return pack


def main(spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import enginehooks.transports.broadcast as broadcast

    rank, world = int(spec["rank"]), int(spec["world"])
    timeout_s = float(spec["timeout_s"])
    dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=rank,
                            world_size=world, timeout=_dt.timedelta(seconds=timeout_s * 6))
    control = dist.new_group(backend="gloo")  # the senders' channel, apart from FSDP's
    sync = WeightSync("gloo", senders=TrainerRanks(control, timeout_s=timeout_s),
                      timeout_s=timeout_s, bucket_bytes=1024)
    replicas: list[LocalEngine] = []
    if rank == 0:
        replicas = [LocalEngine(net(0), name=f"r{i}") for i in range(2)]
        for r in replicas:
            sync.add_replica(r)
    fsdp = net(1)
    expect = {"fsdp2": {n: t.detach().clone() for n, t in fsdp.state_dict().items()}}
    fully_shard(fsdp, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    owned = net(2)
    expect["owned"] = {n: t.detach().clone() for n, t in owned.state_dict().items()}
    layer0 = {"0.weight", "0.bias"}
    # the same function every push: the adapter's layout key names it
    include: Callable[[str], bool] = (
        layer0.__contains__ if rank == 0 else (lambda n: n not in layer0))
    pack = broadcast.pack
    out: list[dict[str, Any]] = []
    for step in spec["steps"]:
        which, do, version = step["model"], step.get("do", ""), step["version"]
        model = fsdp if which == "fsdp2" else owned
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
            for t in expect[which].values():
                t.add_(0.5)
        if do == "break" and rank == 1 and sync._follower is not None:
            sender = sync._follower.sender
            assert sender is not None
            sender.close()  # this rank's data-plane group is gone (as after a failure)
        if do == "restart" and rank == 0:
            # the engine process restarted: its group is gone, a new worker (a new
            # instance id, no layout) serves the same model
            replicas[1].side._leave()
            replicas[1].side = EngineSide(replicas[1].side.binding)
        if do in ("refuse", "restore") and rank == 0:
            replicas[1].side._leave()
            other = LocalEngine(net(0) if do == "restore" else nn.Sequential(
                nn.Linear(16, 32), nn.Linear(32, 33), nn.Linear(33, 8)), name="r1")
            replicas[1].side, replicas[1].target = other.side, other.target
        if rank == 1 and which == "owned":
            if do == "double":
                owned.double()
            elif do == "bonus":
                owned.register_parameter("bonus", nn.Parameter(torch.ones(3)))
            elif do == "unbonus":
                del owned.bonus
        broadcast.pack = corrupting_pack(pack) if do == "corrupt" and rank == 1 else pack
        what = model if which == "fsdp2" else adapter_for(owned, include=include)
        try:
            report = sync.push(what, version)
            res: dict[str, Any] = {"ok": True, "layout": report.layout,
                                   "rpcs": [r.rpcs for r in report.replicas],
                                   "bytes": report.bytes}
        except Exception as e:
            traceback.print_exc()
            res = {"ok": False, "error": str(e)[:2000], "type": type(e).__name__,
                   "layout": getattr(getattr(e, "report", None), "layout", None)}
        broadcast.pack = pack
        if rank == 0:
            res["states"] = [[r.side.state, r.side.version] for r in replicas]
            want = expect[which]
            res["equal"] = [
                all(torch.equal(t, want[n]) for n, t in r.target.module.state_dict().items())
                for r in replicas]
        out.append(res)
    sync.close()
    dist.destroy_process_group()
    return {"pushes": out}


if __name__ == "__main__":
    from tests.support.ranks import spec_main

    spec_main(main)

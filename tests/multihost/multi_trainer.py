"""One trainer rank of a multi-sender push, run inside its host's namespace (or on
loopback): `python -m tests.multihost.multi_trainer SPEC_JSON`, then one JSON command
per stdin line, one JSON answer per stdout line (the same protocol as `trainer.py`).

SPEC: `{"model_dir", "host" (this rank's address), "rank", "world", "master"
("addr:port" of rank 0's rendezvous for the trainer's own gloo group), "replicas":
[{"kind", "url", "name"}] (rank 0), "timeout_s", "bucket_bytes", "mode"}`; mode
"balanced" (every rank streams the whole model, as FSDP ranks do; the coordinator
shares it out), "owned" (rank r streams only the tensors it owns: every world-th name),
"fsdp2" (each push's model is `fully_shard`ed over the ranks: real DTensors, gathered in
lockstep while each rank sends its share; the control channel is a gloo group of its
own; `"transport": "shard"` pushes it shard-direct, `shard_sync_rank.count_sends`
counting each rank's sends; with `"keep_model": true` the model is `fully_shard`ed once
and each later push writes its weights into the same sharded parameters, as an optimizer
step would, so pushes after the first may take the prepared layout) or "single" (rank 0
alone pushes with a plain `WeightSync`; the baseline).

Commands: `{"op": "push", "seed", "version"}` on every rank (answers `{"ok", "seconds",
...}` or the error, with `"type"`); `{"op": "digests", "names", "replica"?}` (rank 0);
`{"op": "exit"}` (every rank: closes the groups together).
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
import time
import traceback
from typing import Any

import torch.distributed as dist

from enginehooks import WeightSync
from enginehooks.trainer_side import TrainerRanks
from enginehooks.trainer_side.choose import adapter_for
from enginehooks_testkit.tiny import load_tiny, perturb, step_in_place
from tests.multihost.trainer import handle_of


def main(spec: dict[str, Any]) -> None:
    rank, world, mode = int(spec["rank"]), int(spec["world"]), spec.get("mode", "balanced")
    timeout_s = float(spec["timeout_s"])
    model = load_tiny(spec["model_dir"])
    base = {n: t.clone() for n, t in model.state_dict().items()}
    dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=rank,
                            world_size=world, timeout=_dt.timedelta(seconds=timeout_s * 8))
    handles = {r["name"]: handle_of(r) for r in spec.get("replicas") or []}
    sync: WeightSync
    sends: dict[str, list[int]] = {"collectives": [], "sent": []}
    if mode == "single":
        sync = WeightSync("gloo", host=spec["host"], timeout_s=timeout_s,
                          bucket_bytes=spec["bucket_bytes"])
    else:
        # FSDP2 gathers on the default group: the control channel needs its own
        control = dist.new_group(backend="gloo") if mode == "fsdp2" else None
        transport = spec.get("transport", "gloo")
        if transport == "shard":  # count the collectives inside each rank's sends
            from tests.multihost.shard_sync_rank import count_sends
            count_sends(sends)
        sync = WeightSync(transport, senders=TrainerRanks(control, timeout_s=timeout_s),
                          host=spec["host"], timeout_s=timeout_s,
                          bucket_bytes=spec["bucket_bytes"])
    if rank == 0:
        for h in handles.values():
            sync.add_replica(h)
    names = sorted(base)
    sharded: list[Any] = []  # "keep_model": the model `fully_shard`ed at the first push

    def answer(obj: dict[str, Any]) -> None:
        print(json.dumps(obj), flush=True)

    answer({"ready": True, "rank": rank})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "push":
            model.load_state_dict(base)
            perturb(model, seed=int(cmd["seed"]))
            what: Any = model
            if mode == "owned":
                mine = {n for i, n in enumerate(names) if i % world == rank}
                what = adapter_for(model, include=mine.__contains__)
            elif mode == "fsdp2" and spec.get("keep_model") and sharded:
                what = sharded[0]
                # `model` holds this push's values (perturbed above): the step writes
                # them into the same sharded parameters
                step_in_place(what, model.state_dict())
            elif mode == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                what = perturb(load_tiny(spec["model_dir"]), seed=int(cmd["seed"]))
                for layer in what.model.layers:
                    fully_shard(layer)
                fully_shard(what)
                sharded[:] = [what]
            t0 = time.monotonic()
            if mode == "single" and rank != 0:
                answer({"ok": True, "seconds": 0.0, "idle": True})
                continue
            try:
                report = sync.push(what, version=cmd["version"])
            except Exception as e:
                traceback.print_exc()  # to this rank's log
                answer({"ok": False, "type": type(e).__name__, "error": str(e),
                        "replica": getattr(e, "replica", None),
                        "seconds": time.monotonic() - t0})
                continue
            answer({"ok": True, "seconds": time.monotonic() - t0, "bytes": report.bytes,
                    "phases": dict(getattr(report, "phases", {}) or {}),
                    "schedule": report.sender.get("schedule"), "sends": sends,
                    "layout": report.layout, "rpcs": [r.rpcs for r in report.replicas],
                    "workers": [r.stats for r in report.replicas]})
        elif op == "digests":
            h = handles[cmd["replica"]] if "replica" in cmd else next(iter(handles.values()))
            answer({"ok": True, "digests": h.digests(cmd["names"], timeout_s=60.0)})
        else:
            answer({"ok": False, "type": "ValueError", "error": f"unknown op {op!r}"})
    if mode != "single" or rank == 0:
        sync.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

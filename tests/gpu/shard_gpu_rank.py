"""One rank of a shard-direct push over NCCL (issue 40): `python -m tests.gpu.shard_gpu_rank
SPEC_JSON`, prints one JSON line with its result. Used by
`tests/gpu/test_shard_direct_gpu.py` and `benchmarks/bench_shard_direct_gpu.py`.

Four ranks, one GPU each (rank r on `cuda:r`), one NCCL world: ranks 0 and 1 are FSDP2
trainer ranks (`fully_shard` over an NCCL group of the two, on GPUs 0 and 1), ranks 2
and 3 the engine ranks of one TP=2 module replica (`enginehooks_testkit/tp_module.py`,
the replica the multihost shard tests use: fused q/k/v and gate/up filled by rows, o/down
by columns, a loader-computed tensor), on GPUs 2 and 3. Each engine rank records its
copy plan from its own loader (on the meta device) and reports its needs through
`EngineSide.info`, as in `tests/multihost/shard_rank.py`; rank 0 plans the schedule
with `control/shard_schedule.ShardPlanner`; the bytes go point to point over the NCCL
world with `send_shards` / `receive_shards` (`transports/shard_direct.py`), straight
into the engine's GPU parameters where the plan is a plain copy (`ShardLanding`).

SPEC: `{"rank", "port" (the TCPStore on 127.0.0.1), "seed", "dims" (`tp_module.Dims`'
fields), "timeout_s", "pushes": [{"mode": "shard" | "raw", "checksum": "sum64" | null,
"secret": hex or null, "pack_below": `send_shards`' (default `PACK_BELOW`), "corrupt":
a trainer rank that flips a byte of its first range to each engine rank after sealing
it (it reports the tensors' names as "corrupted")}, ...]}`. Every push starts from a
barrier of all four ranks and is timed on each rank to the end of its part (a trainer
rank: its sends done; an engine rank: received, digests checked, landed, synchronized).
"raw" is the primitive underneath: each trainer rank sends, with one batch of plain
NCCL sends, as many bytes to each engine rank as the schedule gives that pair, from one
buffer, into one buffer, no schedule walk, no digest, no landing.

Answers: `{"role", "pushes": [{"mode", "seconds", "sent" | "received", "receive_s",
"finish_s", "equal", "direct", "how", "error", "type"}, ...], "model_bytes",
"schedule_bytes", "device"}`; `equal` (engine ranks, shard pushes): every parameter
equals, bit for bit, a fresh load of the trainer's weights into this rank's TP slice.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.control.shard_schedule import ShardPlanner
from enginehooks.core.buckets import manifest_id
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.engine.copy_plan import PlanState, named_tensors, record_plan
from enginehooks.engine.local import LocalEngine
from enginehooks.engine.shard_direct import ShardLanding
from enginehooks.trainer_side.fsdp import FSDP2Shards
from enginehooks.transports import shard_direct as sd
from enginehooks.wire.schedule import ShardSchedule
from enginehooks_testkit import tp_module as tp
from tests.support.ranks import progress

#: trainer ranks (FSDP2) and engine ranks (one TP replica); set per run by `main`
TRAINERS, ENGINES = 2, 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    _sync(device)


def _corrupting(flipped: list[str]) -> Any:
    """`shard_direct._outgoing` that flips the first byte of this rank's first message
    to each engine rank after it was sealed (on the GPU, before the send reads it);
    `flipped` gets the names of the first tensors of those messages."""
    outgoing = sd._outgoing

    def late_flip(dst: int, msgs: Any, bufs: Any, seals: Any) -> Any:
        out = outgoing(dst, msgs, bufs, seals)
        if out:
            out[0][0:1].bitwise_xor_(0xFF)
            flipped.append(msgs[0][0][1].name)
        return out
    return late_flip


def _raw_sizes(transfers: Any) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for t in transfers:
        out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + t.nbytes
    return out


def _raw(rank: int, sizes: dict[tuple[int, int], int], device: torch.device,
         bufs: dict[int, torch.Tensor], timeout_s: float) -> int:
    """The primitive: one batch of plain NCCL sends (a trainer rank) or receives (an
    engine rank), one message per pair of the schedule's bytes for that pair."""
    ops = []
    moved = 0
    for (src, dst), n in sorted(sizes.items()):
        if rank == src:
            ops.append(dist.P2POp(dist.isend, bufs[dst][:n], TRAINERS + dst))
        elif rank == TRAINERS + dst:
            ops.append(dist.P2POp(dist.irecv, bufs[src][:n], src))
        else:
            continue
        moved += n
    if ops:
        for w in dist.batch_isend_irecv(ops):
            sd.wait_work(w, None, timeout_s, "raw p2p", device)
    return moved


def main(spec: dict[str, Any]) -> dict[str, Any]:
    global TRAINERS, ENGINES
    # the topology (default 2 -> 2; "trainers": 1, "engines": 1 on a 2-GPU host)
    TRAINERS, ENGINES = int(spec.get("trainers", 2)), int(spec.get("engines", 2))
    rank = int(spec["rank"])
    timeout_s = float(spec["timeout_s"])
    dims = tp.Dims(**spec.get("dims", {}))
    smoke = bool(spec.get("smoke"))  # gloo on the host: this file's logic without GPUs
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    backend = "gloo" if smoke else "nccl"
    if not smoke:
        torch.cuda.set_device(device)
    world = TRAINERS + ENGINES

    def say(what: str) -> None:
        progress(f"rank {rank}: {what}")

    say(f"start ({backend}, {device})")
    store = dist.TCPStore("127.0.0.1", int(spec["port"]), world, rank == 0,
                          timeout=_dt.timedelta(seconds=timeout_s))
    # NCCL's own timeout past ours: our wait (a polled CUDA event) reports a dead peer
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=_dt.timedelta(seconds=2 * timeout_s + 60),
                            device_id=None if smoke else device)
    dist.all_reduce(torch.zeros(1, device=device))  # every rank in the first collective
    say("init done (world all_reduce)")
    trainers = dist.new_group(list(range(TRAINERS)), backend=backend)  # every rank calls it
    say("trainer group formed")
    # the checkpoint, built on the host (the same bytes in every process)
    full_model = tp.TinyFull(int(spec["seed"]), dims)
    full_cpu = {n: t.detach() for n, t in full_model.state_dict().items()}
    specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in full_cpu.items()]
    model_bytes = sum(t.numel() * t.element_size() for t in full_cpu.values())
    out: dict[str, Any] = {"device": "cpu" if smoke else torch.cuda.get_device_name(device),
                           "model_bytes": model_bytes, "pushes": []}
    pushes = list(spec["pushes"])
    if rank < TRAINERS:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        model = full_model.to(device)
        fully_shard(model, mesh=DeviceMesh.from_group(trainers, device.type))
        del full_cpu, full_model
        shards = FSDP2Shards(model)
        say("fully_shard done")
        if rank == 0:
            infos = [json.loads(store.get(f"info/{e}")) for e in range(ENGINES)]
            man = ShardPlanner(TRAINERS).manifest(specs, shards.holds(), [("tp", infos)],
                                                  weight_version=1, bucket_bytes=1 << 20,
                                                  checksum="sum64")
            store.set("manifest", man.to_json())
            say(f"planned {len(ShardSchedule.of(man).transfers)} transfers")
    else:
        e = rank - TRAINERS
        with torch.device("meta"):
            skeleton = tp.TinyTP(e, ENGINES, dims)
        cplan = record_plan(skeleton, specs, tp.load_weights)
        worker = LocalEngine(dict(full_cpu), name=f"tp{e}")  # its info: names and needs
        worker.target.plan = PlanState("local")  # type: ignore[attr-defined]
        worker.target.plan.adopt(cplan, None)  # type: ignore[attr-defined]
        store.set(f"info/{e}", json.dumps(worker.side.info(needs=True)))
        with torch.device(device):
            engine = tp.TinyTP(e, ENGINES, dims)
            oracle = tp.TinyTP(e, ENGINES, dims)
        tp.load_weights(oracle, ((n, t.to(device)) for n, t in full_cpu.items()))
        del full_cpu, full_model
        say("engine replica and oracle built")
    man = Manifest.from_json(store.get("manifest").decode())
    sched = ShardSchedule.of(man)
    mid = manifest_id(man)
    out["schedule_bytes"] = sum(t.nbytes for t in sched.transfers)
    say(f"manifest read: {len(sched.transfers)} transfers, {out['schedule_bytes']} bytes")
    sizes = _raw_sizes(sched.transfers)
    raw_bufs: dict[int, torch.Tensor] = {}
    if any(p["mode"] == "raw" for p in pushes):  # one buffer per peer, made before timing
        peers = range(ENGINES) if rank < TRAINERS else range(TRAINERS)
        for p in peers:
            n = max([v for (s, d), v in sizes.items()
                     if (s == rank and d == p) or (s == p and d == rank - TRAINERS)] or [0])
            raw_bufs[p] = torch.empty(n, dtype=torch.uint8, device=device)
    broken = False
    outgoing = sd._outgoing
    for k, push in enumerate(pushes):
        mode, checksum = push["mode"], push.get("checksum", "sum64")
        secret = bytes.fromhex(push["secret"]) if push.get("secret") else None
        rec: dict[str, Any] = {"mode": mode, "checksum": checksum, "keyed": bool(secret)}
        pack_below = int(push.get("pack_below", sd.PACK_BELOW))
        sd._outgoing = outgoing  # type: ignore[assignment]
        if rank < TRAINERS and push.get("corrupt") == rank:
            rec["corrupted"] = []
            sd._outgoing = _corrupting(rec["corrupted"])  # type: ignore[assignment]
        # "tables": which sides find their ranges as tables (`shard_runs.py`): both
        # (default), "send" or "receive" only (the other side per range), or "none"
        tables = push.get("tables", "both")
        use_places = tables in ("both", "send" if rank < TRAINERS else "receive")
        landing = None
        if rank >= TRAINERS and mode == "shard":
            landing = ShardLanding(cplan, man.tensors, sched.transfers, rank - TRAINERS,
                                   dict(named_tensors(engine)),
                                   lambda items: tp.load_weights(engine, items), device)
        say(f"push {k} ({mode}, checksum {checksum}, keyed {bool(secret)}, pack_below "
            f"{pack_below}): barrier")
        _barrier(device)
        say(f"push {k}: start")
        t0 = time.perf_counter()
        try:
            if mode == "raw":
                rec["sent" if rank < TRAINERS else "received"] = _raw(
                    rank, sizes, device, raw_bufs, timeout_s)
            elif rank < TRAINERS:
                rec["sent"] = sd.send_shards(dist.group.WORLD, sched.transfers, rank,
                                             shards.source, senders=TRAINERS, mid=mid,
                                             secret=secret, checksum=checksum,
                                             timeout_s=timeout_s, pack_below=pack_below,
                                             places=shards if use_places else None,
                                             phases=rec.setdefault("phases", {}))
            else:
                assert landing is not None
                rec["received"] = sd.receive_shards(
                    dist.group.WORLD, sched.transfers, rank - TRAINERS, landing.dest,
                    senders=TRAINERS, mid=mid, secret=secret, checksum=checksum,
                    timeout_s=timeout_s, pack_below=pack_below,
                    places=landing if use_places else None,
                    phases=rec.setdefault("phases", {}))
                _sync(device)
                t1 = time.perf_counter()
                rec["how"] = landing.finish()
                _sync(device)
                rec["receive_s"] = t1 - t0
                rec["finish_s"] = time.perf_counter() - t1
                rec["direct"] = landing.received_direct
            _sync(device)
        except Exception as err:
            rec.update(error=str(err), type=type(err).__name__)
        rec["seconds"] = time.perf_counter() - t0
        if rank >= TRAINERS and mode == "shard" and "error" not in rec:
            rec["equal"] = all(torch.equal(a, b) for a, b in
                               zip(engine.state_dict().values(), oracle.state_dict().values()))
            with torch.no_grad():  # the next push lands in zeros again
                for p in engine.parameters():
                    p.zero_()
        say(f"push {k}: end in {rec['seconds']:.3f} s"
            + (f": {rec['type']}: {rec['error']}" if "error" in rec else ""))
        if not spec.get("how"):
            rec.pop("how", None)
        out["pushes"].append(rec)
        if rec.get("type") not in (None, "ChecksumError"):
            broken = True
            break  # the group's state is unknown after a transport error
    out["role"] = "trainer" if rank < TRAINERS else "engine"
    if broken:  # no barrier, no teardown: a send still queued on NCCL's stream never ends
        out["_exit_now"] = True
        return out
    _barrier(device)
    say("done")
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from tests.support.ranks import spec_main

    spec_main(main)

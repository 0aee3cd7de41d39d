"""One process of a `WeightSync("shard_nccl", senders=...)` push on 4 GPUs (issue 40):
`python -m tests.gpu.shard_sync_gpu_rank SPEC_JSON`, prints one JSON line. Used by
`tests/gpu/test_shard_direct_gpu.py`.

The public API end to end, over NCCL: two trainer processes (GPUs 0 and 1, an NCCL world
of 2, `enginehooks_testkit/tp_module.TinyFull` `fully_shard`ed over it) each call
`WeightSync("shard_nccl", senders=TrainerRanks(...)).push(model, version)`; rank 0
coordinates. The engine is one TP=2 module replica whose two workers are processes of
their own (GPUs 2 and 3): each a `TinyTP` rank behind an `EngineSide`
(`tests/multihost/shard_sync_rank.TPBinding`), its target holding the copy plan recorded
from its loader, served over HTTP (`POST /rpc`, the `tests/multihost/replica.py`
protocol: rank 0 reaches it with `RemoteModule`). So the workers report their needs,
check the signed schedule and receive through `ShardReceiver` on NCCL groups, the code
the engine plugins run.

SPEC: `{"role": "trainer" | "engine", "rank" (a trainer's 0/1, an engine worker's 0/1),
"dir" (where the workers publish their URLs and rank 0 says it is done), "master"
("addr:port" of the trainers' world), "seeds" (one per push: the trainer's weights),
"timeout_s", "secret", "corrupt": [trainer rank, push index] (that rank flips the first
byte of its first range to each worker after sealing it, in that push), "smoke" (gloo
and `shard` on the host: this file's logic without GPUs)}`.

Answers: a trainer `{"reports": [{"ok", "error", "type", "bytes", "schedule"}]}`; a worker
`{"state", "version", "equal"}` at the end, `equal`: its parameters equal, bit for bit, a
fresh load of the last push's weights that succeeded (a refused push applied nothing).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.copy_plan import PlanState, record_plan
from enginehooks.transports.base import Target
from enginehooks_testkit import tp_module as tp
from tests.support.json_http import JsonHandler
from tests.support.ranks import progress

WORKERS = 2


def _device(spec: dict[str, Any], index: int) -> torch.device:
    return torch.device("cpu") if spec.get("smoke") else torch.device("cuda", index)


def _specs() -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape))
            for n, t in tp.TinyFull(0).state_dict().items()]


class GpuTPTarget(Target):
    """Worker `rank` of the TP module replica on `device`: its loader applies every
    update; `plan` is the copy plan recorded from that loader (what `EngineSide` reports
    needs and checks schedules from)."""

    def __init__(self, rank: int, specs: list[TensorSpec], device: torch.device) -> None:
        self.device = device
        with torch.device(device):
            self.model = tp.TinyTP(rank, WORKERS)
        self.plan = PlanState("local")
        with torch.device("meta"):
            skeleton = tp.TinyTP(rank, WORKERS)
        self.plan.adopt(record_plan(skeleton, specs, tp.load_weights), None)

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        tp.load_weights(self.model, tensors)


def engine_main(spec: dict[str, Any]) -> dict[str, Any]:
    from enginehooks.core.auth import SECRET_ENV
    from enginehooks.engine.contract import verb_of
    from enginehooks.engine.side import EngineSide
    from tests.multihost.shard_sync_rank import TPBinding

    e = int(spec["rank"])
    device = _device(spec, 2 + e)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if spec.get("secret"):
        os.environ[SECRET_ENV] = spec["secret"]
    specs = _specs()
    target = GpuTPTarget(e, specs, device)
    side = EngineSide(TPBinding(target, specs))  # type: ignore[arg-type]

    class Handler(JsonHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if device.type == "cuda":  # a worker's threads run on its GPU
                torch.cuda.set_device(device)
            try:
                result = side.call(verb_of(body["method"]), *body["args"])
            except Exception as err:
                sys.stderr.write(f"[worker {e}] {body['method']}: {type(err).__name__}: {err}\n")
                self._send(500, {"error": f"{type(err).__name__}: {err}"})
                return
            with contextlib.suppress(OSError):
                self._send(200, {"results": [result]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    folder = Path(spec["dir"])
    (folder / f"url-{e}.tmp").write_text(f"http://127.0.0.1:{server.server_address[1]}")
    os.replace(folder / f"url-{e}.tmp", folder / f"url-{e}")
    progress(f"worker {e}: serving on {device}")
    end = time.monotonic() + float(spec["timeout_s"]) * 6
    while not (folder / "done").exists():
        if time.monotonic() > end:
            raise TimeoutError("the trainer never said it was done")
        time.sleep(0.2)
    server.shutdown()
    done = json.loads((folder / "done").read_text())
    last = done.get("last_ok")
    out: dict[str, Any] = {"state": side.state, "version": side.version, "equal": None}
    if last is not None:
        want = tp.fresh(e, WORKERS, tp.TinyFull(int(spec["seeds"][last])).state_dict())
        out["equal"] = all(torch.equal(a.cpu(), b) for a, b in zip(
            target.model.state_dict().values(), want.state_dict().values()))
    return out


def trainer_main(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import enginehooks.transports.shard_direct as sd
    from enginehooks import WeightSync
    from enginehooks.trainer_side import TrainerRanks
    from tests.gpu.shard_gpu_rank import _corrupting
    from tests.multihost.replica import RemoteModule

    rank = int(spec["rank"])
    timeout_s = float(spec["timeout_s"])
    device = _device(spec, rank)
    smoke = device.type == "cpu"
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"tcp://{spec['master']}",
                            rank=rank, world_size=2,
                            timeout=_dt.timedelta(seconds=timeout_s * 4))
    dist.all_reduce(torch.zeros(1, device=device))
    progress(f"trainer {rank}: init done on {device}")
    control = dist.new_group(backend="gloo")  # the senders' channel, apart from FSDP's
    sync = WeightSync("shard" if smoke else "shard_nccl",
                      senders=TrainerRanks(control, timeout_s=timeout_s), host="127.0.0.1",
                      timeout_s=timeout_s, secret=spec.get("secret"),
                      device=None if smoke else device)
    folder = Path(spec["dir"])
    if rank == 0:
        end = time.monotonic() + timeout_s * 2
        while not all((folder / f"url-{e}").exists() for e in range(WORKERS)):
            if time.monotonic() > end:
                raise TimeoutError("the engine workers did not start")
            time.sleep(0.2)
        for e in range(WORKERS):  # in TP rank order: engine rank e
            sync.add_replica(RemoteModule((folder / f"url-{e}").read_text(), f"tp{e}"))
    corrupt = spec.get("corrupt") or [None, None]
    outgoing = sd._outgoing
    out: dict[str, Any] = {"reports": []}
    last_ok = None
    for i, seed in enumerate(spec["seeds"]):
        sd._outgoing = (_corrupting([]) if corrupt == [rank, i]  # type: ignore[assignment]
                        else outgoing)
        model = tp.TinyFull(int(seed)).to(device)
        fully_shard(model, mesh=DeviceMesh.from_group(dist.group.WORLD, device.type))
        progress(f"trainer {rank}: push {i} start")
        try:
            report = sync.push(model, version=f"v{i}")
            progress(f"trainer {rank}: push {i} end")
            out["reports"].append({"ok": True, "bytes": report.bytes,
                                   "schedule": report.sender.get("schedule")})
            last_ok = i
        except Exception as err:
            traceback.print_exc()
            progress(f"trainer {rank}: push {i} failed: {type(err).__name__}")
            out["reports"].append({"ok": False, "error": str(err)[:2000],
                                   "type": type(err).__name__})
    sd._outgoing = outgoing
    sync.close()
    if rank == 0:
        (folder / "done.tmp").write_text(json.dumps({"last_ok": last_ok}))
        os.replace(folder / "done.tmp", folder / "done")
    dist.destroy_process_group()
    return out


def main(spec: dict[str, Any]) -> dict[str, Any]:
    return engine_main(spec) if spec["role"] == "engine" else trainer_main(spec)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from tests.support.ranks import spec_main

    spec_main(main)

"""Processes for multi-sender runs on one machine: FSDP2 trainer ranks and module replicas.

Used by `tests/gpu/test_multisender_nccl.py` and `benchmarks/bench_multisender_gpu.py`.

- Trainer rank (`python -m tests.gpu.multisender_procs trainer SPEC`): one process per
  rank, a world of 2 (`nccl` on GPUs, `gloo` on CPU), a model with HF names built from
  `specs` (identical on every rank), `fully_shard`ed (every `layers.<i>` and the root).
  It pushes with `WeightSync(senders=...)` (every rank sends its share) or with one `WeightSync`
  on rank 0 (`enginehooks.trainer_side.push`: the other rank follows the lockstep
  gathers), and runs raw broadcasts for baselines.
- Replica (`python -m tests.gpu.multisender_procs replica SPEC`): a zeroed module of the
  same shapes on its device behind a `LocalEngine`, served over HTTP (`POST /rpc`, the
  `tests/multihost/replica.py` protocol, so the trainer reaches it with `RemoteModule`):
  it receives through `EngineSide`, the transport receivers and `Receiver.deliver`,
  the code the engine plugins run. With `plans`, each replica records the copy plan of
  its by-name loader, so its `info` reports its needs and shard-direct can schedule to it.

Both read one JSON command per stdin line and answer one JSON line on stdout (logs go to
stderr); `Procs` drives them, every read with a deadline, and kills what it started.
Bit-exact checks compare per-tensor `sum64` digests (`core/checksums.sum64_tensor`) of
the trainer's full state dict (gathered) with each replica's parameters.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.support.json_http import JsonHandler

ROOT = Path(__file__).resolve().parents[2]
MASK64 = (1 << 64) - 1

#: set in every child unless already set (multicast off: docs/KINDS in the GPU notes)
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# -- shared --------------------------------------------------------------------------------
def build_model(specs: list[list[Any]], device: torch.device, seed: int | None) -> nn.Module:
    """A module tree with one parameter per `[name, dtype, shape]`: random values from
    `seed` (the same on every rank), or zeros (`seed` None: a replica)."""
    root = nn.Module()
    g = None
    if seed is not None:
        g = torch.Generator(device=device).manual_seed(seed)
    for name, dtype, shape in specs:
        *path, leaf = name.split(".")
        mod = root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        dt = getattr(torch, dtype)
        t = torch.zeros(tuple(shape), dtype=dt, device=device)
        if g is not None:
            t.copy_(torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32))
        mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    return root


def tensor_digest(t: torch.Tensor) -> str:
    from enginehooks.core.checksums import sum64_tensor

    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return f"{int(sum64_tensor(b).item()) & MASK64:016x}:{b.numel()}"


def _answer(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bcast_opts() -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


class _RawGroups:
    """Raw broadcast groups of the baselines (`ProcessGroupNCCL`/`Gloo` over a store)."""

    def __init__(self, device: torch.device, backend: str, timeout_s: float) -> None:
        self.device, self.backend, self.timeout_s = device, backend, timeout_s
        self.stores: dict[str, Any] = {}
        self.groups: dict[str, Any] = {}
        self.bufs: dict[str, torch.Tensor] = {}

    def store(self, tag: str) -> int:
        from enginehooks.transports._rendezvous import master_store

        s = self.stores[tag] = master_store("127.0.0.1", 0, self.timeout_s)
        return int(s.port)

    def join(self, tag: str, rank: int, world: int, port: int | None = None) -> None:
        from enginehooks.transports._rendezvous import client_store, new_group

        if port is not None:
            self.stores[tag] = client_store("127.0.0.1", port, self.timeout_s)
        pg = new_group(self.backend, self.stores[tag], f"raw-{tag}/", rank, world,
                       self.timeout_s)
        pg.broadcast([torch.zeros(1, device=self.device)], _bcast_opts()).wait()
        _sync(self.device)
        self.groups[tag] = pg

    def post(self, tag: str, sizes: list[int]) -> list[Any]:
        n = max(sizes)
        buf = self.bufs.get(tag)
        if buf is None or buf.numel() < n:
            buf = self.bufs[tag] = torch.empty(n, dtype=torch.uint8, device=self.device)
        return [self.groups[tag].broadcast([buf[:k]], _bcast_opts()) for k in sizes]

    def close(self, tag: str) -> None:
        pg = self.groups.pop(tag, None)
        self.bufs.pop(tag, None)
        self.stores.pop(tag, None)
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()


# -- trainer rank ----------------------------------------------------------------------------
def trainer_main(spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from enginehooks import WeightSync
    from enginehooks.trainer_side import TrainerRanks
    from enginehooks.trainer_side.lockstep import push as lockstep_push
    from tests.multihost.replica import RemoteModule

    rank, backend = int(spec["rank"]), spec["backend"]
    timeout_s, bucket = float(spec["timeout_s"]), int(spec["bucket_bytes"])
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{spec['master']}", rank=rank,
                            world_size=2, timeout=_dt.timedelta(seconds=timeout_s * 4))
    # the world's communicator now, not lazily inside the first push's lockstep gathers
    dist.all_reduce(torch.zeros(1, device=device))
    _sync(device)
    control = dist.new_group(backend="gloo")  # the senders' own control channel
    mesh = init_device_mesh(device.type, (2,))
    model = build_model(spec["specs"], device, seed=int(spec.get("seed", 1234)))
    for name, mod in model.named_modules():
        if name.split(".")[-1:] == ["layers"]:
            for layer in mod.children():
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _sync(device)
    replicas = [RemoteModule(r["url"], r["name"]) for r in spec.get("replicas") or []]
    syncs: dict[str, Any] = {}
    raw = _RawGroups(device, backend, timeout_s)

    def get_sync(mode: str) -> Any:
        if mode in syncs:
            return syncs[mode]
        if mode in ("multi", "shard"):  # "shard": shard-direct, along the schedule
            transport = backend if mode == "multi" else (
                "shard_nccl" if backend == "nccl" else "shard")
            s = WeightSync(transport, senders=TrainerRanks(control, timeout_s=timeout_s),
                           host="127.0.0.1", timeout_s=timeout_s, bucket_bytes=bucket)
        elif rank == 0:  # "single": rank 0 alone sends; `device` as the user would pass it
            dev = spec.get("single_device")
            s = WeightSync(backend, host="127.0.0.1", timeout_s=timeout_s, bucket_bytes=bucket,
                           device=torch.device(dev) if dev else None)
        else:
            s = None
        if rank == 0 and s is not None:
            for h in replicas:
                s.add_replica(h)
        syncs[mode] = s
        return s

    def close(mode: str) -> None:
        s = syncs.pop(mode, None)
        if s is not None:
            s.close()

    _answer({"ready": True, "rank": rank})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        try:
            out: dict[str, Any] = {"ok": True}
            if op == "perturb":
                g = torch.Generator(device=device).manual_seed(int(cmd["seed"]) * 7919 + rank)
                with torch.no_grad():
                    for p in model.parameters():
                        local = p._local_tensor if hasattr(p, "_local_tensor") else p.data
                        if local.numel():
                            noise = torch.randn(local.shape, generator=g, device=device)
                            local.add_((noise * 0.25).to(local.dtype))
                _sync(device)
            elif op == "push":
                mode = cmd["mode"]
                s = get_sync(mode)
                t0 = time.perf_counter()
                if mode in ("multi", "shard"):
                    report = s.push(model, cmd["version"])
                else:
                    report = lockstep_push(model, cmd["version"], sync=s)
                _sync(device)
                out["seconds"] = time.perf_counter() - t0
                if report is not None:
                    out.update(bytes=report.bytes, buckets=report.buckets,
                               phases=dict(report.phases))
                    senders = [r.stats for r in getattr(report, "replicas", [])][:1]
                    out["replica_stats"] = senders
                    if rank == 0:  # the coordinator's report: calls, path, both sides' phases
                        workers = [w for r in report.replicas
                                   for w in (r.stats or {}).get("workers") or []]
                        out.update(rpcs=report.rpcs, layout=report.layout,
                                   sender_phases_ms=dict(report.sender.get("phases_ms") or {}),
                                   replica_phases_ms=[dict(w.get("phases_ms") or {})
                                                      for w in workers])
            elif op == "close":
                close(cmd["mode"])
            elif op == "digests":
                digests = {}
                for name, p in model.state_dict().items():
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    digests[name] = tensor_digest(full)  # only rank 0's answer is used
                    del full
                out["digests"] = digests if rank == 0 else {}
            elif op == "raw_store":
                out["port"] = raw.store(cmd["tag"])
            elif op == "raw_join":
                raw.join(cmd["tag"], 0, int(cmd["world"]))
            elif op == "raw_send":
                _sync(device)
                t0 = time.time()
                works = raw.post(cmd["tag"], [int(x) for x in cmd["sizes"]])
                for w in works:
                    w.wait()
                _sync(device)
                out.update(t0=t0, t1=time.time())
            elif op == "raw_close":
                raw.close(cmd["tag"])
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:
            traceback.print_exc()
            out = {"ok": False, "type": type(e).__name__, "error": f"{e}"[:4000]}
        _answer(out)
    for mode in list(syncs):
        with contextlib.suppress(Exception):
            close(mode)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


# -- replica ---------------------------------------------------------------------------------
def replica_main(spec: dict[str, Any]) -> None:
    from enginehooks.engine.contract import verb_of
    from enginehooks.engine.local import LocalEngine

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout_s = float(spec["timeout_s"])
    module = build_model(spec["specs"], device, seed=None)
    engine = LocalEngine(module, name=spec["name"], device=device)
    if spec.get("plan"):  # a copy plan recorded from its loader: `info` reports its needs
        from enginehooks.core.manifest import TensorSpec
        from enginehooks.engine.copy_plan import PlanState, record_plan

        def load(model: nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> None:
            params = dict(model.named_parameters())
            for n, t in items:
                params[n].copy_(t)

        cplan = record_plan(build_model(spec["specs"], torch.device("meta"), seed=None),
                            [TensorSpec(n, dt, tuple(sh)) for n, dt, sh in spec["specs"]],
                            load)
        engine.target.plan = PlanState("local")  # type: ignore[attr-defined]
        engine.target.plan.adopt(cplan, None)  # type: ignore[attr-defined]

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            self._send(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if device.type == "cuda":  # an engine worker's threads run on its GPU
                torch.cuda.set_device(device)
            try:
                result = engine.side.call(verb_of(body["method"]), *body["args"])
            except Exception as e:
                sys.stderr.write(f"[replica {spec['name']}] {body['method']}: "
                                 f"{type(e).__name__}: {e}\n")
                self._send(500, {"error": f"{type(e).__name__}: {e}"})
                return
            with contextlib.suppress(OSError):
                self._send(200, {"results": [result]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    raw = _RawGroups(device, spec["backend"], timeout_s)
    pending: dict[str, Any] = {}
    _answer({"ready": f"http://127.0.0.1:{server.server_address[1]}"})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        try:
            out: dict[str, Any] = {"ok": True}
            if op == "digests":
                out["digests"] = {n: tensor_digest(p) for n, p in module.state_dict().items()}
            elif op == "raw_join":
                raw.join(cmd["tag"], int(cmd["rank"]), int(cmd["world"]), int(cmd["port"]))
            elif op == "raw_post":
                # every group's receives posted now (on NCCL: enqueued, the host goes
                # on); a thread waits for them and notes when they all landed
                works = [w for tag, sizes in cmd["sizes"].items()
                         for w in raw.post(tag, [int(x) for x in sizes])]
                box: dict[str, Any] = {}

                def wait_all(works: list[Any] = works, box: dict[str, Any] = box) -> None:
                    try:
                        if device.type == "cuda":
                            torch.cuda.set_device(device)
                        for w in works:
                            w.wait()
                        _sync(device)
                        box["t_end"] = time.time()
                    except BaseException as e:
                        box["error"] = f"{type(e).__name__}: {e}"

                th = threading.Thread(target=wait_all, daemon=True)
                th.start()
                pending["raw"] = (th, box)
            elif op == "raw_wait":
                th, box = pending.pop("raw")
                th.join(timeout_s)
                if th.is_alive():
                    raise TimeoutError(f"raw receives did not complete within {timeout_s}s")
                if "error" in box:
                    raise RuntimeError(box["error"])
                out["t_end"] = box["t_end"]
            elif op == "raw_close":
                raw.close(cmd["tag"])
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:
            traceback.print_exc()
            out = {"ok": False, "type": type(e).__name__, "error": f"{e}"[:4000]}
        _answer(out)
    server.shutdown()


# -- the driver ------------------------------------------------------------------------------
class Child:
    """One child process: JSON lines in, JSON lines out, stderr to `log`."""

    def __init__(self, role: str, spec: dict[str, Any], log: Path, env: dict[str, str]) -> None:
        from tests.multihost.conftest import Lines

        self.role, self.name = role, spec.get("name") or f"{role}-{spec.get('rank')}"
        self.logfile = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.multisender_procs", role, json.dumps(spec)],
            cwd=str(ROOT), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.logfile, text=True, start_new_session=True)
        self.lines = Lines(self.proc.stdout, self.name)  # type: ignore[arg-type]

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict[str, Any]:
        return self.lines.json(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def close(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(timeout=grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        with contextlib.suppress(Exception):
            self.logfile.close()


def child_env(smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in CHILD_ENV.items():
        env.setdefault(k, v)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if smoke:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """2 trainer ranks and len(replica_devices) replicas, started and always killed."""

    def __init__(self, specs: list[list[Any]], *, backend: str, trainer_devices: list[str],
                 replica_devices: list[str], timeout_s: float, bucket_bytes: int, logdir: Path,
                 single_device: str | None = None, start_timeout_s: float = 240.0,
                 plans: bool = False) -> None:
        self.timeout_s = timeout_s
        self.children: list[Child] = []
        env = child_env(smoke=backend == "gloo")
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        try:
            self.replicas = []
            for i, dev in enumerate(replica_devices):
                spec = {"name": f"replica-{i}", "device": dev, "specs": specs,
                        "backend": backend, "timeout_s": timeout_s, "plan": plans}
                c = Child("replica", spec, logdir / f"replica-{i}.log", env)
                self.children.append(c)
                self.replicas.append(c)
            urls = [c.read(start_timeout_s)["ready"] for c in self.replicas]
            master = f"127.0.0.1:{free_port()}"
            self.trainers = []
            for r, dev in enumerate(trainer_devices):
                spec = {"rank": r, "device": dev, "specs": specs, "backend": backend,
                        "master": master, "timeout_s": timeout_s, "bucket_bytes": bucket_bytes,
                        "single_device": single_device,
                        "replicas": [{"url": u, "name": f"replica-{i}"}
                                     for i, u in enumerate(urls)] if r == 0 else []}
                c = Child("trainer", spec, logdir / f"trainer-{r}.log", env)
                self.children.append(c)
                self.trainers.append(c)
            for c in self.trainers:
                c.read(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def call(self, who: Iterable[Child], cmd: dict[str, Any] | list[dict[str, Any]],
             timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Send `cmd` (or one command per child) to every child of `who`, then read each
        answer; raise with the child's error if any failed."""
        who = list(who)
        cmds = cmd if isinstance(cmd, list) else [cmd] * len(who)
        for c, x in zip(who, cmds, strict=True):
            c.send(x)
        deadline = time.monotonic() + (timeout_s or self.timeout_s * 2 + 30)
        out = [c.read(max(1.0, deadline - time.monotonic())) for c in who]
        bad = [f"{c.name}: {a.get('type')}: {a.get('error')}" for c, a in zip(who, out)
               if not a.get("ok")]
        if bad:
            raise RuntimeError("; ".join(bad))
        return out

    def push(self, mode: str, version: int) -> dict[str, Any]:
        return self.call(self.trainers, {"op": "push", "mode": mode, "version": version})[0]

    def perturb(self, seed: int) -> None:
        self.call(self.trainers, {"op": "perturb", "seed": seed})

    def check(self) -> dict[str, Any]:
        """Every replica against the trainer's full state dict, tensor by tensor."""
        want = self.call(self.trainers, {"op": "digests"})[0]["digests"]
        got = self.call(self.replicas, {"op": "digests"})
        bad = {c.name: sorted(n for n in want if g["digests"].get(n) != want[n])
               for c, g in zip(self.replicas, got)}
        extra = {c.name: sorted(set(g["digests"]) - set(want))
                 for c, g in zip(self.replicas, got)}
        ok = not any(bad.values()) and not any(extra.values()) and bool(want)
        return {"bit_exact": ok, "tensors": len(want),
                "mismatched": {k: v[:8] for k, v in bad.items() if v},
                "unexpected": {k: v[:8] for k, v in extra.items() if v},
                "digest": sorted(want.items())[:1]}

    def close(self) -> None:
        for c in getattr(self, "trainers", []):
            with contextlib.suppress(Exception):
                c.send({"op": "exit"})
        # the trainers first: rank 0's close tells the replicas to leave its groups
        for c in [*getattr(self, "trainers", []), *getattr(self, "replicas", [])]:
            c.close(grace_s=20.0)
        for c in self.children:
            c.kill()

    def kill(self) -> None:
        for c in self.children:
            c.kill()


def main(argv: list[str]) -> None:
    role, spec = argv[0], json.loads(argv[1])
    if role == "trainer":
        trainer_main(spec)
    elif role == "replica":
        replica_main(spec)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

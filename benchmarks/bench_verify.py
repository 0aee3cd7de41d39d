"""What verifying every update costs: push time with verification always vs never (issue 38).

One engine per run, started with `ENGINEHOOKS_VERIFY=never`; after the two set-up pushes
(the first records the copy plan through the engine's loader, the second is the plan's
first use, verified in full whatever the policy), each round makes unverified pushes
(policy "never") then verified ones (the trainer asks, `WeightSync(verify=True)`, which
runs exactly what policy "always" runs), so both see the same load on a shared machine;
the first two pushes of each kind in a round are not counted (`phases`: the first takes
the full path, the second rebuilds the launch tables the switch moved; the steady ones
repeat the prepared layout). Per
verified push: how it was verified (`how`), the bytes proved by digests of what the
plan wrote against what was received, and the bytes compared on the fresh-load shadow.

Engines:
- `vllm`, `sglang`: the real engines on CPU, a checkpoint of Qwen2.5-0.5B's shapes
  (0.99 GB in bf16; `bench_gloo_cpu.py --preset qwen05b`), pushed from a bf16 trainer.
- `module`: a module replica on one GPU (`--device cuda`), an `ApplyTarget` around a
  plain torch model of ~`--gb` GB (no transformers needed), its loader a copy by name,
  in this process: pushed over gloo (the in-process transport; the bytes are staged
  through the host, so the push is slower than cuda_ipc's), with a raw device copy of
  the same weights as the floor (`machine.raw_device_copy_s`). Its shadow streams block
  by block (`shadow_parts`), as vLLM's and SGLang's do. Per push the verdict's
  `seconds` give the verification's own time (digests, shadow, compare).

    python benchmarks/bench_verify.py --engine vllm --out benchmarks/results/verify/cpu.json
    python benchmarks/bench_verify.py --engine vllm --shadow whole --out ...   # the old way
    python benchmarks/bench_verify.py --engine module --device cuda --out OUT.json

The verification shadow is streamed unit by unit by default (`engine/shadow.py`, issue 38);
`--shadow whole` builds it as a second whole model (`ENGINEHOOKS_SHADOW=whole`), stored
under `<engine>+whole-shadow`. Per push, `rss_peak_added_bytes` is how far the process's
resident high-water mark rose above its resident size before the push (Linux; reset
through /proc/self/clear_refs): for `vllm` (in-process engine core and worker) it
includes the shadow; for `sglang` the scheduler is another process, so it is left out.
For `module` on CUDA, `cuda_peak_added_bytes` is the allocator's peak above the start.

The GPU steady state of a module replica over nccl, on one host with two GPUs (the
trainer's tensors on cuda:1, the replica on cuda:0), and colocated over cuda_ipc (both on
cuda:0); gloo stages through the host:

    python benchmarks/bench_verify.py --engine module --device cuda:0 --gb 1 \
        --transport nccl --sender-device cuda:1 --out benchmarks/results/verify/gpu.json
    python benchmarks/bench_verify.py --engine module --device cuda:0 --gb 1 \
        --transport cuda_ipc --sender-device cuda:0 --out benchmarks/results/verify/gpu.json

With `nccl` or `cuda_ipc` the replica lives in a spawned process (`bench_e2e`'s
`ProcessReplica`, JSON over a pipe): their join and receive block until the trainer's
side meets them, which a replica in the trainer's own thread never would (the first
version of this benchmark ran the replica in-process over nccl and waited out its
timeout), and CUDA IPC handles cannot be opened in the process that made them.

Results merge into `--out` (one key per engine) with the machine description.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["ENGINEHOOKS_VERIFY"] = "never"  # the trainer asks for the verified pushes
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

BUCKET = 64 << 20


# -- the module replica (GPU) --------------------------------------------------------------
class Blocks(torch.nn.Module):
    """A stack of transformer-sized blocks (norm, two projections): plain torch."""

    def __init__(self, layers: int, hidden: int, inner: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.norm = torch.nn.LayerNorm(hidden, dtype=dtype)
            block.up = torch.nn.Linear(hidden, inner, bias=False, dtype=dtype)
            block.down = torch.nn.Linear(inner, hidden, bias=False, dtype=dtype)
            self.layers.append(block)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)


def blocks_builder(gb: float) -> Callable[[torch.device], torch.nn.Module]:
    """A builder of the ~`gb` GB bf16 stack of blocks, on a given device."""
    hidden, inner = 2048, 8192
    per_layer = (2 * hidden * inner + 2 * hidden) * 2
    layers = max(1, round(gb * 1e9 / per_layer))

    def build(dev: torch.device) -> torch.nn.Module:
        with dev:
            return Blocks(layers, hidden, inner, torch.bfloat16)

    return build


def module_trainer(gb: float, where: torch.device) -> Callable[[int], dict[str, torch.Tensor]]:
    """trainer(seed): new weights for the replica's every tensor, on `where`."""
    shapes = {n: p.shape for n, p in blocks_builder(gb)(torch.device("meta")).state_dict().items()}

    def trainer(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device=where).manual_seed(seed)
        return {n: torch.randn(s, generator=g, device=where, dtype=torch.float32)
                .to(torch.bfloat16) for n, s in shapes.items()}

    return trainer


def module_replica(gb: float, device: torch.device,
                   sender: torch.device | None = None) -> tuple[Any, Callable[[int], Any]]:
    """(handle, trainer(seed)) for a module replica of ~`gb` GB in bf16 on `device`, its
    shadow streamed block by block (`enginehooks_testkit.inprocess_replica`)."""
    from enginehooks_testkit.inprocess_replica import inprocess_replica

    handle, model = inprocess_replica(blocks_builder(gb), device, streamed_shadow=True)
    trainer = module_trainer(gb, sender or device)

    def raw_copy() -> float:
        """Seconds of a device copy of every weight (the floor a push of them has)."""
        src = [p.detach() for p in model.parameters()]
        dst = [torch.empty_like(t) for t in src]
        best = float("inf")
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            torch._foreach_copy_(dst, src)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best

    handle.raw_copy = raw_copy
    return handle, trainer


def replica_process_main(conn: Any, cfg_json: str) -> None:
    """The module replica in a spawned process: JSON calls over `conn` (`rpc`, `memory`
    to start and read the allocator's peak, `stop`); the first reply is the raw copy's
    floor."""
    cfg = json.loads(cfg_json)
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    handle, _ = module_replica(cfg["gb"], device)
    profile_to = os.environ.get("ENGINEHOOKS_BENCH_PROFILE")
    if profile_to:
        _profile_steady_applies(Path(profile_to))
    conn.send_bytes(json.dumps({"raw_device_copy_s": handle.raw_copy()}).encode())
    memory: Memory | None = None
    while True:
        msg = json.loads(conn.recv_bytes())
        reply: dict[str, Any]
        try:
            if msg["op"] == "stop":
                conn.send_bytes(b"{}")
                return
            if msg["op"] == "memory":
                if msg.get("start"):
                    memory = Memory(False, device if device.type == "cuda" else None)
                    reply = {}
                else:
                    reply = {"cuda": memory.added()[1] if memory is not None else None}
            else:
                reply = {"ok": handle.rpc(msg["method"], *msg["args"],
                                          timeout_s=msg["timeout_s"])}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        conn.send_bytes(json.dumps(reply).encode())


def _profile_steady_applies(path: Path) -> None:
    """Profile (cProfile, in this replica process) every call that applied a steady
    push, verified and not (`phases`): the whole call (the receive, the apply, the
    verification, the reply), and write each kind's tables beside `path`
    (`<stem>-always`, `<stem>-never`) after each: where the time verification adds
    goes, function by function (cumulative, then own time)."""
    import cProfile
    import pstats

    from enginehooks.engine.apply import ApplyTarget
    from enginehooks.engine.side import EngineSide

    real_apply, real_call = ApplyTarget.apply, EngineSide.call
    stats: dict[str, pstats.Stats] = {}
    applies = [0]
    kinds = phases(1000, int(os.environ.get("ENGINEHOOKS_BENCH_STEADY", STEADY)))

    def apply(self: ApplyTarget, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        applies[0] += 1
        real_apply(self, tensors)

    def call(self: EngineSide, *args: Any, **kw: Any) -> Any:
        before = applies[0]
        prof = cProfile.Profile()
        prof.enable()
        try:
            return real_call(self, *args, **kw)
        finally:
            prof.disable()
            kind = kinds[applies[0] - 1] if applies[0] > before else None
            if kind in ("always", "never"):
                if kind in stats:
                    stats[kind].add(prof)
                else:
                    stats[kind] = pstats.Stats(prof)
                _write_profiles(path, stats)

    ApplyTarget.apply = apply  # type: ignore[method-assign]
    EngineSide.call = call  # type: ignore[method-assign]


def _write_profiles(path: Path, stats: dict[str, Any]) -> None:
    """Each kind's table: cumulative, then own time (`<stem>-<kind><suffix>`)."""
    import io

    for kind, st in stats.items():
        out = io.StringIO()
        st.stream = out
        st.sort_stats("cumulative").print_stats(40)
        st.sort_stats("tottime").print_stats(30)
        path.with_name(f"{path.stem}-{kind}{path.suffix}").write_text(out.getvalue())


def process_replica(gb: float, device: torch.device) -> tuple[Any, float]:
    """(handle, raw copy seconds) of a module replica in a spawned process."""
    from bench_e2e import ProcessReplica

    replica = ProcessReplica({"gb": gb, "device": str(device)}, main=replica_process_main)
    if not replica.conn.poll(1800):
        raise TimeoutError("the replica process did not start within 1800 s")
    raw = float(json.loads(replica.conn.recv_bytes())["raw_device_copy_s"])
    return replica, raw


# -- the real engines (CPU) ----------------------------------------------------------------
def engine_replica(engine: str, model_dir: Path) -> tuple[Any, Any, Callable[[int], Any]]:
    from enginehooks_testkit.engines import start_engine
    from enginehooks_testkit.tiny import load_tiny, perturb

    running = start_engine(engine, model_dir, dtype="bfloat16")
    # one bf16 trainer model, 'trained' in place before each push (a copy per push would
    # hold another model's memory on a machine the engine and its shadow share)
    base = load_tiny(model_dir).to(torch.bfloat16)

    def trainer(seed: int) -> Any:
        return perturb(base, seed=seed, scale=0.01)

    return running, running.handle(), trainer


class Memory:
    """How far memory rose during one push: the process's resident high-water mark above
    its resident size before (Linux, where /proc/self/clear_refs resets the mark), and
    on CUDA the allocator's peak above what was allocated before."""

    def __init__(self, rss: bool, cuda: torch.device | None) -> None:
        self.rss0 = self.cuda0 = None
        self.cuda = cuda
        if rss:
            try:
                Path("/proc/self/clear_refs").write_text("5")
                self.rss0 = self._status("VmRSS")
            except OSError:
                pass
        if cuda is not None:
            torch.cuda.synchronize(cuda)
            torch.cuda.reset_peak_memory_stats(cuda)
            self.cuda0 = torch.cuda.memory_allocated(cuda)

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
        raise OSError(key)

    def added(self) -> tuple[int | None, int | None]:
        rss = self._status("VmHWM") - self.rss0 if self.rss0 is not None else None
        cuda = None
        if self.cuda is not None and self.cuda0 is not None:
            cuda = torch.cuda.max_memory_allocated(self.cuda) - self.cuda0
        return rss, cuda


#: steady pushes of each kind per round (`phases`)
STEADY = 2


def phases(rounds: int, steady: int = STEADY) -> list[str]:
    """The pushes `push_rows` makes. Each round: unverified pushes, then verified ones.
    The first two of each kind are not counted. The first ("-first"): the trainer's
    `verify` is part of the layout key, so a push after a switch takes the full path
    (plan, check, two calls per replica) where the next takes the prepared layout (one
    call); and the first verified push after an unverified one keeps host copies (the
    update before it was not verified). The second ("-settle"): the first on the
    prepared layout after a switch; the switch moved the trainer's and the engine's
    allocations, so both sides rebuild the device tables of their launches, which
    repeat push after push only once the addresses do (measured on 1x H200: the
    trainer's digest launch 0.85-0.93 ms in that push against 0.22-0.35 ms in the
    next). A training loop verifies every push or none; it never switches. What is
    compared is the steady state of each: `steady` prepared pushes of each kind per
    round, the k-th against the k-th (`layout` is in every row)."""
    return (["record", "plan-first"]
            + (["never-first", "never-settle"] + ["never"] * steady
               + ["always-after-never", "always-settle"] + ["always"] * steady) * rounds)


def push_rows(handle: Any, trainer: Callable[[int], Any], rounds: int, transport: str = "gloo",
              sender: str | None = None, measure_rss: bool = False,
              cuda_device: torch.device | None = None,
              steady: int = STEADY) -> list[dict[str, Any]]:
    import cProfile
    import pstats

    from enginehooks import WeightSync

    rows: list[dict[str, Any]] = []
    profile_to = os.environ.get("ENGINEHOOKS_BENCH_PROFILE")
    trainer_stats: dict[str, pstats.Stats] = {}

    def trainer_profile(phase: str) -> cProfile.Profile | None:
        if not profile_to or phase not in ("always", "never"):
            return None
        prof = cProfile.Profile()
        prof.enable()
        return prof

    with WeightSync(transport, bucket_bytes=BUCKET, timeout_s=600, device=sender) as sync:
        sync.add_replica(handle)
        # Each round: an unverified push, a verified one after it (which keeps copies of
        # what its digests prove: the update before it was not verified), then the
        # verified one the summary counts: a verified push after a verified one, the
        # steady state of the default policy (no copies where digests proved all).
        for i, phase in enumerate(phases(rounds, steady)):
            weights = trainer(1000 + i)
            sync.verify = phase.startswith("always")
            remote = hasattr(handle, "_call")  # a replica process: its allocator's peak
            memory = Memory(measure_rss, None if remote else cuda_device)
            if remote:
                handle._call({"op": "memory", "start": True}, 60)
            prof = trainer_profile(phase)
            t0 = time.perf_counter()
            report = sync.push(weights, version=i + 1)
            wall = time.perf_counter() - t0
            if prof is not None:  # the trainer's side of the same pushes
                prof.disable()
                kind = phase.split("-")[0]
                if kind in trainer_stats:
                    trainer_stats[kind].add(prof)
                else:
                    trainer_stats[kind] = pstats.Stats(prof)
                to = Path(str(profile_to))
                _write_profiles(to.with_name(f"{to.stem}-trainer{to.suffix}"), trainer_stats)
            rss_peak, cuda_peak = memory.added()
            if remote:
                cuda_peak = handle._call({"op": "memory"}, 60)["cuda"]
            weights = None
            info = handle.info(120)[0]
            last = (info.get("verification") or {}).get("last") or {}
            plan = info.get("copy_plan") or {}
            # the first worker's own stats of this update (`EngineSide.receive`)
            workers = report.replicas[0].stats.get("workers") if report.replicas else None
            worker = workers[0] if isinstance(workers, list) and workers else {}
            rows.append({"phase": phase, "seconds": round(wall, 6),
                         "report_seconds": round(report.seconds, 4), "bytes": report.bytes,
                         "layout": report.layout,
                         # where the push's time went, both sides (ms): the trainer's
                         # phases, its sender's, the receiving worker's
                         "phases_ms": {
                             "trainer": {k: round(v * 1e3, 3) for k, v in report.phases.items()},
                             "sender": report.sender.get("phases_ms"),
                             "receiver": worker.get("phases_ms"),
                             "receiver_ms": (round(worker["seconds"] * 1e3, 3)
                                             if "seconds" in worker else None)},
                         "apply_seconds": plan.get("seconds"),
                         # the engine side's apply: before the load, the load, the
                         # landed names, the post-load step, the verification (ms)
                         "apply_phases_ms": plan.get("phases_ms"),
                         "verification": {k: last.get(k) for k in (
                             "ok", "outcome", "how", "settled", "digest", "digest_bytes",
                             "landed_bytes", "arrived_bytes",
                             "shadow_bytes",
                             "compared", "probed", "unverified", "repaired", "error", "seconds",
                             "shadow_kind", "shadow_units", "shadow_why",
                             "shadow_tensor_bytes", "shadow_peak_bytes")},
                         "rss_peak_added_bytes": rss_peak, "cuda_peak_added_bytes": cuda_peak,
                         "planned_last": plan.get("planned_last"),
                         "twins_last": plan.get("twins_last"),
                         "loader_last": plan.get("loader_last")})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    never = [r["seconds"] for r in rows if r["phase"] == "never"]
    always = [r["seconds"] for r in rows if r["phase"] == "always"]
    # neighbours: each verified push against the unverified one just before it
    # the k-th steady unverified push of a round against the k-th steady verified one
    pairs = list(zip([r["seconds"] for r in rows if r["phase"] == "never"],
                     [r["seconds"] for r in rows if r["phase"] == "always"], strict=True))
    last = next((r["verification"] for r in reversed(rows) if r["phase"] == "always"), {})

    def median_of(phase: str, key: str) -> float | None:
        vals = [r[key] for r in rows if r["phase"] == phase and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    # where a verified push's verification time goes, step by step (the verdict's
    # `seconds`: digests, the shadow's lands/construct/load/process/drop, compare and its
    # probes, and during apply the host copies kept and the digests of what arrived)
    steps: dict[str, list[float]] = {}
    for r in rows:
        if r["phase"] == "always":
            for k, v in ((r["verification"] or {}).get("seconds") or {}).items():
                steps.setdefault(k, []).append(v)
    return {"shadow_kind": last.get("shadow_kind"), "shadow_units": last.get("shadow_units"),
            "shadow_tensor_bytes": last.get("shadow_tensor_bytes"),
            "verification_seconds": last.get("seconds"),
            "verification_seconds_median": {k: round(statistics.median(v), 4)
                                            for k, v in steps.items()},
            "never_rss_peak_added_median_bytes": median_of("never", "rss_peak_added_bytes"),
            "always_rss_peak_added_median_bytes": median_of("always", "rss_peak_added_bytes"),
            "always_cuda_peak_added_median_bytes": median_of("always", "cuda_peak_added_bytes"),
            "never_median_s": statistics.median(never) if never else None,
            "always_median_s": statistics.median(always) if always else None,
            "added_fraction_median": (statistics.median([(b - a) / a for a, b in pairs])
                                      if pairs else None),
            # the same, less sensitive to a slow unverified push paired with a fast
            # verified one: the medians' ratio, and the median of the pairs' differences
            "added_fraction_of_medians": (statistics.median(always) / statistics.median(never)
                                          - 1 if never and always else None),
            "added_seconds_median": (statistics.median([b - a for a, b in pairs])
                                     if pairs else None),
            "pairs": len(pairs),
            "how": last.get("how"), "digest_bytes": last.get("digest_bytes"),
            "landed_bytes": last.get("landed_bytes"),
            "arrived_bytes": last.get("arrived_bytes"),
            "shadow_bytes": last.get("shadow_bytes")}


def main() -> int:
    from bench_gloo_cpu import build_model, machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "sglang", "module"], required=True)
    ap.add_argument("--gb", type=float, default=1.0, help="module replica size")
    ap.add_argument("--device", default="cuda", help="module replica device")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of unverified, then "
                    "verified pushes")
    ap.add_argument("--steady", type=int, default=STEADY, help="steady pushes of each kind "
                    "per round (the pairs compared); more where a push takes milliseconds")
    ap.add_argument("--transport", default="gloo", help="gloo (one process, any device) or "
                    "nccl (with --sender-device on another GPU than --device)")
    ap.add_argument("--sender-device", default=None, help="where the trainer's tensors live")
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "enginehooks"
                                                / "bench-qwen05b"))
    ap.add_argument("--shadow", choices=["streamed", "whole"], default="streamed",
                    help="how the verification shadow is built (ENGINEHOOKS_SHADOW)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["ENGINEHOOKS_SHADOW"] = args.shadow
    os.environ["ENGINEHOOKS_BENCH_STEADY"] = str(args.steady)  # a replica process's profile

    desc = machine()
    running = None
    if args.engine == "module":
        device = torch.device(args.device)
        sender = torch.device(args.sender_device) if args.sender_device else None
        if device.type == "cuda":
            desc["gpu"] = torch.cuda.get_device_name(device)
        if args.transport == "gloo":
            handle, trainer = module_replica(args.gb, device, sender)
            desc["raw_device_copy_s"] = round(handle.raw_copy(), 5)
        else:  # the receiver must not share the trainer's process (see the docstring)
            handle, raw = process_replica(args.gb, device)
            running = handle
            trainer = module_trainer(args.gb, sender or device)
            desc["raw_device_copy_s"] = round(raw, 5)
    else:
        model_dir = build_model(Path(args.model_dir), "qwen05b")
        running, handle, trainer = engine_replica(args.engine, model_dir)
    try:
        cuda = (torch.device(args.device) if args.engine == "module"
                and torch.device(args.device).type == "cuda" else None)
        rows = push_rows(handle, trainer, args.rounds, args.transport, args.sender_device,
                         measure_rss=args.engine != "sglang", cuda_device=cuda,
                         steady=args.steady)
    finally:
        if running is not None:
            if hasattr(running, "stop"):
                running.stop()
            else:
                running.close()
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    key = args.engine if args.engine != "module" else f"module-{args.device}"
    key += f"-{args.transport}" if args.engine == "module" and args.transport != "gloo" else ""
    key += "+whole-shadow" if args.shadow == "whole" else ""
    old[key] = {
        "machine": desc, "shadow": args.shadow, "bucket_bytes": BUCKET, "transport": args.transport,
        "sender_device": args.sender_device, "summary": summary(rows), "pushes": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(old, indent=1))
    print(json.dumps(old[key]["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU benchmark: enginehooks gloo pushes against a raw gloo broadcast of the same bytes.

One run measures, with the same bucket size and the same byte count:
  raw            torch.distributed gloo broadcast of the update's bytes in buckets of the
                 same size (rank 0 -> rank 1), no digest, no trailer, no target
  local          WeightSync gloo push into a torch model (LocalEngine): digests,
                 trailers, manifest validation, direct buckets received straight into the
                 parameters (issue 20), small tensors packed
  local-packed   the same with every bucket packed (direct buckets off): the path before
                 issue 20, for an A/B in the same run
  vllm           push into a real in-process vLLM (CPU), copy plan on / off
                 (`ENGINEHOOKS_COPY_PLAN`, `--copy-plan`)
  sglang         push into a real SGLang engine (CPU), run by SGLang's own Python
                 (`--sglang-python`)
Each engine row runs in a child process of its own (an engine per process, torn down
with it), which measures its own `raw` first: every row is a ratio to raw gloo of the
same bytes in the same process, minutes apart at most. Both ends of a push run in one
process (the receiver on a thread or in the engine's scheduler process; gloo does its
I/O in its own threads), as a colocated deployment would. Prints a table and writes
JSON with the machine description; `--preset qwen05b` is Qwen2.5-0.5B's shapes
(0.99 GB in bf16) with random weights, built with transformers, no hub.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The checkout on the path: the test kit (enginehooks_testkit) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

PRESETS: dict[str, dict[str, Any]] = {
    # the default tiny Llama of the earlier runs (69 MB in fp32)
    "tiny": dict(arch="llama", vocab_size=8192, hidden_size=512, intermediate_size=1024,
                 layers=4, heads=8, kv_heads=2, tie=False, dtype="float32"),
    # Qwen2.5-0.5B's shapes: 494 M parameters, 0.99 GB in bf16
    "qwen05b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                    layers=24, heads=14, kv_heads=2, tie=True, dtype="bfloat16"),
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> dict[str, Any]:
    mem = ""
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    return {"platform": platform.platform(), "processor": cpu_model(), "cpus": os.cpu_count(),
            "memory": mem, "python": sys.version.split()[0], "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg()}


def build_model(folder: Path, preset: str) -> Path:
    """A random checkpoint of the preset's shapes (transformers' own classes), cached."""
    if (folder / "config.json").exists():
        return folder
    from transformers import LlamaConfig, Qwen2Config

    from enginehooks_testkit.tiny import save_tiny

    p = PRESETS[preset]
    cls = Qwen2Config if p["arch"] == "qwen2" else LlamaConfig
    config = cls(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                 intermediate_size=p["intermediate_size"], num_hidden_layers=p["layers"],
                 num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
                 head_dim=p["hidden_size"] // p["heads"], max_position_embeddings=512,
                 tie_word_embeddings=p["tie"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                 dtype=p["dtype"])
    return save_tiny(folder, config, seed=0, dtype=p["dtype"])


class RawGloo:
    """Plain gloo broadcasts of buffers of `sizes` bytes (rank 0 -> a rank-1 thread),
    one round at a time, so that rounds interleave with the pushes they are compared
    with: on a shared machine the load changes by the second, and a ratio of neighbours
    is what stays meaningful."""

    def __init__(self, sizes: list[int], rounds: int, timeout_s: float) -> None:
        from enginehooks.transports._rendezvous import client_store, master_store, new_group

        self.sizes = sizes
        store = master_store("127.0.0.1", 0, timeout_s)
        biggest = max(sizes)

        def receiver() -> None:
            pg = new_group("gloo", client_store("127.0.0.1", store.port, timeout_s), "raw/",
                           1, 2, timeout_s)
            buf = torch.empty(biggest, dtype=torch.uint8)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for _ in range(rounds):
                for n in sizes:
                    pg.broadcast([buf[:n]], opts).wait()

        self.thread = threading.Thread(target=receiver, daemon=True)
        self.thread.start()
        self.pg = new_group("gloo", store, "raw/", 0, 2, timeout_s)
        self.buf = torch.randint(0, 255, (biggest,), dtype=torch.uint8)

    def round(self) -> float:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t0 = time.perf_counter()
        for n in self.sizes:
            self.pg.broadcast([self.buf[:n]], opts).wait()
        return time.perf_counter() - t0


def sizes_of(model_dir: Path, dtype: torch.dtype, bucket: int) -> tuple[list[int], int, int]:
    """The raw row's broadcast sizes: the update's bytes cut into `bucket`-byte buckets
    as a packed plan lays them (the fewest messages for the same bytes)."""
    from enginehooks.core.buckets import message_bytes
    from enginehooks.core.manifest import TensorSpec, plan

    trainer = load_trainer(model_dir, dtype)
    sd = trainer.state_dict()
    m = plan([TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
              for n, t in sd.items()], weight_version=0, bucket_bytes=bucket)
    return [message_bytes(b.nbytes) for b in m.buckets], m.total_bytes, len(sd)


def load_trainer(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def run_rows(rows: list[str], args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Measure `rows` in this process, interleaved with rounds of raw gloo: each
    repetition runs one raw round and then one push of every row. The first `--warmup`
    repetitions (group set-up, the engines' copy plan recording and verification) are
    not counted."""
    from enginehooks import WeightSync
    from enginehooks.transports.collectives import GlooTransport

    dtype = getattr(torch, args.dtype)
    bucket = int(args.bucket_mb * (1 << 20))
    checksum = None if args.checksum == "none" else args.checksum
    timeout_s = 600.0
    sizes, nbytes, ntensors = sizes_of(model_dir, dtype, bucket)
    out: dict[str, Any] = {"bytes": nbytes, "tensors": ntensors, "raw_buckets": len(sizes),
                           "rows": {}}
    trainer = load_trainer(model_dir, dtype)
    direct_min = GlooTransport.direct_min
    syncs: dict[str, tuple[Any, int | None]] = {}
    engines: dict[str, Any] = {}
    handles: dict[str, Any] = {}
    replicas: dict[str, Any] = {}
    times: dict[str, list[float]] = {"raw": []}
    reports: dict[str, list[Any]] = {}
    with contextlib.ExitStack() as stack:
        for row in rows:
            name = row
            if row in ("local", "local-packed"):
                from enginehooks.engine.local import LocalEngine

                replicas[row] = load_trainer(model_dir, dtype)
                handles[row] = LocalEngine(replicas[row], name=row)
            elif row in ("vllm", "sglang"):
                from enginehooks_testkit.engines import SGLangInProcess, VLLMInProcess

                name = f"{row}(plan {os.environ.get('ENGINEHOOKS_COPY_PLAN', 'on')})"
                cls = VLLMInProcess if row == "vllm" else SGLangInProcess
                engines[name] = cls(model_dir, dtype=args.dtype)
                stack.callback(engines[name].close)
                handles[name] = engines[name].handle()
            else:
                raise SystemExit(f"unknown row {row!r}")
            s = stack.enter_context(WeightSync("gloo", bucket_bytes=bucket, timeout_s=timeout_s,
                                               checksum=checksum))
            s.add_replica(handles[name])
            syncs[name] = (s, None if row == "local-packed" else direct_min)
        raw = RawGloo(sizes, args.warmup + args.reps, timeout_s)
        for rep in range(args.warmup + args.reps):
            t_raw = raw.round()
            line = [f"raw {t_raw * 1e3:.0f}"]
            if rep >= args.warmup:
                times["raw"].append(t_raw)
            for name, (s, dmin) in syncs.items():
                GlooTransport.direct_min = dmin
                try:
                    report = s.push(trainer, version=rep)
                finally:
                    GlooTransport.direct_min = direct_min
                line.append(f"{name} {report.phases['transfer'] * 1e3:.0f}")
                if rep >= args.warmup:
                    times.setdefault(name, []).append(report.phases["transfer"])
                    reports.setdefault(name, []).append(
                        {"phases": report.phases,
                         "replica_stats": [r.stats for r in report.replicas]})
            load = os.getloadavg()[0]  # the shared machine's load, next to each round
            out.setdefault("load_avg_1min_per_rep", []).append(load)
            print(f"  rep {rep}{' (warm-up)' if rep < args.warmup else ''}, ms: "
                  + ", ".join(line) + f" (load {load:.1f})", flush=True)
        for name in engines:
            out.setdefault("engine_info", {})[name] = handles[name].info(60)
    for row, replica in replicas.items():
        for a, b in zip(trainer.state_dict().values(), replica.state_dict().values()):
            assert torch.equal(a, b), f"benchmark push ({row}) was not bit-exact"
    raw_med = statistics.median(times["raw"])
    for name, ts in times.items():
        med = statistics.median(ts)
        out["rows"][name] = {
            "all_s": ts, "median_s": med, "gbps": nbytes / med / 1e9,
            "speed_vs_raw": raw_med / med, "raw_median_s": raw_med,
            # repetition by repetition: raw and the push ran seconds apart
            "speed_vs_raw_paired_median": statistics.median(
                r / t for r, t in zip(times["raw"], ts)),
            "reports": reports.get(name, []),
        }
    return out


def child(row: str, args: argparse.Namespace, model_dir: Path, python: str,
          plan: str | None) -> dict[str, Any]:
    """Run one engine row in a fresh process (its own raw first)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="enginehooks-bench-")
    os.close(fd)
    cmd = [python, __file__, "--child", row, "--model-dir", str(model_dir), "--reps",
           str(args.reps), "--warmup", str(args.warmup), "--bucket-mb", str(args.bucket_mb),
           "--checksum", args.checksum, "--dtype", args.dtype, "--preset", args.preset, "--out", path]
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
    if plan is not None:
        env["ENGINEHOOKS_COPY_PLAN"] = plan
    print(f"  [{row}{'' if plan is None else ' plan ' + plan}] {' '.join(cmd[:2])} ...",
          flush=True)
    proc = subprocess.run(cmd, env=env, timeout=args.child_timeout_s, capture_output=True,
                          text=True)
    sys.stdout.write(proc.stdout[-4000:])
    if proc.returncode:
        sys.stdout.write(proc.stderr[-6000:])
        return {"error": f"{row} exited {proc.returncode}: {proc.stderr[-800:]}"}
    return json.loads(Path(path).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--dtype", default=None, help="the preset's dtype unless given")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", default="local,local-packed,vllm,sglang")
    ap.add_argument("--copy-plan", default="on,off",
                    help="engine rows with ENGINEHOOKS_COPY_PLAN on and/or off")
    ap.add_argument("--sglang-python",
                    default=str(Path.home() / ".cache/enginehooks/venv-sglang/bin/python"))
    ap.add_argument("--checksum", default="xxh3", help="xxh3, crc32, sum64 or none")
    ap.add_argument("--model-dir", default=None, help="reuse (or build) the checkpoint here")
    ap.add_argument("--child-timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or PRESETS[args.preset]["dtype"]
    model_dir = Path(args.model_dir) if args.model_dir else Path(
        tempfile.mkdtemp(prefix="enginehooks-bench-")) / args.preset
    if args.child:
        result = run_rows([args.child], args, model_dir)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        return 0

    t0 = time.perf_counter()
    build_model(model_dir, args.preset)
    print(f"model {args.preset} ready in {time.perf_counter() - t0:.0f}s: {model_dir}",
          flush=True)
    rows = [r for r in args.rows.split(",") if r]
    here = [r for r in rows if r.startswith("local")]
    result: dict[str, Any] = {
        "benchmark": "bench_gloo_cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "params": {"preset": args.preset, **PRESETS[args.preset], "dtype": args.dtype,
                   "bucket_bytes": int(args.bucket_mb * (1 << 20)), "reps": args.reps,
                   "checksum": args.checksum},
    }
    main_run = run_rows(here, args, model_dir)
    result["params"].update(bytes=main_run["bytes"], tensors=main_run["tensors"])
    table = [(name, r, main_run["rows"]["raw"]["median_s"]) for name, r in
             main_run["rows"].items()]
    result["rows"] = dict(main_run["rows"])
    result["children"] = {}
    for row in rows:
        if row.startswith("local"):
            continue
        python = args.sglang_python if row == "sglang" else sys.executable
        for plan in args.copy_plan.split(","):
            sub = child(row, args, model_dir, python, plan)
            key = f"{row}(plan {plan})"
            result["children"][key] = sub
            if "error" in sub:
                print(f"  {key}: {sub['error'][:300]}")
                continue
            result["rows"][key] = sub["rows"][key]
            result["rows"][f"raw[{key}]"] = sub["rows"]["raw"]
            table.append((key, sub["rows"][key], sub["rows"]["raw"]["median_s"]))
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    nbytes = main_run["bytes"]
    print(f"load average at start {result['machine']['load_avg_at_start']}, at end "
          f"{result['machine']['load_avg_at_end']}")
    print(f"\n{args.preset}: {nbytes / 1e6:.1f} MB ({args.dtype}, {main_run['tensors']} "
          f"tensors), buckets of {args.bucket_mb} MiB, checksum={args.checksum}, "
          f"median of {args.reps}")
    print(f"{'path':<18} {'seconds':>9} {'GB/s':>8} {'raw s':>8} {'x raw speed':>12}")
    for name, r, raw in table:
        print(f"{name:<18} {r['median_s']:>9.4f} {r['gbps']:>8.3f} {raw:>8.4f} "
              f"{r['speed_vs_raw']:>12.3f}")
    out = Path(args.out or f"benchmarks/results/gloo-cpu-{args.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

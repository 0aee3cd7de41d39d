"""MoE sweep: the engine's apply time per byte as experts grow, copy plan on vs off.

Qwen3-MoE shapes (transformers' own `Qwen3MoeConfig`, random weights, tiny hidden size
so the expert count, not the matmul size, dominates) at 8, 32 and 128 experts, pushed
over gloo into a real engine (vLLM in-process on CPU; SGLang with `--engine sglang`,
run by SGLang's Python). For each expert count and plan setting a child process starts
one engine (`ENGINEHOOKS_COPY_PLAN=on|off`), pushes twice to warm up (with the plan on
the first push records the plan through the engine's loader, the second is applied
through it and verified against a fresh load), then `--reps` pushes are measured:

  apply      seconds inside the engine's target (`info()["copy_plan"]["seconds"]`:
             the loader or the plan, and the engine's post-load processing)
  apply cpu  the CPU seconds of the thread that applied (`cpu_seconds`): on a shared
             machine wall time includes waiting for a core, CPU time does not
  push       the whole push as the trainer sees it
  memcpy     the raw primitive in the same process: one `copy_` of the same bytes
             (the fastest of several)

Target (issue 20): apply time per byte flat within 1.5x from 8 to 128 experts. Prints
a table and writes JSON with the machine description.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The checkout on the path: the test kit (enginehooks_testkit) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "processor": cpu, "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg()}


def build(folder: Path, experts: int, args: argparse.Namespace) -> Path:
    """A random Qwen3-MoE checkpoint with `experts` experts (cached)."""
    if (folder / "config.json").exists():
        return folder
    from transformers import Qwen3MoeConfig

    from enginehooks_testkit.tiny import save_tiny

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=args.hidden // 2,
        num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype=args.dtype)
    return save_tiny(folder, config, seed=0, dtype=args.dtype)


def measure(req: dict[str, Any]) -> dict[str, Any]:
    """In the child: one engine, warm-up pushes, then the measured ones."""
    import torch

    from enginehooks import WeightSync
    from enginehooks_testkit.engines import start_engine
    from enginehooks_testkit.tiny import load_tiny, perturb

    os.environ["ENGINEHOOKS_COPY_PLAN"] = req["plan"]
    trainer = load_tiny(req["model"])
    with start_engine(req["engine"], req["model"], dtype=req["dtype"]) as engine:
        handle = engine.handle()
        applies, cpus, pushes = [], [], []
        with WeightSync("gloo", bucket_bytes=req["bucket_bytes"], timeout_s=600) as sync:
            sync.add_replica(handle)
            nbytes = tensors = 0
            for i in range(2 + req["reps"]):
                model = perturb(trainer, seed=100 + i, scale=0.01)
                t0 = time.perf_counter()
                report = sync.push(model, version=f"v{i}")
                took = time.perf_counter() - t0
                info = handle.info(120)[0]["copy_plan"]
                if i >= 2:
                    applies.append(info["seconds"])
                    cpus.append(info.get("cpu_seconds"))
                    pushes.append(took)
                nbytes, tensors = report.bytes, report.tensors
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.fill_(1)
        memcpy = []
        for _ in range(max(3, req["reps"])):
            t0 = time.perf_counter()
            dst.copy_(src)
            memcpy.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "tensors": tensors, "apply_s": applies, "apply_cpu_s": cpus,
            "push_s": pushes,
            "memcpy_s": memcpy, "copy_plan": info}


def child(engine: str, python: str, model: Path, experts: int, plan: str,
          args: argparse.Namespace) -> dict[str, Any]:
    req = {"engine": engine, "model": str(model), "experts": experts, "plan": plan,
           "dtype": args.dtype, "reps": args.reps, "bucket_bytes": args.bucket_mb << 20}
    out = subprocess.run([python, str(Path(__file__).resolve()), "--child"], input=json.dumps(req),
                         capture_output=True, text=True, timeout=args.timeout_s,
                         cwd=Path(__file__).resolve().parents[1])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="vllm", choices=("vllm", "sglang"))
    ap.add_argument("--python", default=sys.executable,
                    help="the Python of the engine's environment (SGLang's venv for sglang)")
    ap.add_argument("--experts", default="8,32,128")
    ap.add_argument("--copy-plan", default="off,on")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--moe-intermediate", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    ap.add_argument("--workdir", default=None, help="where checkpoints are built (a temp dir)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(sys.stdin.read()))), flush=True)
        os._exit(0)  # engines may leave non-daemon threads behind

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-moe-"))
    result: dict[str, Any] = {
        "benchmark": "bench_moe_apply", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "params": {k: getattr(args, k) for k in ("engine", "experts", "copy_plan", "hidden",
                                                 "moe_intermediate", "layers", "dtype", "reps",
                                                 "bucket_mb")},
        "rows": [],
    }
    print(f"{'experts':>7} {'plan':>4} {'tensors':>7} {'MB':>7} {'apply s':>8} "
          f"{'ns/B':>7} {'cpu s':>7} {'cpu ns/B':>8} {'push s':>7} {'memcpy s':>9} "
          f"{'apply/memcpy':>12}  plan state", flush=True)
    for experts in [int(x) for x in args.experts.split(",")]:
        model = build(work / f"qwen3moe-{experts}", experts, args)
        for plan in args.copy_plan.split(","):
            sub = child(args.engine, args.python, model, experts, plan, args)
            row: dict[str, Any] = {"experts": experts, "plan": plan, **sub}
            result["rows"].append(row)
            if "error" in sub:
                print(f"{experts:>7} {plan:>4}  error: {sub['error'][-600:]}", flush=True)
                continue
            apply_s = statistics.median(sub["apply_s"])
            cpu_s = statistics.median(sub["apply_cpu_s"]) if all(
                c is not None for c in sub["apply_cpu_s"]) else float("nan")
            memcpy_s = min(sub["memcpy_s"])
            row.update(apply_median_s=apply_s, ns_per_byte=apply_s / sub["bytes"] * 1e9,
                       apply_cpu_median_s=cpu_s, cpu_ns_per_byte=cpu_s / sub["bytes"] * 1e9,
                       push_median_s=statistics.median(sub["push_s"]), memcpy_min_s=memcpy_s,
                       apply_over_memcpy=apply_s / memcpy_s)
            state = sub["copy_plan"]
            print(f"{experts:>7} {plan:>4} {sub['tensors']:>7} {sub['bytes'] / 1e6:>7.2f} "
                  f"{apply_s:>8.4f} {row['ns_per_byte']:>7.2f} {cpu_s:>7.4f} "
                  f"{row['cpu_ns_per_byte']:>8.2f} {row['push_median_s']:>7.3f} "
                  f"{memcpy_s:>9.5f} {row['apply_over_memcpy']:>12.0f}  {state.get('state')} "
                  f"planned {state.get('planned_last')} loader {state.get('loader_last')}",
                  flush=True)
    flat: dict[str, Any] = {}
    for plan in args.copy_plan.split(","):
        ok = [r for r in result["rows"] if r["plan"] == plan and "ns_per_byte" in r]
        if len(ok) >= 2:
            lo, hi = min(ok, key=lambda r: r["experts"]), max(ok, key=lambda r: r["experts"])
            flat[plan] = {"from": lo["experts"], "to": hi["experts"],
                          "ns_per_byte_ratio": hi["ns_per_byte"] / lo["ns_per_byte"],
                          "cpu_ns_per_byte_ratio": hi["cpu_ns_per_byte"] / lo["cpu_ns_per_byte"],
                          "target_max": 1.5}
            print(f"plan {plan}: apply ns/byte at {hi['experts']} experts / at {lo['experts']} = "
                  f"{flat[plan]['ns_per_byte_ratio']:.2f} wall, "
                  f"{flat[plan]['cpu_ns_per_byte_ratio']:.2f} CPU (target <= 1.5)", flush=True)
    result["flatness"] = flat
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Extrapolate `bench_scale.py`'s measured constants to the published large setups
(issue 23): Qwen3-235B, DeepSeek-V3 (671B) and a 1T model (Kimi-K2), pushed from 256
training GPUs into 128 inference GPUs, every GPU with its own 400 Gb/s NIC.

A paper model, not a measurement: what the measured efficiencies mean at line rate.
Constants from the benchmark JSON (same run): `eta_1` (one sender's throughput over its
link-rate floor), `eta_k` (k senders' throughput over theirs, the median of the
multi-sender rows into one replica, where a link is the bound) and `c0` (seconds a
push spends outside the transfer: plan, check, join, flush, measured on CPU, where RPCs
are slower than on a GPU cluster's hosts).

Three ways (L = the NIC's line rate, B = the update's bytes, g = GPUs per replica,
R = 128 / g replicas, every engine GPU receiving through its own NIC):
- one sender (before issue 23): a pipelined broadcast from one trainer GPU, which feeds
  every engine GPU at most at its own line rate: c0 + B / (eta_1 L);
- every trainer rank sends its part, every engine GPU receives the whole model (this
  issue's multi-sender): each engine GPU still takes all B bytes: c0 + B / (eta_k L);
- the static schedule (part 3): each engine GPU receives only its slice B / g, each
  trainer GPU sends its 1/256 share to each of the R replicas:
  c0 + max(B / g, R B / 256) / (eta_s L), where eta_s is shard-direct's own measured
  efficiency (`--shard-direct`: `bench_shard_direct.py`'s rows with several trainer
  hosts, median ratio to their link-rate floor; issue 40) or, without it, eta_k.

    python benchmarks/extrapolate_scale.py benchmarks/results/scale-cpu.json \
        [--shard-direct benchmarks/results/shard-direct-cpu.json] \
        --out benchmarks/results/scale-extrapolation
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

#: (name, parameters, bytes per parameter as published, GPUs per replica in the table)
MODELS = [
    ("Qwen3-235B-A22B (bf16)", 235e9, 2, 8),
    ("DeepSeek-V3 671B (bf16)", 671e9, 2, 16),
    ("DeepSeek-V3 671B (fp8)", 671e9, 1, 16),
    ("Kimi-K2 1T (bf16)", 1.04e12, 2, 16),
    ("Kimi-K2 1T (fp8)", 1.04e12, 1, 16),
]
#: what peers published for these setups (docs/scale.md cites them)
PEERS = {
    "Qwen3-235B-A22B (bf16)": "checkpoint-engine 6.22 s (8x H800, one node, NVLink broadcast)",
    "DeepSeek-V3 671B (bf16)": "NeMo-RL NCCL path 7.65-9.94 s (PP16xEP16 -> TP32xDP8)",
    "DeepSeek-V3 671B (fp8)": "checkpoint-engine DeepSeek-V3.1 fp8 10.19 s (16x H20)",
    "Kimi-K2 1T (bf16)": "-",
    "Kimi-K2 1T (fp8)": "Kimi-K2 static schedule ~1.3 s (256 -> 128 GPUs, RDMA); "
                        "checkpoint-engine 14.36 s (16x H20), 16.04 s (256x H20)",
}


def constants(bench: dict[str, Any]) -> dict[str, float]:
    rows = bench["rows"]
    single = [r for r in rows if r["mode"] == "single" and r["replicas"] == 1]
    # Rows into one replica: there each link's rate is the bound. Into two, gloo's
    # broadcast sends each part once per replica (the one-to-all floor), an algorithm
    # of the CPU transport; the GPU paths (NCCL's pipelined broadcast, the static
    # schedule's point-to-point sends) cross each link once.
    multi = [r for r in rows if r["mode"] != "single" and r["trainer_nodes"] > 1
             and r["replicas"] == 1]
    overhead = [p - t for r in rows for p, t in [(r["median_push_s"], r["median_transfer_s"])]]
    return {"eta_1": single[0]["ratio_to_floor"],
            "eta_k": statistics.median(r["ratio_to_floor"] for r in multi),
            "c0_s": statistics.median(overhead)}


def table(c: dict[str, float], line_gbit: float, trainers: int, engines: int
          ) -> list[dict[str, Any]]:
    line = line_gbit / 8 * 1e9  # bytes per second
    out = []
    for name, params, width, g in MODELS:
        b = params * width
        replicas = engines // g
        one = c["c0_s"] + b / (c["eta_1"] * line)
        multi = c["c0_s"] + b / (c["eta_k"] * line)
        eta_s = c.get("eta_shard_direct", c["eta_k"])
        sched = c["c0_s"] + max(b / g, replicas * b / trainers) / (eta_s * line)
        out.append({"model": name, "bytes": b, "gpus_per_replica": g, "replicas": replicas,
                    "one_sender_s": one, "multi_sender_whole_model_s": multi,
                    "static_schedule_s": sched, "floor_static_s": b / g / line,
                    "peers": PEERS.get(name, "-")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("bench", help="bench_scale.py JSON")
    ap.add_argument("--out", default="benchmarks/results/scale-extrapolation")
    ap.add_argument("--shard-direct", help="bench_shard_direct.py JSON (eta of the schedule)")
    ap.add_argument("--line-gbit", type=float, default=400.0)
    ap.add_argument("--trainer-gpus", type=int, default=256)
    ap.add_argument("--engine-gpus", type=int, default=128)
    args = ap.parse_args()
    bench = json.loads(Path(args.bench).read_text())
    c = constants(bench)
    if args.shard_direct:
        sd = json.loads(Path(args.shard_direct).read_text())["rows"]
        c["eta_shard_direct"] = statistics.median(
            r["ratio_to_floor"] for r in sd if r["trainer_nodes"] > 1)
    rows = table(c, args.line_gbit, args.trainer_gpus, args.engine_gpus)
    lines = [f"constants from {args.bench}: eta_1 {c['eta_1']:.2f}, eta_k {c['eta_k']:.2f}, "
             f"c0 {c['c0_s']:.2f} s"
             + (f", shard-direct eta_s {c['eta_shard_direct']:.2f} from {args.shard_direct}"
                if "eta_shard_direct" in c else "")
             + f"; {args.trainer_gpus} -> {args.engine_gpus} GPUs, "
             f"{args.line_gbit:g} Gb/s each",
             "",
             "| model | GB | GPUs/replica | one sender s | every rank sends, whole model s "
             "| static schedule s (floor) | published |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['bytes'] / 1e9:.0f} | {r['gpus_per_replica']} | "
                     f"{r['one_sender_s']:.1f} | {r['multi_sender_whole_model_s']:.1f} | "
                     f"{r['static_schedule_s']:.2f} ({r['floor_static_s']:.2f}) | {r['peers']} |")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {"constants": c, "params": vars(args), "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

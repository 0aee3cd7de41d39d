"""The engine side's host work per tensor, for an update of thousands of tensors (issue 37).

An MoE checkpoint is thousands of tensors per push (Qwen3-30B-A3B: ~18,500), so what
the engine side spends per tensor (the receiver's unpack, the apply's bookkeeping, the
copy plan's replay, verification's digests) is paid thousands of times, whatever the
bytes. This measures it where no GPU is needed: a module replica (the real
`ApplyTarget`, `ApplyBinding` and `EngineSide` around a plain torch model,
`enginehooks_testkit.inprocess_replica`) of `--blocks` of `bench_verify.Blocks`' blocks
at width 16 (a norm's weight and bias, two 16x16 projections: 4 tensors a block, fp32,
the bytes negligible), pushed over
gloo in process, unverified and verified in turn (`bench_verify.push_rows`: steady
pushes of the prepared layout only). Per kind: the push's median, the apply's phases
(`apply_phases_ms`: before the load, the load with the transport's stream, the landed
names, the post-load step, verification) and each per tensor (us).

    python benchmarks/bench_apply_many.py --blocks 500 --out benchmarks/results/apply-many.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ["ENGINEHOOKS_VERIFY"] = "never"  # the trainer asks for the verified pushes
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch


def main(argv: list[str] | None = None) -> int:
    import bench_verify
    from bench_gloo_cpu import machine

    from enginehooks_testkit.inprocess_replica import inprocess_replica

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=500, help="4 tensors a block")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    def build(device: torch.device) -> torch.nn.Module:
        with torch.device(device):
            return bench_verify.Blocks(args.blocks, 16, 16, torch.float32)

    handle, _model = inprocess_replica(build, torch.device("cpu"), streamed_shadow=True)
    source = build(torch.device("cpu"))
    tensors = len(source.state_dict())

    def trainer(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {n: torch.randn(p.shape, generator=g) for n, p in source.state_dict().items()}

    rows = bench_verify.push_rows(handle, trainer, args.rounds, "gloo")
    kinds: dict[str, Any] = {}
    print(f"\n{tensors} tensors, {args.rounds} rounds\n")
    print("| kind | push ms | us/tensor | before | load | landed | verify (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in ("never", "always"):
        steady = [r for r in rows if r["phase"] == kind]
        push = statistics.median(r["seconds"] for r in steady) * 1e3
        phases = {k: statistics.median(r["apply_phases_ms"][k] for r in steady)
                  for k in steady[0]["apply_phases_ms"]}
        kinds[kind] = {"pushes": len(steady), "push_ms_median": push,
                       "push_us_per_tensor": push * 1e3 / tensors,
                       "apply_phases_ms_median": phases,
                       "apply_phases_us_per_tensor": {k: v * 1e3 / tensors
                                                      for k, v in phases.items()},
                       "verification_last": steady[-1]["verification"]}
        print(f"| {kind} | {push:.1f} | {push * 1e3 / tensors:.1f} | {phases['before']:.1f} | "
              f"{phases['load']:.1f} | {phases['landed']:.1f} | {phases['verify']:.1f} |")
    result = {"benchmark": "bench_apply_many", "tensors": tensors, "blocks": args.blocks,
              "rounds": args.rounds, "transport": "gloo", "machine": machine(),
              "kinds": kinds, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

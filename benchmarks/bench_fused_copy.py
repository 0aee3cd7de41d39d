"""The fused copy+digest kernel against a plain device copy of the same bytes, one run.

Rows (medians of --reps, CUDA events, after a warm-up):
  raw copy_            one torch copy_ of an N-byte buffer
  fused, 1 run         core/fused_copy.py copy + sum64 in the same pass, one run
  fused, MoE runs      the same bytes cut as Qwen3-30B-A3B tensors (3 MiB experts)
  digest only          the kernel reading without storing (the sender's digest)
  copy_ then sum64     copy_ followed by checksums.sum64_tensor (the separate pass)
Writes JSON with the machine and the ratios to raw copy_.

    python benchmarks/bench_fused_copy.py --gib 4 --out benchmarks/results/fused-copy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from enginehooks.core import fused_copy  # noqa: E402
from enginehooks.core.checksums import sum64_tensor  # noqa: E402


def timed(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true", help="time kernel variants too")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    assert fused_copy.available(dev), fused_copy._state_reason
    n = int(args.gib * (1 << 30)) // 4 * 4
    src = torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, device=dev)
    src = src.view(torch.uint8)
    dst = torch.empty_like(src)
    one = np.array
    single = fused_copy.build(one([src.data_ptr()]), one([dst.data_ptr()]), one([n]), one([0]),
                              one([0]), dev)
    expert = 768 * 2048 * 2
    k = n // expert
    offs = np.arange(k, dtype=np.int64) * expert
    bucket = (offs // (1 << 30)).astype(np.int64)
    runs = fused_copy.build(src.data_ptr() + offs, dst.data_ptr() + offs,
                            np.full(k, expert, dtype=np.int64), (offs % (1 << 30)) // 4, bucket,
                            dev)
    digs = torch.zeros(int(bucket.max()) + 1, dtype=torch.int64, device=dev)
    rows = {
        "raw_copy_ms": timed(lambda: dst.copy_(src), args.reps),
        "fused_one_run_ms": timed(lambda: fused_copy.launch(single, digs, True), args.reps),
        "fused_moe_runs_ms": timed(lambda: fused_copy.launch(runs, digs, True), args.reps),
        "digest_only_ms": timed(lambda: fused_copy.launch(single, digs, False), args.reps),
        "copy_then_sum64_ms": timed(lambda: (dst.copy_(src), sum64_tensor(dst)), args.reps),
    }
    defaults = (fused_copy._HINTS, fused_copy._BLOCK, fused_copy._WARPS)
    chunk0 = fused_copy.CHUNK_BYTES
    if args.sweep:
        sweep = {}
        for chunk in (1 << 18, 1 << 20, 1 << 22):
            fused_copy.CHUNK_BYTES = chunk
            single = fused_copy.build(one([src.data_ptr()]), one([dst.data_ptr()]), one([n]),
                                      one([0]), one([0]), dev)
            for block, warps in ((2048, 4), (4096, 8), (8192, 8), (8192, 16)):
                fused_copy._BLOCK, fused_copy._WARPS = block, warps
                key = f"chunk={chunk},block={block},warps={warps}"
                try:
                    c = timed(lambda s=single: fused_copy.launch(s, digs, True), args.reps)
                    r = timed(lambda s=single: fused_copy.launch(s, digs, False), args.reps)
                    d2 = torch.zeros(1, dtype=torch.int64, device=dev)
                    fused_copy.launch(single, d2, True)
                    ok = int(d2[0]) == int(sum64_tensor(src))
                    sweep[key] = {"copy_x_raw": round(rows["raw_copy_ms"] / c, 3),
                                  "digest_only_x_raw": round(rows["raw_copy_ms"] / r, 3), "ok": ok}
                except Exception as e:  # a variant that does not compile
                    sweep[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(key, sweep[key], flush=True)
        rows_sweep = sweep
        fused_copy._HINTS, fused_copy._BLOCK, fused_copy._WARPS = defaults
        fused_copy.CHUNK_BYTES = chunk0
    else:
        rows_sweep = {}
    d1 = torch.zeros(1, dtype=torch.int64, device=dev)
    fused_copy.launch(single, d1, True)
    same = int(d1[0]) == int(sum64_tensor(src)) and torch.equal(src, dst)
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "bytes": n, "moe_runs": k, "fused_equals_sum64": same, **rows,
           "sweep": rows_sweep}
    for key in list(rows):
        if key != "raw_copy_ms":
            out[key.replace("_ms", "_x_raw")] = round(rows["raw_copy_ms"] / rows[key], 3)
    out["raw_copy_gbps"] = round(2 * n / rows["raw_copy_ms"] / 1e6, 1)
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

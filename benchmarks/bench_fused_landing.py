"""Where the fused landing pays: one launch that copies a bucket's pieces into their
destinations and digests the bucket (`Unpacker.land`), against a copy per piece (what a
target's `apply` does with views) plus the `sum64` pass over the bucket, for buckets of
several sizes cut into pieces of several sizes. Medians of CUDA-event-timed repetitions.
Prints one JSON object; `core/buckets.py:fused_landing_pays` encodes the outcome.

    python benchmarks/bench_fused_landing.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from enginehooks.core import fused_copy
from enginehooks.core.checksums import sum64_tensor


def timed(fn: Callable[[], object], reps: int = 15) -> float:
    """Median of CUDA-event times, after a warm-up (bench_fused_copy's timer)."""
    from bench_fused_copy import timed as median_ms  # a sibling script: benchmarks/ is on the path

    return median_ms(fn, reps)


def measure(buf: torch.Tensor, piece: int, stager: fused_copy.Stager) -> tuple[float, float]:
    """(separate, fused) ms for `buf` cut into pieces of `piece` bytes."""
    dev = buf.device
    k = buf.numel() // piece
    dsts = [torch.empty(piece, dtype=torch.uint8, device=dev) for _ in range(k)]
    srcs = [buf[i * piece:(i + 1) * piece] for i in range(k)]
    sums = torch.zeros(1, dtype=torch.int64, device=dev)

    def separate() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)
        sum64_tensor(buf)

    src_a = np.array([s.data_ptr() for s in srcs], dtype=np.int64)
    dst_a = np.array([d.data_ptr() for d in dsts], dtype=np.int64)
    nb = np.full(k, piece, dtype=np.int64)
    wb = np.arange(k, dtype=np.int64) * (piece // 4)

    def fused() -> None:  # as `land` does: a table per bucket, one launch
        fused_copy.launch(fused_copy.build(src_a, dst_a, nb, wb, np.zeros(k, np.int64),
                                           dev, stager), sums, copy=True)

    return timed(separate), timed(fused)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    assert fused_copy.available(dev)
    stager = fused_copy.stager_for(dev)
    rows = []
    for bucket_mib in (256, 1024):
        nbytes = bucket_mib << 20
        buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        for piece in (64 << 10, 1 << 20, 8 << 20, 64 << 20, 256 << 20):
            if piece > nbytes:
                continue
            sep, fus = measure(buf, piece, stager)
            rows.append({"bucket_mib": bucket_mib, "piece_bytes": piece,
                         "pieces": nbytes // piece, "separate_ms": round(sep, 3),
                         "fused_ms": round(fus, 3), "fused_over_separate": round(fus / sep, 3)})
            print(rows[-1], flush=True)
        del buf
        torch.cuda.empty_cache()
    res = {"gpu": torch.cuda.get_device_name(dev), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()

"""docs/img/moe-verify.png: two results of 2026-11-28 (thirteenth session) side by side.

Left: the colocated FSDP2 -> replica push with Qwen3-30B-A3B's MoE shapes (5 layers,
1968 tensors, 7.5 GB; `bench_e2e.py --arch qwen3_moe`), whole push / raw device copy of
the same run, before and after the trainer hands out traced views of the fused experts
(`core/view_trace.py`). Right: verification always vs never on a 1 GB module replica
(`bench_verify.py`), the added time as a share of the unverified push, per run.

Usage: python benchmarks/plot_moe_verify.py OUT.png (needs matplotlib; reads the
committed JSON under benchmarks/results/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _ratio(path: Path, key: str) -> float:
    return float(json.loads(path.read_text())["summary"][key])


def _added(path: Path, key: str) -> float:
    summary = json.loads(path.read_text())[key]["summary"]
    return 100.0 * float(summary["added_fraction_median"])


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(sys.argv[1])
    moe = RESULTS / "e2e-moe-2026-11-28-s13-h200x1"
    final = RESULTS / "final-2026-11-28-s13-h200x2"
    whole = "push[checksum=sum64] whole push / raw_device_copy"
    bars = [("before\n(1x H200)", _ratio(moe / "e2e-moe-before-view-trace.json", whole)),
            ("views\n(1x H200)", _ratio(moe / "e2e-moe-after-view-trace.json", whole)),
            ("views\n(2x H200)", _ratio(final / "e2e-moe.json", whole)),
            ("final code\n(1x H200)", _ratio(moe / "e2e-moe-final.json", whole))]
    ver = RESULTS / "verify"
    added = [
        ("cuda_ipc, s12\n(1x H200)", _added(ver / "gpu-2026-11-28-s12-h200x1-prepared"
                                              / "bv-cuda_ipc-final.json", "module-cuda:0-cuda_ipc")),
        ("cuda_ipc, settled\n(1x H200)", _added(ver / "gpu-2026-11-28-s13-h200x1"
                                                  / "bv-cuda_ipc.json", "module-cuda:0-cuda_ipc")),
        ("cuda_ipc, final\n(2x H200)", _added(final / "bench_verify-gpu.json",
                                               "module-cuda:0-cuda_ipc")),
        ("cuda_ipc, final\n(1x H200)", _added(ver / "gpu-2026-11-28-s13-h200x1"
                                               / "bv-cuda_ipc-final.json", "module-cuda:0-cuda_ipc")),
        ("nccl, s12\n(2x H200)", _added(ver / "gpu-2026-11-28-s12-h200x2-prepared"
                                         / "bv-nccl.json", "module-cuda:0-nccl")),
        ("nccl, final\n(2x H200)", _added(final / "bench_verify-gpu.json", "module-cuda:0-nccl")),
    ]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.4))
    a.bar([x for x, _ in bars], [y for _, y in bars], color=["#999", "#4a7", "#4a7", "#2a5"])
    a.axhline(0.6, color="#c33", ls="--", lw=1, label="target 0.6")
    a.set_ylabel("whole push / raw device copy (same run)")
    a.set_title("MoE, colocated FSDP2 -> replica, sum64")
    a.legend()
    for i, (_, y) in enumerate(bars):
        a.text(i, y + 0.01, f"{y:.3f}", ha="center")
    b.bar([x for x, _ in added], [y for _, y in added],
          color=["#999", "#4a7", "#4a7", "#4a7", "#999", "#4a7"])
    b.axhline(10, color="#c33", ls="--", lw=1, label="target +10 %")
    b.set_ylabel("verified push: added time, % of unverified")
    b.set_title("verify every update, 1 GB module replica, prepared layout")
    b.legend()
    for i, (_, y) in enumerate(added):
        b.text(i, y + 0.5, f"+{y:.0f} %", ha="center")
    b.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()

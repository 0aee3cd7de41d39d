"""docs/img/gpu-path.png: issue 37's whole-push and transport ratios to the raw primitive
(same run), before (the issue's measurements, 4x H200) and with the final code (the
device run in RESULTS_DIR, `benchmarks/device_final.sh`), against the issue's targets.
The MoE and 2 -> 2 rows appear where that run has them (e2e-moe.json, multisender.json).
Usage: python benchmarks/plot_gpu_path.py RESULTS_DIR OUT.png (needs matplotlib)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, out = Path(sys.argv[1]), Path(sys.argv[2])
    e2e = json.loads((results / "e2e.json").read_text())["summary"]
    tr = json.loads((results / "transports-7b.json").read_text())
    ratios = tr.get("summary") or tr.get("ratios") or {}

    def pick(d: dict, key: str) -> float:
        return float(next(v for k, v in d.items() if k == key))

    rows = [
        ("colocated FSDP2 -> replica\nwhole push / device copy, sum64", 0.051,
         pick(e2e, "push[checksum=sum64] whole push / raw_device_copy"), 0.7),
        ("nccl transport, default bucket,\nsum64 / broadcast", 0.80,
         pick(ratios, "nccl[1024MiB,r1,checksum=sum64] / raw_broadcast"), 0.95),
        ("cuda_ipc transport, 1 GiB,\nsum64 / device copy", 0.40,
         pick(ratios, "cuda_ipc[1024MiB,r1,checksum=sum64] / raw_device_copy"), None),
    ]
    moe = results / "e2e-moe.json"
    if moe.exists():
        rows.insert(1, ("colocated FSDP2 -> replica, MoE shapes\nwhole push / device copy, sum64",
                        None, pick(json.loads(moe.read_text())["summary"],
                                   "push[checksum=sum64] whole push / raw_device_copy"), 0.6))
    ms = results / "multisender.json"
    if ms.exists():
        r = json.loads(ms.read_text()).get("ratios") or {}
        if "multi / raw_multi (time)" in r:
            rows.insert(2, ("2 FSDP2 ranks -> 2 replicas, nccl\nseveral senders / broadcast", 0.05,
                            1.0 / float(r["multi / raw_multi (time)"]), 0.8))
            rows.insert(3, ("2 FSDP2 ranks -> 2 replicas, nccl\none sender / broadcast", None,
                            1.0 / float(r["single / raw_single (time)"]), None))
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.8 * len(rows)))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r[1] or 0.0 for r in rows], height=0.4,
            label="before (issue 37; 0: not measured)")
    ax.barh([y - 0.2 for y in ys], [r[2] for r in rows], height=0.4, label="final code")
    for y, r in zip(ys, rows):
        if r[3] is not None:
            ax.plot([r[3], r[3]], [y - 0.45, y + 0.45], color="black", linestyle="--")
    ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
    ax.set_xlabel("ratio to the raw primitive, same run (dashed: target)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()

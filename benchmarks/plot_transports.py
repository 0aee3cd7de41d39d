"""Plot a `bench_transports.py` result: GB/s of every path, raw primitives beside ours.

    python benchmarks/plot_transports.py benchmarks/results/transports-h200x2.json \
        docs/img/transports-h200x2.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [(k, v) for k, v in res["items"].items() if "gbps" in v]
    labels = [k for k, _ in items]
    gbps = [v["gbps"] for _, v in items]
    colors = ["#888888" if k.startswith(("raw_", "per_tensor")) else "#1f77b4" for k in labels]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(items) + 1.6))
    ax.barh(range(len(items)), gbps, color=colors)
    ax.set_yticks(range(len(items)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, g in enumerate(gbps):
        ax.text(g, i, f" {g:.0f}", va="center", fontsize=8)
    m = res.get("machine", {})
    model = res.get("model", {})
    ax.set_xlabel("GB/s of weights delivered (median of warm repetitions)")
    ax.set_title(
        f"{model.get('name', '')} {model.get('bytes', 0) / 1e9:.1f} GB bf16 - "
        f"{m.get('gpu_count', 0)}x {', '.join(sorted(set(m.get('gpus', [])))) or 'CPU'}, "
        f"torch {m.get('torch', '')}, NCCL {m.get('nccl', '-')}, {m.get('date', '')[:10]}\n"
        "grey: raw primitives measured in the same run; blue: enginehooks end to end",
        fontsize=9,
    )
    ax.set_xscale("log")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_transports.py RESULT.json OUT.png")
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))

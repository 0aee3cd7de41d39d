"""Plot a `bench_gloo_cpu.py` result: seconds per update of each path beside raw gloo.

    python benchmarks/plot_gloo_cpu.py benchmarks/results/gloo-cpu.json docs/img/gloo-cpu.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(sys.argv[1]).read_text())
    rows = res["rows"]
    labels = {"raw": "raw gloo broadcast", "local": "enginehooks -> torch module",
              "vllm": "enginehooks -> real vLLM"}
    names = [labels.get(k, k) for k in rows]
    secs = [r["median_s"] * 1e3 for r in rows.values()]
    fig, ax = plt.subplots(figsize=(8, 2.6))
    ax.barh(names, secs, color=["#888888"] + ["#1f77b4"] * (len(secs) - 1))
    ax.invert_yaxis()
    for i, (s, r) in enumerate(zip(secs, rows.values())):
        ax.text(s, i, f" {s:.0f} ms ({r['speed_vs_raw']:.2f}x raw speed)", va="center", fontsize=8)
    p = res["params"]
    ax.set_xlabel("ms per update (median)")
    ax.set_title(f"gloo on CPU: {p['bytes'] / 1e6:.0f} MB in {p['buckets']} buckets, "
                 f"checksum {p['checksum']} ({res['machine']['cpus']} cores)", fontsize=9)
    ax.set_xlim(0, max(secs) * 1.6)
    fig.tight_layout()
    Path(sys.argv[2]).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plot `bench_gloo_cpu.py` results: each path's speed as a fraction of raw gloo of the
same bytes, measured in the same process (one panel per result file).

    python benchmarks/plot_gloo_cpu.py docs/img/gloo-cpu.png \\
        benchmarks/results/gloo-cpu-tiny.json benchmarks/results/gloo-cpu-qwen05b.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {"local": "torch module (direct buckets)", "local-packed": "torch module (all packed)"}


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, files = sys.argv[1], sys.argv[2:]
    results = [json.loads(Path(f).read_text()) for f in files]
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.0 + 0.45 * max(
        len([k for k in r["rows"] if not k.startswith("raw")]) for r in results) * len(results)),
        squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        rows = {k: r for k, r in res["rows"].items() if not k.startswith("raw")}
        names = [LABELS.get(k, k) for k in rows]
        speed = [r["speed_vs_raw"] for r in rows.values()]
        ax.barh(names, speed, color="#1f77b4")
        ax.axvline(1.0, color="#888888", lw=1)
        ax.invert_yaxis()
        for i, (s, r) in enumerate(zip(speed, rows.values())):
            ax.text(s, i, f" {s:.2f} x ({r['median_s'] * 1e3:.0f} ms; raw "
                          f"{r['raw_median_s'] * 1e3:.0f} ms)", va="center", fontsize=8)
        p = res["params"]
        ax.set_xlim(0, 1.6)
        ax.set_title(f"{p['preset']}: {p['bytes'] / 1e6:.0f} MB {p['dtype']}, "
                     f"{p['bucket_bytes'] >> 20} MiB buckets, {p['checksum']}, "
                     f"{res['machine']['cpus']} cores (speed vs raw gloo, same process)",
                     fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

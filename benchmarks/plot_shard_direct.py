"""Plot `bench_shard_direct.py` results: per row (k trainer hosts -> m engine ranks),
the median push time against the link-rate floor of the same run, one group of bars per
results file, the ratio written above each pair; the 0.8 x floor target as a line.

    python benchmarks/plot_shard_direct.py benchmarks/results/shard-direct-cpu.json \
        benchmarks/results/shard-direct-cpu-quiet.json \
        benchmarks/results/shard-direct-cpu-quiet-50mbit.json docs/img/shard-direct-cpu.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def label(res: dict) -> str:
    p = res.get("params", {})
    load = res.get("machine", {}).get("load_avg_at_start")
    where = f"\nload {load[0]:.1f}" if isinstance(load, list) and load else ""
    return f"{p.get('trainer_mbit')}/{p.get('engine_mbit')} Mbit/s{where}"


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    *inputs, out = sys.argv[1:]
    results = [(p, json.loads(Path(p).read_text())) for p in inputs]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    x, ticks, names = 0.0, [], []
    for _path, res in results:
        for row in res["rows"]:
            push, floor = row["median_push_s"], row["floor_s"]
            ax.bar(x - 0.2, floor, width=0.4, color="#bbbbbb",
                   label="link-rate floor" if x == 0 else None)
            ax.bar(x + 0.2, push, width=0.4, color="#1f77b4",
                   label="push (median)" if x == 0 else None)
            ax.text(x + 0.2, push, f"{floor / push:.2f} x", ha="center", va="bottom", fontsize=8)
            ticks.append(x)
            names.append(f"{row['trainer_nodes']} -> {row['engine_ranks']}\n"
                         + label(res))
            x += 1.0
        x += 0.5
    ax.set_xticks(ticks)
    ax.set_xticklabels(names, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("shard-direct, simulated nodes: push vs link-rate floor (target >= 0.8 x; "
                 "load: load average at start)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

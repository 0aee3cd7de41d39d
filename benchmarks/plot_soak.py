"""Plot `soak.py` results: resident memory of engine and trainer after every push, with
the faults marked, one panel per engine; the title counts the pushes whose verification
passed (verified, or repaired), and a push that was not verified is marked in black.

    python benchmarks/plot_soak.py benchmarks/results/soak-vllm.json \
        benchmarks/results/soak-sglang.json docs/img/soak.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    *inputs, out = sys.argv[1:]
    results = [json.loads(Path(p).read_text()) for p in inputs]
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3 * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        s = res["series"]
        x = range(1, len(s["kind"]) + 1)
        ax.plot(x, s["engine_rss_mb"], label="engine processes", color="#1f77b4")
        ax.plot(x, s["trainer_rss_mb"], label="trainer", color="#ff7f0e")
        for i, kind in enumerate(s["kind"], start=1):
            if kind != "push":
                ax.axvline(i, color="#d62728", alpha=0.3, lw=1)
        for i, verdict in enumerate(s.get("verdict") or [], start=1):
            if verdict not in (None, "verified", "repaired"):
                ax.axvline(i, color="black", alpha=0.6, lw=1)
        r, m = res["requests"], res["memory"]
        v = res.get("verification")
        verified = (f"{v['passed']}/{v['of']} verified ({v['repaired']} by repair), "
                    if v else "")
        ax.set_title(
            f"{res['machine']['engine_version']}: {res['pushes']['ok']}/"
            f"{res['pushes']['attempted']} pushes ok, {verified}"
            f"{sum(f['injected'] for f in res['faults'].values())}"
            f" faults (red), {r['served']} answers served, {r['refused']} refused, "
            f"{r['wrong_version']} wrong-version; engine RSS x{m['engine']['ratio']}",
            fontsize=8)
        ax.set_xlabel("push")
        ax.set_ylabel("resident memory (MB)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

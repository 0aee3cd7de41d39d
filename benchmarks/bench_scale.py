"""Scale past one sender (issue 23): 1, 2 and 4 trainer nodes into 1 and 2 replica nodes,
one sender vs every trainer rank sending its part, each link rate-limited.

Nodes are network namespaces on this machine (`enginehooks_testkit.netns`: one switch,
every host's link shaped with `tc tbf` each way). Trainer ranks run
`tests/multihost/multi_trainer.py` (every rank holds the whole model, as FSDP ranks
that gather in lockstep; the coordinator shares it out), replicas run
`tests/multihost/replica.py` (a torch module behind the real `EngineSide` and gloo
receivers). Every row ends with a bit-exact check of each replica against the trained
model.

The link-rate floor of a row is the busiest link's bytes over its rate, counting each
byte once per link it must cross at least: each replica's link takes the whole update,
each sender's link its part (gloo may send a part once per replica: the one-to-all
floor, also reported). Rates are set low enough that the two CPU cores are not the
bottleneck.

    sudo python benchmarks/bench_scale.py --out benchmarks/results/scale-cpu
        [--trainer-mbit 100] [--engine-mbit 400] [--hidden 512] [--layers 8] [--reps 3]

Writes OUT.json (rows, parameters, the machine) and OUT.log (the table); root needed
(skips with the reason otherwise). `--plot OUT.json PNG` draws a result (matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from enginehooks_testkit.netns import Network, unavailable_reason  # noqa: E402
from enginehooks_testkit.tiny import load_tiny, make_tiny_model, perturb  # noqa: E402
from tests.multihost.conftest import Lines, ModuleReplica  # noqa: E402

LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"platform": platform.platform(), "processor": cpu, "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                        time.gmtime())}


class Ranks:
    """k trainer rank processes, one per trainer host."""

    def __init__(self, net: Network, k: int, mode: str, model: Path, replicas: list[ModuleReplica],
                 port: int, args: argparse.Namespace, logdir: Path) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.lines: list[Lines] = []
        self.logs = []
        master = f"{net.hosts['t0'].address}:{port}"
        for r in range(k):
            host = net.hosts[f"t{r}"]
            spec = {"model_dir": str(model), "host": host.address, "rank": r, "world": k,
                    "master": master, "timeout_s": args.timeout_s,
                    "bucket_bytes": args.bucket_mib << 20, "mode": mode,
                    "replicas": ([{"kind": "module", "url": x.url, "name": x.name}
                                  for x in replicas] if r == 0 else [])}
            log = open(logdir / f"{mode}-k{k}-r{len(replicas)}-rank{r}.log", "w")  # noqa: SIM115
            self.logs.append(log)
            p = host.popen([sys.executable, "-m", "tests.multihost.multi_trainer",
                            json.dumps(spec)], cwd=str(ROOT),
                           env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0"},
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            self.procs.append(p)
            self.lines.append(Lines(p.stdout, f"trainer rank {r}"))  # type: ignore[arg-type]
        for ln in self.lines:
            ln.json(300.0)

    def call(self, cmd: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return [ln.json(timeout_s) for ln in self.lines]

    def ask0(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        p = self.procs[0]
        assert p.stdin is not None
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
        return self.lines[0].json(timeout_s)

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.write(json.dumps({"op": "exit"}) + "\n")
                p.stdin.flush()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for log in self.logs:
            log.close()


def expected(model: Path, seed: int) -> dict[str, int]:
    m = perturb(load_tiny(model), seed=seed)
    return {n: zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            for n, t in m.state_dict().items()}


def run_row(net: Network, k: int, mode: str, model: Path, reps: list[ModuleReplica],
            args: argparse.Namespace, port: int, logdir: Path) -> dict[str, Any]:
    ranks = Ranks(net, k, mode, model, reps, port, args, logdir)
    try:
        pushes = []
        for i in range(args.reps + 1):  # the first forms the groups: not timed
            out = ranks.call({"op": "push", "seed": 100 + i, "version": f"{mode}-{k}-{i}"},
                             args.timeout_s * 8 + 120)
            if not all(o["ok"] for o in out):
                raise RuntimeError(f"push failed: {out}")
            if i:
                pushes.append(out)
        want = expected(model, 100 + args.reps)
        exact = True
        for r in reps:
            got = ranks.ask0({"op": "digests", "names": sorted(want), "replica": r.name}, 120)
            exact = exact and {n: d["crc32"] for n, d in got["digests"].items()} == want
    finally:
        ranks.close()
    total = pushes[0][0]["bytes"]
    part = [o.get("bytes", 0) for o in pushes[0]] if mode != "single" else [total]
    if mode != "single":
        part[0] = total - sum(part[1:])
    transfer = [p[0]["phases"]["transfer"] for p in pushes]
    push_s = [p[0]["seconds"] for p in pushes]
    t_rate, e_rate = args.trainer_mbit * 1e6 / 8, args.engine_mbit * 1e6 / 8
    nrep = len(reps)
    floor = max(total / e_rate, max(part) / t_rate)
    floor_one_to_all = max(total / e_rate, nrep * max(part) / t_rate)
    med = statistics.median(transfer)
    return {"mode": mode, "trainer_nodes": k if mode != "single" else 1, "replicas": nrep,
            "bytes": total, "sender_bytes": part, "transfer_s": transfer,
            "median_transfer_s": med, "median_push_s": statistics.median(push_s),
            "mb_per_s": total / med / 1e6, "floor_s": floor,
            "ratio_to_floor": floor / med, "floor_one_to_all_s": floor_one_to_all,
            "ratio_to_one_to_all_floor": floor_one_to_all / med, "exact": exact}


def plot(result: Path, png: Path) -> None:
    """MB/s per row beside the link-rate floor's, per replica count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(result.read_text())
    p = res["params"]
    nreps = sorted({r["replicas"] for r in res["rows"]})
    fig, axes = plt.subplots(1, len(nreps), figsize=(4.2 * len(nreps), 3.2), squeeze=False)
    for ax, n in zip(axes[0], nreps):
        rows = [r for r in res["rows"] if r["replicas"] == n]
        labels = [("one sender" if r["mode"] == "single" else f"{r['trainer_nodes']} senders")
                  for r in rows]
        got = [r["mb_per_s"] for r in rows]
        floor = [r["bytes"] / r["floor_s"] / 1e6 for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], floor, 0.4, color="#bbbbbb", label="link-rate floor")
        ax.bar([i + 0.2 for i in x], got, 0.4, color="#1f77b4", label="measured")
        for i, r in zip(x, rows):
            ax.text(i + 0.2, got[i], f"{r['ratio_to_floor']:.2f}x", ha="center",
                    va="bottom", fontsize=7)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("update MB/s")
        ax.set_title(f"into {n} replica node(s)", fontsize=9)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"trainer links {p['trainer_mbit']} Mbit/s, replica links "
                 f"{p['engine_mbit']} Mbit/s (tc), gloo, {res['rows'][0]['bytes'] / 1e6:.0f} MB",
                 fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--plot":
        plot(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/scale-cpu")
    ap.add_argument("--trainer-mbit", type=int, default=100)
    ap.add_argument("--engine-mbit", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--work", default="/tmp/enginehooks-bench-scale")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"SKIPPED: {reason}")
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}"
    if not (model / "config.json").exists():
        make_tiny_model(model, hidden_size=args.hidden, layers=args.layers,
                        vocab_size=args.vocab, seed=5)
    ks = [int(x) for x in args.ks.split(",")]
    nreps = [int(x) for x in args.replicas.split(",")]
    hosts = [f"t{i}" for i in range(max(ks))] + [f"e{i}" for i in range(max(nreps))]
    rows: list[dict[str, Any]] = []
    port = 29700
    with Network(hosts) as net:
        for name in hosts:
            net.hosts[name].shape((args.trainer_mbit if name.startswith("t")
                                   else args.engine_mbit) * 1000, burst_bytes=64 * 1024)
        started = []
        for i in range(max(nreps)):
            (work / f"e{i}").mkdir(exist_ok=True)
            started.append(ModuleReplica(net.hosts[f"e{i}"], model, work / f"e{i}", port=8200 + i))
        try:
            for n in nreps:
                reps = started[:n]
                for mode, k in [("single", 1)] + [("balanced", k) for k in ks]:
                    port += 1
                    row = run_row(net, k, mode, model, reps, args, port, work)
                    rows.append(row)
                    say(f"{mode:>8} trainer nodes {row['trainer_nodes']} -> {n} replica(s): "
                        f"{row['bytes'] / 1e6:.1f} MB in {row['median_transfer_s']:.2f} s "
                        f"({row['mb_per_s']:.1f} MB/s), floor {row['floor_s']:.2f} s, "
                        f"{row['ratio_to_floor']:.2f} x floor, one-to-all floor "
                        f"{row['ratio_to_one_to_all_floor']:.2f} x, exact {row['exact']}")
        finally:
            for r in started:
                r.close()
    # the targets: k senders >= 0.8 k x one sender until the replica links saturate
    for n in nreps:
        single = next(r for r in rows if r["mode"] == "single" and r["replicas"] == n)
        for r in rows:
            if r["replicas"] != n or r["mode"] == "single":
                continue
            ideal = min(r["trainer_nodes"] * single["mb_per_s"],
                        args.engine_mbit / 8 * 1e6 / 1e6)
            r["speedup_vs_single"] = r["mb_per_s"] / single["mb_per_s"]
            r["ratio_to_ideal_scaling"] = r["mb_per_s"] / ideal
    say("")
    say(f"{'mode':>8} {'k':>2} {'R':>2} {'MB':>7} {'s':>6} {'MB/s':>7} {'x single':>9} "
        f"{'x ideal':>8} {'x floor':>8} {'x 1-to-all':>10} exact")
    for r in rows:
        say(f"{r['mode']:>8} {r['trainer_nodes']:>2} {r['replicas']:>2} {r['bytes'] / 1e6:>7.1f} "
            f"{r['median_transfer_s']:>6.2f} {r['mb_per_s']:>7.1f} "
            f"{r.get('speedup_vs_single', 1.0):>9.2f} {r.get('ratio_to_ideal_scaling', 1.0):>8.2f} "
            f"{r['ratio_to_floor']:>8.2f} {r['ratio_to_one_to_all_floor']:>10.2f} {r['exact']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "bench_scale", "machine": machine(),
              "params": {k: v for k, v in vars(args).items() if k != "work"}, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".log").write_text("\n".join(LOG) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.log')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

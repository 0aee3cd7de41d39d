"""Shard-direct on simulated nodes (issue 40): k FSDP2 trainer hosts -> the m engine
hosts of one TP=m module replica, each link rate-limited, every trainer rank sending only
its shards' intersections with what each engine rank needs (the static schedule), gloo
point to point, no gather.

Nodes are network namespaces on this machine (`enginehooks_testkit.netns`, as
`bench_scale.py`): trainer rank r on host t<r>, engine rank e on host e<e>, every link
shaped with `tc tbf` each way. Each rank is `tests/multihost/shard_rank.py` (FSDP2 on CPU
for the trainer ranks; `enginehooks_testkit/tp_module.py` for the engine ranks, whose
needs come from the copy plan of its own loader). A row's push time is the slowest rank's
time from a barrier of every rank to the end of its part (an engine rank: received,
digests checked, landed); each row ends with a bit-exact check of every engine rank
against a fresh load.

The link-rate floor is the busiest link's bytes over its rate, with the bytes the ranks
counted: each trainer link its sends, each engine link its receives (each byte once).
Each row also records what every link carried at the switch's shapers (frames, headers
included) and dropped, and every host's TCP retransmissions, over the row's pushes
(`links`): what separates a row from its floor that is not the data path.

    sudo python benchmarks/bench_shard_direct.py --out benchmarks/results/shard-direct-cpu
        [--trainer-mbit 100] [--engine-mbit 400] [--hidden 512] [--layers 4] [--reps 3]

Writes OUT.json and OUT.log; root needed (skips with the reason otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_scale import LOG, machine, say  # noqa: E402
from enginehooks_testkit.netns import Network, unavailable_reason  # noqa: E402


def _snmp(host: Any) -> dict[str, int]:
    """The host's TCP counters (`/proc/net/snmp` inside its namespace)."""
    lines = [ln.split() for ln in subprocess.run(
        host.argv(["cat", "/proc/net/snmp"]), capture_output=True, text=True,
        check=True).stdout.splitlines() if ln.startswith("Tcp:")]
    return dict(zip(lines[0][1:], (int(v) for v in lines[1][1:])))


def _qdisc(net: Network, dev: str) -> dict[str, int]:
    """The switch's shaper on `dev`: bytes it sent (frames, headers included), packets
    it dropped (its queue full), times it held a packet back (over the rate)."""
    out = json.loads(subprocess.run(["tc", "-n", net.switch, "-s", "-j", "qdisc", "show",
                                     "dev", dev], capture_output=True, text=True,
                                    check=True).stdout)
    q = next(q for q in out if q.get("kind") == "tbf")
    return {"bytes": q["bytes"], "drops": q["drops"], "overlimits": q["overlimits"]}


def link_counters(net: Network, names: list[str]) -> dict[str, dict[str, int]]:
    """Per host: what its link carried each way and the TCP retransmissions it made
    (why a row is below its floor: bytes sent twice, frames' headers)."""
    out = {}
    for name in names:
        h = net.hosts[name]
        up, down, tcp = _qdisc(net, h.ifb), _qdisc(net, h.port), _snmp(h)
        out[name] = {"up_bytes": up["bytes"], "up_drops": up["drops"],
                     "down_bytes": down["bytes"], "down_drops": down["drops"],
                     "retrans_segs": tcp["RetransSegs"], "out_segs": tcp["OutSegs"]}
    return out


def run_row(net: Network, k: int, m: int, args: argparse.Namespace, port: int,
            logdir: Path) -> dict[str, Any]:
    dims = {"vocab": args.vocab, "hidden": args.hidden, "inter": args.inter,
            "layers": args.layers}
    procs = []
    logs = []
    names = [f"t{r}" for r in range(k)] + [f"e{e}" for e in range(m)]
    before = link_counters(net, names)
    for rank in range(k + m):
        host = net.hosts[f"t{rank}" if rank < k else f"e{rank - k}"]
        spec = {"rank": rank, "trainers": k, "engines": m, "port": port,
                "address": net.hosts["t0"].address, "seed": 5, "dims": dims,
                "reps": args.reps + 1, "timeout_s": args.timeout_s,
                "secret": "ab" * 16}
        log = open(logdir / f"shard-k{k}-m{m}-rank{rank}.log", "w")  # noqa: SIM115
        logs.append(log)
        procs.append(host.popen([sys.executable, "-m", "tests.multihost.shard_rank",
                                 json.dumps(spec)], cwd=str(ROOT),
                                env={**os.environ, "GLOO_SOCKET_IFNAME": "eth0"},
                                stdout=subprocess.PIPE, stderr=log, text=True))
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=args.timeout_s * (args.reps + 2) + 120)
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    after = link_counters(net, names)
    links = {n: {c: after[n][c] - before[n][c] for c in after[n]} for n in names}
    errors = [o for o in out if "error" in o]
    if errors:
        raise RuntimeError(f"k={k} m={m}: {errors}")
    trainers, engines = out[:k], out[k:]
    pushes = [max(o["seconds"][i] for o in out) for i in range(1, args.reps + 1)]
    sent = [o["sent"] for o in trainers]
    received = [o["received"] for o in engines]
    t_rate, e_rate = args.trainer_mbit * 1e6 / 8, args.engine_mbit * 1e6 / 8
    floor = max(max(sent) / t_rate, max(received) / e_rate)
    med = statistics.median(pushes)
    return {"trainer_nodes": k, "engine_ranks": m, "bytes": sum(sent), "sent": sent,
            "received": received, "push_s": pushes, "median_push_s": med,
            "mb_per_s": sum(sent) / med / 1e6, "floor_s": floor,
            "ratio_to_floor": floor / med,
            "trainer_send_s": [statistics.median(o["seconds"][1:]) for o in trainers],
            "engine_push_s": [statistics.median(o["seconds"][1:]) for o in engines],
            "engine_finish_s": [statistics.median(o["finish_s"][1:]) for o in engines],
            "collectives_while_sending": sum(o["collectives"] for o in trainers),
            "exact": all(o["equal"] for o in engines),
            # every push of the row (the untimed first one too): the links' own counts
            "links": links}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/shard-direct-cpu")
    ap.add_argument("--trainer-mbit", type=int, default=100)
    ap.add_argument("--engine-mbit", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--rows", default="1x2,2x2,4x2", help="trainer hosts x engine ranks")
    ap.add_argument("--work", default="/tmp/enginehooks-bench-shard")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"SKIPPED: {reason}")
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shapes = [tuple(int(x) for x in r.split("x")) for r in args.rows.split(",")]
    hosts = ([f"t{i}" for i in range(max(k for k, _ in shapes))]
             + [f"e{i}" for i in range(max(m for _, m in shapes))])
    rows = []
    port = 29800
    with Network(hosts) as net:
        for name in hosts:
            net.hosts[name].shape((args.trainer_mbit if name.startswith("t")
                                   else args.engine_mbit) * 1000, burst_bytes=64 * 1024)
        for k, m in shapes:
            port += 1
            row = run_row(net, k, m, args, port, work)
            rows.append(row)
            say(f"shard-direct {k} trainer hosts -> {m} engine ranks: {row['bytes'] / 1e6:.1f} "
                f"MB in {row['median_push_s']:.2f} s ({row['mb_per_s']:.1f} MB/s), floor "
                f"{row['floor_s']:.2f} s, {row['ratio_to_floor']:.2f} x floor, collectives "
                f"{row['collectives_while_sending']}, exact {row['exact']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "bench_shard_direct", "machine": machine(),
              "params": {k: v for k, v in vars(args).items() if k != "work"}, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".log").write_text("\n".join(LOG) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.log')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shard-direct over NCCL on one 4-GPU machine (issue 40, part 3's device run): 2 FSDP2
trainer ranks (GPUs 0 and 1) -> the 2 engine ranks of one TP=2 module replica (GPUs 2
and 3), against the raw primitive in the same run.

Processes (`tests/gpu/shard_gpu_rank.py`, spawned here, no torchrun): one NCCL world of
four; the model is `enginehooks_testkit/tp_module.py` at 7B-like widths (hidden 4096,
intermediate 11008, fp32, `--layers` layers: about 1.9 GB at the defaults), the replica
the multihost shard tests use (fused q/k/v and gate/up by rows, o/down by columns:
one short run per row, packed; a loader-computed tensor). The schedule is planned once
(`ShardPlanner`, from each engine rank's copy-plan needs and the trainer ranks' FSDP2
placements). Rows, medians of `--reps` pushes after one warm-up each, interleaved:

- `shard`: `send_shards` / `receive_shards` along the schedule, `sum64` digests on the
  device, landing straight into the engine parameters where the plan is a plain copy,
  the rest replayed or loaded (`ShardLanding.finish`);
- `shard_nodigest`: the same with no digest (what the digests cost);
- `shard_per_range`: `shard` with both sides range by range (a `source`/`dest` call,
  digest launch and copy per range), the path before `transports/shard_runs.py`'s
  tables (one launch per peer on each side), for the same run's comparison;
- `raw`: each trainer rank sends its bytes to each engine rank with plain NCCL
  send/recv (one batch per rank, one message per pair of the schedule's bytes for the
  pair, one buffer each side): no schedule walk, no digest, no landing.

A push's time is the slowest rank's, from a barrier of all four to the end of its part
(an engine rank: received, checked, landed, synchronized). `phases_ms` (medians):
the trainer ranks' send, the engine ranks' receive (wire + unpack + digests) and finish
(replay + loader). Every `shard` push is checked bit-exact on each engine rank against
a fresh load of the trainer's weights; the exit status is non-zero if one is not.

    python benchmarks/bench_shard_direct_gpu.py --out benchmarks/results/shard-direct-gpu-h200x4.json
    python benchmarks/bench_shard_direct_gpu.py --smoke   # CPU, gloo, toy widths

Each rank's stderr (timestamped progress lines; every thread's stack if it is stuck at
the deadline) goes to $ENGINEHOOKS_GPU_LOGDIR/bench_shard-rank<i>.err when that is set;
a failure puts the tail of every rank's stderr in the error. NCCL_DEBUG is left to the
caller's environment.

Writes OUT.json (rows, ratios, machine: device name, count, date) and OUT.log (the
table). Without 4 GPUs it writes a JSON that says not run, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_multisender_gpu import machine  # noqa: E402
from tests.gpu.multisender_procs import CHILD_ENV  # noqa: E402
from tests.support.ranks import free_port, run_modules  # noqa: E402

MODES = ("raw", "shard", "shard_nodigest", "shard_per_range")
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def _push(mode: str) -> dict[str, Any]:
    if mode == "shard_nodigest":
        return {"mode": "shard", "checksum": None, "row": mode}
    if mode == "shard_per_range":  # both sides range by range, as before `shard_runs.py`
        return {"mode": "shard", "checksum": "sum64", "row": mode, "tables": "none"}
    return {"mode": mode, "checksum": "sum64", "row": mode}


def rows_of(pushes: list[dict[str, Any]], outs: list[dict[str, Any]], warm: int
            ) -> dict[str, Any]:
    """Per mode: each timed push's slowest rank, its medians and phases."""
    trainers, engines = outs[:2], outs[2:]
    rows: dict[str, Any] = {}
    for mode in MODES:
        idx = [i for i, p in enumerate(pushes) if p["row"] == mode and i >= warm]
        secs = [max(o["pushes"][i]["seconds"] for o in outs) for i in idx]
        sent = [sum(t["pushes"][i].get("sent", 0) for t in trainers) for i in idx]
        med = statistics.median(secs)
        row: dict[str, Any] = {
            "seconds_median": med, "seconds_all": secs, "bytes": sent[0],
            "gbps": sent[0] / med / 1e9,
            "phases_ms": {
                "trainer_send": 1e3 * statistics.median(
                    max(t["pushes"][i]["seconds"] for t in trainers) for i in idx),
                "engine_total": 1e3 * statistics.median(
                    max(e["pushes"][i]["seconds"] for e in engines) for i in idx)}}
        if mode != "raw":
            row["phases_ms"].update({
                "engine_receive": 1e3 * statistics.median(
                    max(e["pushes"][i]["receive_s"] for e in engines) for i in idx),
                "engine_finish": 1e3 * statistics.median(
                    max(e["pushes"][i]["finish_s"] for e in engines) for i in idx)})
            for side, who in (("trainer", trainers), ("engine", engines)):
                keys = sorted({k for o in who for i in idx for k in o["pushes"][i]["phases"]})
                row["phases_ms"][f"{side}_steps"] = {  # host time per step, slowest rank
                    k: round(1e3 * statistics.median(
                        max(o["pushes"][i]["phases"].get(k, 0.0) for o in who) for i in idx), 3)
                    for k in keys}
            row["bit_exact"] = all(e["pushes"][i].get("equal") is True
                                   for e in engines for i in idx)
            row["direct_fraction"] = (sum(e["pushes"][idx[0]]["direct"] for e in engines)
                                      / max(1, sent[0]))
        rows[mode] = row
    return rows


def table(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"# bench_shard_direct_gpu ({m.get('gpu_count')} x {(m.get('gpus') or ['?'])[0]},"
             f" {m.get('date')})", "", f"model: {res.get('model')}", "",
             "| row | median ms | GB/s | bit-exact | phases_ms (median) | all ms |",
             "| --- | ---: | ---: | --- | --- | --- |"]
    for k, v in res.get("rows", {}).items():
        phases = ", ".join(f"{p} {x:.1f}" if isinstance(x, float) else
                           f"{p} {{{', '.join(f'{k} {y:.2f}' for k, y in x.items())}}}"
                           for p, x in v["phases_ms"].items())
        lines.append(f"| {k} | {v['seconds_median'] * 1e3:.1f} | {v['gbps']:.2f} | "
                     f"{v.get('bit_exact', 'n/a (raw)')} | {phases} | "
                     f"{', '.join(f'{x * 1e3:.1f}' for x in v['seconds_all'])} |")
    lines += ["", "| ratio | value |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in res.get("ratios", {}).items()]
    for k, v in res.get("not_run", {}).items():
        lines.append(f"\nnot run: {k}: {v}")
    if "error" in res:
        lines.append(f"\nerror: {res['error']}")
    return "\n".join(lines) + "\n"


def write(out: Path | None, res: dict[str, Any]) -> None:
    text = table(res)
    print(text)
    if out is None:
        return
    stem = out.with_suffix("") if out.suffix == ".json" else out
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(res, indent=1))
    Path(f"{stem}.log").write_text(text + "\n## run log\n\n" + "\n".join(LOG) + "\n")
    print(f"wrote {stem}.json and {stem}.log")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed pushes per row")
    ap.add_argument("--pushes", type=int, default=None,
                    help="total pushes (3 warm-ups included): sets --reps to pushes/3 - 1")
    ap.add_argument("--timeout-s", type=float, default=60.0,
                    help="each rank's bound on one NCCL wait")
    ap.add_argument("--deadline-s", type=float, default=150.0,
                    help="the children print their stacks and are killed past this")
    ap.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.log")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: gloo, toy widths (this file's logic without GPUs)")
    args = ap.parse_args(argv)
    if args.pushes is not None:
        args.reps = max(1, args.pushes // len(MODES) - 1)
    if args.smoke:
        args.hidden, args.inter, args.vocab, args.layers, args.reps = 256, 768, 2048, 2, 2
    res: dict[str, Any] = {"benchmark": "bench_shard_direct_gpu",
                           "args": {k: str(v) if isinstance(v, Path) else v
                                    for k, v in vars(args).items()}, "machine": machine()}
    n = res["machine"]["gpu_count"]
    if n < 4 and not args.smoke:
        res["not_run"] = {"all": f"needs 4 CUDA GPUs (2 trainer ranks, 2 engine ranks); found {n}"}
        write(args.out, res)
        return 0
    dims = {"vocab": args.vocab, "hidden": args.hidden, "inter": args.inter,
            "layers": args.layers, "experts": args.experts}
    pushes = [_push(m) for m in MODES]  # one warm-up each
    pushes += [_push(m) for _ in range(args.reps) for m in MODES]
    res["model"] = (f"tp_module TinyFull {dims}, fp32; 2 FSDP2 ranks -> TP=2 replica; "
                    f"{len(pushes)} pushes ({len(MODES)} warm-up)")
    t0 = time.monotonic()
    say(f"starting 4 ranks (trainers on GPUs 0, 1; engine ranks on GPUs 2, 3): {res['model']}")
    for k, v in CHILD_ENV.items():
        os.environ.setdefault(k, v)
    port = free_port()
    try:
        outs = run_modules("tests.gpu.shard_gpu_rank", [
            {"rank": r, "port": port, "seed": 5, "dims": dims, "timeout_s": args.timeout_s,
             "pushes": pushes, "smoke": args.smoke, "deadline_s": args.deadline_s - 8}
            for r in range(4)], ROOT, args.deadline_s, label="bench_shard")
        bad = [o for o in outs if "error" in o or any("error" in p for p in o["pushes"])]
        if bad:
            raise RuntimeError(json.dumps(bad)[:4000])
        res["model_bytes"], res["schedule_bytes"] = outs[0]["model_bytes"], outs[0]["schedule_bytes"]
        res["devices"] = [o["device"] for o in outs]
        res["rows"] = rows_of(pushes, outs, len(MODES))
        raw = res["rows"]["raw"]["seconds_median"]
        res["ratios"] = {"raw_over_shard (1 = the primitive's speed)":
                         raw / res["rows"]["shard"]["seconds_median"],
                         "raw_over_shard_nodigest":
                         raw / res["rows"]["shard_nodigest"]["seconds_median"],
                         "raw_over_shard_per_range":
                         raw / res["rows"]["shard_per_range"]["seconds_median"],
                         "bytes_sent_over_model": res["schedule_bytes"] / res["model_bytes"]}
    except Exception as e:  # the table says what failed; the exit status too
        res["error"] = f"{type(e).__name__}: {e}"
        say(f"FAILED: {res['error']}")
    res["wall_seconds"] = time.monotonic() - t0
    write(args.out, res)
    rows = res.get("rows", {})
    ok = "error" not in res and all(v.get("bit_exact", True) for v in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

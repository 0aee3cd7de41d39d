"""Several senders over NCCL on one 4-GPU machine (issue 25): 2 FSDP2 trainer ranks each
send what they own into 2 module replicas, against one sender and raw NCCL broadcasts.

Processes (`tests/gpu/multisender_procs.py`): trainer ranks on GPUs 0 and 1 (an NCCL
world of 2; a model with Qwen2.5-7B's tensor shapes and HF names, `--layers` layers,
bf16, `fully_shard`ed per layer), module replicas on GPUs 2 and 3 (a `LocalEngine`
behind HTTP: they receive through `EngineSide` and `Receiver.deliver`, the code the
engine plugins run). Rows, medians of `--reps` after `--warmup`, all in one run:

- (a) `multi`: `WeightSync("nccl", senders=...)`, both ranks sending their share (push wall
  time on rank 0, and its transfer phase);
- (b) `single`: one `WeightSync("nccl", device=cuda:0)` on rank 0 with the FSDP2
  adapter (rank 1 follows the lockstep gathers), into the same 2 replicas;
- (c) `raw_single`: raw NCCL broadcast of the same total bytes, cut at the same bucket
  size, from trainer GPU 0 to the 2 replica GPUs (a `ProcessGroupNCCL` of sender +
  replicas), back to back;
- (d) `raw_multi`: both trainer ranks at once, each broadcasting its part's buckets (as
  (a) plans them) to the replicas through a group of its own;
- (e) `shard`: `WeightSync("shard_nccl", senders=...)`: shard-direct, each trainer rank
  sending only its own FSDP2 shards' bytes, point to point along the static schedule,
  to each replica (no gather); the replicas record their loader's copy plan at start,
  so `info` reports what they need (`--no-shard` leaves this row out).

Every (a)/(b) push is followed by a bit-exact check of both replicas against the
trainer's full state dict (per-tensor `sum64`, gathered), perturbing the trainer before
each push; the exit status is non-zero if any push is not bit-exact. Raw rows time from
the first broadcast posted by a sender to the last receiver done (one clock: all
processes are on this machine).

    python benchmarks/bench_multisender_gpu.py --out benchmarks/results/multisender-h100x4
    python benchmarks/bench_multisender_gpu.py --smoke   # CPU, gloo, tiny shapes

Writes OUT.json (rows, ratios, args, machine) and OUT.log (a markdown table). A
watchdog kills the children and exits non-zero past `--deadline-s`. Without 4 GPUs
(and without --smoke) it writes a JSON that says not run, and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from bench_transports import MODELS, qwen25_7b_specs  # noqa: E402

from enginehooks.core.buckets import message_bytes  # noqa: E402
from enginehooks.core.manifest import TensorSpec, plan  # noqa: E402
from enginehooks.core.senders import decide_parts, parts  # noqa: E402
from tests.gpu.multisender_procs import CHILD_ENV, Procs  # noqa: E402

GB = 1e9
MiB = 1 << 20
LOG: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LOG.append(line)


def smoke_specs() -> list[TensorSpec]:
    """Qwen2 names at toy sizes (bf16 throughout: FSDP2 gathers one dtype per group);
    the embedding and head span several of the smoke's buckets."""
    h, inter, vocab, kv = 64, 160, 1500, 32
    out = [TensorSpec("model.embed_tokens.weight", "bfloat16", (vocab, h))]
    for i in range(2):
        p = f"model.layers.{i}."
        out += [TensorSpec(p + "input_layernorm.weight", "bfloat16", (h,)),
                TensorSpec(p + "self_attn.q_proj.weight", "bfloat16", (h, h)),
                TensorSpec(p + "self_attn.q_proj.bias", "bfloat16", (h,)),
                TensorSpec(p + "self_attn.k_proj.weight", "bfloat16", (kv, h)),
                TensorSpec(p + "self_attn.v_proj.weight", "bfloat16", (kv, h)),
                TensorSpec(p + "self_attn.o_proj.weight", "bfloat16", (h, h)),
                TensorSpec(p + "mlp.gate_proj.weight", "bfloat16", (inter, h)),
                TensorSpec(p + "mlp.down_proj.weight", "bfloat16", (h, inter))]
    return [*out, TensorSpec("model.norm.weight", "bfloat16", (h,)),
            TensorSpec("lm_head.weight", "bfloat16", (vocab, h))]


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if info["gpu_count"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(info["gpu_count"])]
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    for k in (*CHILD_ENV, "ENGINEHOOKS_FUSED_PACK", "ENGINEHOOKS_FUSED_UNPACK"):
        info[k] = os.environ.get(k, CHILD_ENV.get(k))
    return info


class Bench:
    def __init__(self, args: argparse.Namespace, procs: Procs, specs: list[TensorSpec],
                 bucket: int, backend: str) -> None:
        self.args, self.p, self.specs, self.bucket = args, procs, specs, bucket
        self.backend = backend
        self.total = sum(s.nbytes for s in specs)
        self.rows: dict[str, Any] = {}
        self.not_run: dict[str, str] = {}
        self.seed = 100

    # the bytes each sender sends, cut as enginehooks cuts them
    def single_sizes(self) -> list[int]:
        m = plan(self.specs, weight_version=0, bucket_bytes=self.bucket, checksum="sum64")
        return [message_bytes(b.nbytes) for b in m.buckets]

    def multi_sizes(self) -> list[list[int]]:
        m = plan(parts=decide_parts([self.specs, self.specs]), weight_version=0,
                 bucket_bytes=self.bucket, checksum="sum64")
        return [[message_bytes(b.nbytes) for b in part.buckets] for part in parts(m)]

    def row(self, key: str, times: list[float], **extra: Any) -> None:
        timed = times[self.args.warmup:]
        med = statistics.median(timed)
        self.rows[key] = {"seconds_median": med, "seconds_all": times, "gbps": self.total / med / GB,
                          **extra}
        say(f"  {key:28s} {med * 1e3:10.2f} ms  {self.total / med / GB:8.2f} GB/s")

    # (c) and (d)
    def raw(self, key: str, senders: list[int], sizes: list[list[int]]) -> None:
        p = self.p
        world = 1 + len(p.replicas)
        tags = [f"{key}{j}" for j in senders]
        for j, tag in zip(senders, tags):  # one group at a time, in the same order everywhere
            port = p.call([p.trainers[j]], {"op": "raw_store", "tag": tag})[0]["port"]
            p.call([p.trainers[j], *p.replicas],
                   [{"op": "raw_join", "tag": tag, "world": world}] + [
                       {"op": "raw_join", "tag": tag, "world": world, "rank": i + 1,
                        "port": port} for i in range(len(p.replicas))])
        times = []
        for _ in range(self.args.warmup + self.args.reps):
            p.call(p.replicas, {"op": "raw_post", "sizes": dict(zip(tags, sizes))})
            sent = p.call([p.trainers[j] for j in senders],
                          [{"op": "raw_send", "tag": t, "sizes": s} for t, s in zip(tags, sizes)])
            done = p.call(p.replicas, {"op": "raw_wait"})
            t_end = max([a["t1"] for a in sent] + [a["t_end"] for a in done])
            times.append(t_end - min(a["t0"] for a in sent))
        for j, tag in zip(senders, tags):
            p.call([p.trainers[j], *p.replicas], {"op": "raw_close", "tag": tag})
        self.row(key, times, backend=self.backend, senders=len(senders),
                 messages=[len(s) for s in sizes], bytes=sum(map(sum, sizes)))

    # (a) and (b)
    def pushes(self, key: str, mode: str) -> None:
        times, transfer, checks, outs = [], [], [], []
        for i in range(self.args.warmup + self.args.reps):
            self.seed += 1
            self.p.perturb(self.seed)
            out = self.p.push(mode, self.seed)
            outs.append(out)
            times.append(out["seconds"])
            transfer.append(out.get("phases", {}).get("transfer", float("nan")))
            c = self.p.check()
            c["push"] = i
            checks.append(c)
            if not c["bit_exact"]:
                say(f"  {key}: push {i} NOT bit-exact: {c['mismatched']} {c['unexpected']}")
        self.p.call(self.p.trainers, {"op": "close", "mode": mode})
        seen = sorted({w.get("senders", 1) for r in out.get("replica_stats") or []
                       for w in (r or {}).get("workers") or []})
        w = self.args.warmup
        self.row(key, times, transfer_seconds_all=transfer,
                 transfer_seconds_median=statistics.median(transfer[w:]),
                 bit_exact=all(c["bit_exact"] for c in checks), checks=checks,
                 tensors=checks[0]["tensors"], bytes_pushed=out.get("bytes"),
                 buckets=out.get("buckets"), phases_last=out.get("phases"),
                 senders_seen_by_replicas=seen,
                 # both sides, ms: the coordinator's push phases (medians of the timed
                 # pushes), the sender's and the replicas' transport phases (last push);
                 # calls per replica per push and the path each took (planned / prepared)
                 phases_ms=phases_ms(outs[w:] or outs),
                 rpcs_per_push=[o.get("rpcs") for o in outs],
                 rpcs_steady=max((o.get("rpcs") or 0) for o in (outs[w:] or outs)),
                 layouts=[o.get("layout") for o in outs],
                 # the steady-state pushes' path: "prepared" once the first push kept
                 # the layout (several senders too, issue 37 item 1), else "planned"
                 layout_steady="/".join(sorted({str(o.get("layout")) for o in (
                     outs[w:] or outs)})),
                 received_in_send_order=sorted({str(w.get("in_order")) for r in out.get(
                     "replica_stats") or [] for w in (r or {}).get("workers") or []}))

    def run(self) -> None:
        say(f"rows ({self.backend}; {self.total / GB:.3f} GB; bucket {self.bucket / MiB:g} MiB):")
        self.raw("raw_single", [0], [self.single_sizes()])
        if self.args.gpus == 2:
            # one replica on GPU 1, which trainer rank 1 also holds: a group of rank 1 and
            # that replica would put two NCCL ranks on one GPU, so no several-sender rows
            why = "--gpus 2: a second sender's group would hold GPU 1 twice"
            self.not_run.update(raw_multi=why, multi=why)
        else:
            self.raw("raw_multi", [0, 1], self.multi_sizes())
            self.pushes("multi", "multi")
            if self.args.no_shard:
                self.not_run["shard"] = "--no-shard"
            else:
                self.pushes("shard", "shard")
        self.pushes("single", "single")


def phases_ms(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """A push row's `phases_ms`: the coordinator's push phases (medians, ms) and what
    the push spent outside them; the sender's and replicas' transport phases of the last
    push."""
    names = sorted({k for o in outs for k in o.get("phases") or {}})
    trainer = {k: statistics.median((o.get("phases") or {}).get(k, 0.0) for o in outs) * 1e3
               for k in names}
    trainer["outside_phases"] = statistics.median(
        o["seconds"] - sum((o.get("phases") or {}).values()) for o in outs) * 1e3
    last = outs[-1]
    return {"trainer": trainer, "sender": last.get("sender_phases_ms") or {},
            "replica": last.get("replica_phases_ms") or []}


def ratios(rows: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}

    def t(k: str, field: str = "seconds_median") -> float | None:
        v = rows.get(k)
        return None if v is None else v.get(field)

    for a, b in (("multi", "raw_single"), ("multi", "raw_multi"), ("single", "raw_single"),
                 ("multi", "single"), ("shard", "raw_single"), ("shard", "raw_multi")):
        if t(a) and t(b):
            out[f"{a} / {b} (time)"] = t(a) / t(b)  # type: ignore[operator]
            ta = t(a, "transfer_seconds_median")
            if ta:
                out[f"{a} transfer phase / {b} (time)"] = ta / t(b)  # type: ignore[operator]
    if t("multi") and t("single"):
        out["single / multi (speedup of several senders)"] = t("single") / t("multi")  # type: ignore[operator]
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"# bench_multisender_gpu ({res.get('kind')}, {res['machine'].get('date')})", "",
             f"model: {res.get('model')}", "",
             "| row | median ms | GB/s | transfer-phase ms | bit-exact | rpcs/replica | "
             "layout (steady) | all ms |",
             "| --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for k, v in res.get("rows", {}).items():
        tr = v.get("transfer_seconds_median")
        lines.append(f"| {k} | {v['seconds_median'] * 1e3:.2f} | {v['gbps']:.2f} | "
                     f"{'' if tr is None else f'{tr * 1e3:.2f}'} | "
                     f"{v.get('bit_exact', 'n/a (raw)')} | "
                     f"{v.get('rpcs_per_push', '')} | {v.get('layout_steady', '')} | "
                     f"{', '.join(f'{x * 1e3:.1f}' for x in v['seconds_all'])} |")
    for k, v in res.get("rows", {}).items():
        if "phases_ms" in v:
            lines.append(f"\n{k} phases_ms: {json.dumps(v['phases_ms'])}")
    lines += ["", "| ratio | value |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in res.get("ratios", {}).items()]
    for k, v in res.get("not_run", {}).items():
        lines.append(f"\nnot run: {k}: {v}")
    return "\n".join(lines) + "\n"


def write(out: Path | None, res: dict[str, Any]) -> None:
    text = table(res) if "rows" in res else json.dumps(res, indent=1)
    print(text)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(res, indent=1))
    Path(f"{out}.log").write_text(text + "\n## run log\n\n" + "\n".join(LOG) + "\n")
    print(f"wrote {out}.json and {out}.log")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket-mib", type=float, default=256.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--deadline-s", type=float, default=480.0)
    ap.add_argument("--smoke", action="store_true", help="CPU: gloo, tiny shapes")
    ap.add_argument("--no-shard", action="store_true",
                    help="leave out the shard-direct row (e)")
    ap.add_argument("--gpus", type=int, default=4, choices=(2, 4),
                    help="2: trainer ranks on GPUs 0 and 1, one replica on GPU 1; the "
                         "one-sender rows only (a device check, not the issue's rows)")
    ap.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.log")
    ap.add_argument("--logdir", type=Path, default=None, help="children's stderr (default: tmp)")
    args = ap.parse_args(argv)
    for k, v in CHILD_ENV.items():
        os.environ.setdefault(k, v)
    res: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                    for k, v in vars(args).items()}, "machine": machine()}
    n = res["machine"]["gpu_count"]
    if not args.smoke and n < args.gpus:
        res["not_run"] = {"all": f"needs {args.gpus} CUDA GPUs (2 trainer ranks + replicas); "
                                 f"found {n}"}
        write(args.out, res)
        return 0
    if args.smoke:
        specs, bucket, backend = smoke_specs(), 64 * 1024, "gloo"
        trainers, replicas, single_device = ["cpu", "cpu"], ["cpu", "cpu"], None
        res["model"] = f"smoke: Qwen2 names, toy sizes, {len(specs)} tensors"
    else:
        specs, bucket, backend = qwen25_7b_specs(args.layers), int(args.bucket_mib * MiB), "nccl"
        trainers, single_device = ["cuda:0", "cuda:1"], "cuda:0"
        replicas = ["cuda:2", "cuda:3"] if args.gpus == 4 else ["cuda:1"]
        res["model"] = f"{MODELS['qwen2.5-7b'][0]}, {args.layers} layers, bf16, {len(specs)} tensors"
    res["kind"] = "smoke (CPU, gloo)" if args.smoke else f"nccl, {args.gpus} GPUs"
    res["bucket_bytes"], res["total_bytes"] = bucket, sum(s.nbytes for s in specs)
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="bench-multisender-"))
    res["logdir"] = str(logdir)
    procs: list[Procs] = []
    failed = threading.Event()

    def watchdog() -> None:
        say(f"WATCHDOG: the run exceeded --deadline-s {args.deadline_s}; killing the children")
        failed.set()
        for p in procs:
            p.kill()
        res["error"] = f"deadline of {args.deadline_s}s exceeded"
        try:
            write(args.out, res)
        finally:
            os._exit(3)

    dog = threading.Timer(args.deadline_s, watchdog)
    dog.daemon = True
    dog.start()
    t0 = time.monotonic()
    say(f"starting 2 trainer ranks ({trainers}) and {len(replicas)} replicas ({replicas}); "
        f"logs in {logdir}")
    bench = None
    try:
        p = Procs([[s.name, s.dtype, list(s.shape)] for s in specs], backend=backend,
                  trainer_devices=trainers, replica_devices=replicas, timeout_s=args.timeout_s,
                  bucket_bytes=bucket, logdir=logdir, single_device=single_device,
                  plans=not args.no_shard)
        procs.append(p)
        say(f"started in {time.monotonic() - t0:.1f}s")
        bench = Bench(args, p, specs, bucket, backend)
        try:
            bench.run()
        finally:
            p.close()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        say(f"FAILED: {res['error']}")
    finally:
        dog.cancel()
    if bench is not None:
        res["rows"], res["not_run"] = bench.rows, bench.not_run
        res["ratios"] = ratios(bench.rows)
    res["wall_seconds"] = time.monotonic() - t0
    write(args.out, res)
    exact = [k for k, v in res.get("rows", {}).items() if "bit_exact" in v]
    if "error" in res or failed.is_set() or len(exact) < (1 if args.gpus == 2 else 2) or not all(
            res["rows"][k]["bit_exact"] for k in exact):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

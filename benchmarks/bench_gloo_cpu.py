"""CPU benchmark: an enginehooks gloo push against a raw gloo broadcast of the same bytes.

One run measures, with the same bucket size and the same byte count:
  raw        torch.distributed gloo broadcast of the update's buckets (rank 0 -> rank 1)
  local      WeightSync gloo push into a torch model (LocalEngine): packing, digests,
             trailers, manifest validation, copies into parameters
  vllm       WeightSync gloo push into a real in-process vLLM (CPU): adds vLLM's
             layerwise reload_weights
Both ends run in this process (the receiver on a thread; gloo does its I/O in its own
threads), so every row pays the same; the ratio to `raw` is what to compare across
machines. Prints a table and writes JSON with the machine description.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

from enginehooks import WeightSync
from enginehooks.core.buckets import message_bytes
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.testing.tiny import make_tiny_model
from enginehooks.transports._rendezvous import client_store, master_store, new_group


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def raw_broadcast(sizes: list[int], reps: int, timeout_s: float) -> list[float]:
    """Seconds per update for plain gloo broadcasts of buffers of `sizes` bytes."""
    store = master_store("127.0.0.1", 0, timeout_s)
    times: list[float] = []
    biggest = max(sizes)

    def receiver() -> None:
        pg = new_group("gloo", client_store("127.0.0.1", store.port, timeout_s), "raw/", 1, 2,
                       timeout_s)
        buf = torch.empty(biggest, dtype=torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for _ in range(reps + 1):
            for n in sizes:
                pg.broadcast([buf[:n]], opts).wait()

    th = threading.Thread(target=receiver, daemon=True)
    th.start()
    pg = new_group("gloo", store, "raw/", 0, 2, timeout_s)
    buf = torch.randint(0, 255, (biggest,), dtype=torch.uint8)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for i in range(reps + 1):
        t0 = time.perf_counter()
        for n in sizes:
            pg.broadcast([buf[:n]], opts).wait()
        if i:  # first round is warm-up
            times.append(time.perf_counter() - t0)
    th.join(timeout_s)
    return times


def pushes(sync: WeightSync, model: torch.nn.Module, reps: int) -> list[float]:
    times = []
    for v in range(reps + 1):
        report = sync.push(model, version=v)
        if v:
            times.append(report.phases["transfer"])
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--no-vllm", action="store_true", help="skip the real-engine row")
    ap.add_argument("--checksum", default="xxh3", help="xxh3, crc32, sum64 or none")
    ap.add_argument("--out", default="benchmarks/results/gloo-cpu.json")
    args = ap.parse_args()
    checksum = None if args.checksum == "none" else args.checksum
    bucket = int(args.bucket_mb * (1 << 20))
    timeout_s = 300.0

    work = Path(tempfile.mkdtemp(prefix="enginehooks-bench-"))
    model_dir = make_tiny_model(work / "model", vocab_size=args.vocab, hidden_size=args.hidden,
                                layers=args.layers, heads=args.hidden // 64, kv_heads=2)
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sd = trainer.state_dict()
    m = plan([TensorSpec(n, "float32", tuple(t.shape)) for n, t in sd.items()],
             weight_version=0, bucket_bytes=bucket)
    sizes = [message_bytes(b.nbytes) for b in m.buckets]
    nbytes = m.total_bytes

    rows: dict[str, list[float]] = {"raw": raw_broadcast(sizes, args.reps, timeout_s)}
    replica = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with WeightSync("gloo", bucket_bytes=bucket, timeout_s=timeout_s, checksum=checksum) as s:
        s.add_replica(LocalEngine(replica))
        rows["local"] = pushes(s, trainer, args.reps)
    for a, b in zip(trainer.state_dict().values(), replica.state_dict().values()):
        assert torch.equal(a, b), "benchmark push was not bit-exact"
    if not args.no_vllm:
        from vllm import LLM

        from enginehooks.vllm_ext import VLLMEngine

        llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True,
                  worker_extension_cls="enginehooks.vllm_ext.WorkerExtension")
        with WeightSync("gloo", bucket_bytes=bucket, timeout_s=timeout_s,
                        checksum=checksum) as s:
            s.add_replica(VLLMEngine(llm))
            rows["vllm"] = pushes(s, trainer, args.reps)

    raw_med = statistics.median(rows["raw"])
    result = {
        "benchmark": "bench_gloo_cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "processor": cpu_model(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "torch": torch.__version__},
        "params": {"bytes": nbytes, "buckets": len(sizes), "bucket_bytes": bucket,
                   "tensors": len(sd), "reps": args.reps, "checksum": checksum},
        "rows": {k: {"median_s": statistics.median(v), "all_s": v,
                     "gbps": nbytes / statistics.median(v) / 1e9,
                     "speed_vs_raw": raw_med / statistics.median(v)} for k, v in rows.items()},
    }
    print(f"\n{nbytes / 1e6:.1f} MB in {len(sizes)} buckets of {args.bucket_mb} MiB, "
          f"checksum={checksum}, median of {args.reps}")
    print(f"{'path':<8} {'seconds':>9} {'GB/s':>8} {'x raw speed':>12}")
    for k, r in result["rows"].items():
        print(f"{k:<8} {r['median_s']:>9.4f} {r['gbps']:>8.3f} {r['speed_vs_raw']:>12.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

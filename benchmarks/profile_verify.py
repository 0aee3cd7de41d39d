"""cProfile of verified pushes into an in-process engine on CPU, with bench_verify.py's
setup (Qwen2.5-0.5B shapes, bf16): where a verified push's time goes, in the apply and in
the verification, beyond the verdict's own `seconds`. Not a CI test.

    python benchmarks/profile_verify.py vllm 2 > profile.txt   # engine, rounds

Each round is an unverified push and two verified ones; the verified pushes from the
second round's on are profiled (the apply, and `Verifier.run`, on the thread that runs
them), and both profiles are printed, by cumulative and by own time.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_verify as bv
from bench_gloo_cpu import build_model

from enginehooks import WeightSync
from enginehooks.engine import apply as ap
from enginehooks.engine import verify as vf

prof_apply = cProfile.Profile()
prof_verify = cProfile.Profile()
active = {"on": False}
orig_apply = ap.ApplyTarget.apply
orig_run = vf.Verifier.run
timing: dict[str, list[float]] = {}

def apply(self: Any, tensors: Any) -> None:
    if not active["on"]:
        return orig_apply(self, tensors)
    prof_apply.enable()
    t0 = time.perf_counter()
    try:
        return orig_apply(self, tensors)
    finally:
        prof_apply.disable()
        timing.setdefault("apply_total", []).append(time.perf_counter() - t0)

def run(self: Any, *a: Any, **k: Any) -> Any:
    if not active["on"]:
        return orig_run(self, *a, **k)
    prof_verify.enable()
    t0 = time.perf_counter()
    try:
        return orig_run(self, *a, **k)
    finally:
        prof_verify.disable()
        timing.setdefault("verify_run", []).append(time.perf_counter() - t0)

def main() -> int:
    engine = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    ap.ApplyTarget.apply = apply  # type: ignore[method-assign]
    vf.Verifier.run = run  # type: ignore[method-assign]
    model_dir = build_model(Path.home() / ".cache/enginehooks/bench-qwen05b", "qwen05b")
    running, handle, trainer = bv.engine_replica(engine, model_dir)
    try:
        with WeightSync("gloo", bucket_bytes=bv.BUCKET, timeout_s=1800) as sync:
            sync.add_replica(handle)
            phases = ["record", "plan-first"] + ["never", "always", "always"] * rounds
            for i, phase in enumerate(phases):
                w = trainer(1000 + i)
                sync.verify = phase.startswith("always")
                active["on"] = phase == "always" and i >= 4
                t0 = time.perf_counter()
                sync.push(w, version=i + 1)
                wall = time.perf_counter() - t0
                active["on"] = False
                info = handle.info(120)[0]
                last = (info.get("verification") or {}).get("last") or {}
                print(json.dumps({"phase": phase, "wall": round(wall, 3),
                                  "apply": (info.get("copy_plan") or {}).get("seconds"),
                                  "vseconds": last.get("seconds"), "how": last.get("how")}), flush=True)
    finally:
        running.close()
    print("timing", timing)
    for name, p in (("apply", prof_apply), ("verify", prof_verify)):
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("cumulative").print_stats(45)
        print("=====", name, "cumulative\n", s.getvalue())
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(30)
        print("=====", name, "tottime\n", s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())

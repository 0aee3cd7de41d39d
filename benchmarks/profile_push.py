"""Where the time of one push goes, on CPU: a sampling profile of every thread of every
process involved (trainer, receiver, engine scheduler), sorted into phases.

    python benchmarks/profile_push.py --engine local|vllm|sglang [--preset tiny|qwen05b]

A sampler thread looks at every thread's Python stack every `--interval-ms` (by default
2 ms) while the measured pushes run, and charges the time since its last look to the
phase of the innermost frame that names one (`PHASES`): waiting for the wire, packing,
digests, unpacking, the engine's loader, its post-load processing, the copy plan's
replay, verification, flush, RPC and control. SGLang's scheduler runs in a child
process: the sampler gets there through a `sitecustomize` on `PYTHONPATH` (started in
every Python process of the run, and after a fork), switched on and off by a marker
file, each process writing its own totals. No engine code is changed for it.

Reading it: each thread's phases add up to the wall time of the measured pushes (a
thread that waits is charged to what it waits in), so the trainer's and the receiver's
rows say who waits for whom. Time spent in C without Python frames in between (a
digest, a copy) is charged to the Python function that called it. A sample can land
late while a C call holds the GIL, so a phase below ~2 samples is noise.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ENV_DIR = "ENGINEHOOKS_PROFILE_DIR"

#: (phase, file substring or "", function names or ()), tried from the innermost frame
#: outward: the first match names the phase of a sample.
PHASES: list[tuple[str, str, tuple[str, ...]]] = [
    ("digest", "enginehooks/core/checksums.py", ()),
    ("trailer/MAC", "enginehooks/core/auth.py", ()),
    ("wait for the wire", "enginehooks/transports/broadcast.py",
     ("_wait", "_collective_error", "_bcast", "_host_wait", "post")),
    ("pack (copy into bucket)", "enginehooks/core/buckets.py", ("pack", "seal", "direct",
                                                                "open_bucket")),
    ("unpack (copy out of bucket)", "enginehooks/core/buckets.py",
     ("unpack", "_destination", "landing", "_matching")),
    ("trailer/MAC", "enginehooks/core/buckets.py", ("verify", "read_trailer",
                                                    "write_trailer", "check_header")),
    ("copy plan replay", "enginehooks/engine/copy_plan.py", ()),
    ("verify after apply", "enginehooks/engine/verify.py", ()),
    ("byte tracer", "enginehooks/engine/trace.py", ()),
    ("post-load processing", "", ("process_weights_after_loading",
                                  "_process_weights_after_loading", "finalize_layerwise_reload",
                                  "process_weights_after_loading_",
                                  "_copy_and_restore_kernel_tensors", "_place_kernel_tensors")),
    # the vLLM copy plan's own layer handling (`PlannedLayers`): materialising a layer
    # and the plan's copies are the replay; processing a complete layer, waiting for the
    # thread that does it, and the repairs after a reload are post-load processing
    ("copy plan replay", "enginehooks/vllm_ext/worker_extension.py", ("write", "_open")),
    ("post-load processing", "enginehooks/vllm_ext/worker_extension.py",
     ("_close", "_close_in_worker", "_submit", "finish", "_drain", "_check_closing",
      "_repair_after_reload")),
    ("engine loader", "", ("load_weights", "weight_loader", "weight_loader_v2",
                           "default_weight_loader", "reload_weights", "load_weights_and_postprocess",
                           "_load_weights", "layerwise_reload")),
    ("flush cache", "", ("flush_cache", "reset_prefix_cache", "flush")),
    ("pause/resume", "", ("pause", "resume", "pause_generation", "continue_generation")),
    ("trainer stream", "enginehooks/trainer_side/", ()),
    ("module target copy", "enginehooks/engine/targets.py", ()),
    ("engine side / hooks", "enginehooks/engine/side.py", ()),
    ("engine side / hooks", "enginehooks/plugins.py", ()),
    ("engine RPC", "", ("collective_rpc", "call_utility", "_call_utility", "rpc",
                        "send_recv", "recv_pyobj", "send_pyobj", "_http")),
    ("control (sync.py)", "enginehooks/control/", ()),
]


def phase_of(frame: Any) -> str | None:
    f = frame
    while f is not None:
        code = f.f_code
        fname, func = code.co_filename, code.co_name
        for phase, path, funcs in PHASES:
            if (not path or path in fname) and (not funcs or func in funcs):
                return phase
        f = f.f_back
    return None


class Sampler:
    """Charges wall time to each thread's phase while `on()` says so."""

    def __init__(self, interval_s: float, on: Any, out: Path | None = None) -> None:
        self.interval_s, self.on, self.out = interval_s, on, out
        self.totals: dict[str, Counter[str]] = defaultdict(Counter)
        self.leaf: dict[str, Counter[str]] = defaultdict(Counter)
        self.wall = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="enginehooks-profiler",
                                       daemon=True)

    def start(self) -> Sampler:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)

    def _run(self) -> None:
        me = threading.get_ident()
        last, was_on = time.perf_counter(), False
        while not self._stop.is_set():
            time.sleep(self.interval_s)
            now = time.perf_counter()
            dt, last = now - last, now
            active = self.on()
            if not active:
                if was_on and self.out is not None:
                    self.dump()
                was_on = False
                continue
            was_on = True
            self.wall += dt
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                phase = phase_of(frame)
                if phase is None:
                    continue  # idle threads of the engine (its loops, pools)
                self.totals[name][phase] += dt
                code = frame.f_code
                self.leaf[name][f"{Path(code.co_filename).name}:{code.co_name}"] += dt

    def result(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "argv0": sys.argv[0] if sys.argv else "",
                "wall_s": self.wall,
                "threads": {n: dict(c.most_common()) for n, c in self.totals.items()},
                "leaf": {n: dict(c.most_common(8)) for n, c in self.leaf.items()}}

    def dump(self) -> None:
        assert self.out is not None
        self.out.write_text(json.dumps(self.result(), indent=1))


def start_from_env() -> None:
    """Called by the run's `sitecustomize`: sample this process while the marker file
    exists, and write its totals next to it when it goes away (and after a fork)."""
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return
    marker = Path(folder) / "on"
    sys.setswitchinterval(0.001)  # a thread holding the GIL delays a sample less

    def start() -> None:
        Sampler(0.002, marker.exists, Path(folder) / f"proc-{os.getpid()}.json").start()

    start()
    os.register_at_fork(after_in_child=start)


def main() -> int:
    import argparse
    import subprocess
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["local", "vllm", "sglang"], default="local")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--pushes", type=int, default=3, help="measured pushes")
    ap.add_argument("--warmup", type=int, default=2, help="pushes before the measured ones")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--direct", choices=["on", "off"], default="on",
                    help="direct buckets (issue 20) on, or every bucket packed")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--python", default=None, help="the Python to run the push with "
                    "(default: this one; sglang: ~/.cache/enginehooks/venv-sglang)")
    ap.add_argument("--out", default=None, help="write the breakdown as JSON here")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inner:
        folder = Path(tempfile.mkdtemp(prefix="enginehooks-profile-"))
        (folder / "sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
            "import profile_push\nprofile_push.start_from_env()\n")
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([str(folder), repo,
                                             *filter(None, [env.get("PYTHONPATH")])])
        env[ENV_DIR] = str(folder)
        python = args.python or (str(Path.home() / ".cache/enginehooks/venv-sglang/bin/python")
                                 if args.engine == "sglang" else sys.executable)
        cmd = [python, __file__, "--inner", *sys.argv[1:]]
        rc = subprocess.run(cmd, env=env, timeout=3600).returncode
        if rc:
            return rc
        return report(folder, args)
    return inner(args)


def inner(args: Any) -> int:
    """The pushes, in the process the sampler runs in (with the receiver on a thread,
    or in vLLM's engine core here, or SGLang's scheduler in its child process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gloo_cpu import PRESETS, build_model, load_trainer

    from enginehooks import WeightSync
    from enginehooks.transports.collectives import GlooTransport

    folder = Path(os.environ[ENV_DIR])
    dtype_name = args.dtype or PRESETS[args.preset]["dtype"]
    model_dir = Path(args.model_dir or folder / "model")
    build_model(model_dir, args.preset)
    trainer = load_trainer(model_dir, getattr(torch, dtype_name))
    if args.direct == "off":
        GlooTransport.direct_min = None
    if args.engine == "local":
        from enginehooks.engine.local import LocalEngine

        engine: Any = None
        handle = LocalEngine(load_trainer(model_dir, getattr(torch, dtype_name)))
    else:
        from enginehooks_testkit.engines import SGLangInProcess, VLLMInProcess

        engine = (VLLMInProcess if args.engine == "vllm" else SGLangInProcess)(
            model_dir, dtype=dtype_name)
        handle = engine.handle()
    marker = folder / "on"
    reports = []
    try:
        with WeightSync("gloo", bucket_bytes=int(args.bucket_mb * (1 << 20)),
                        timeout_s=600) as sync:
            sync.add_replica(handle)
            for v in range(-args.warmup, 0):  # the group, the copy plan, its verification
                sync.push(trainer, version=v)
            marker.touch()
            t0 = time.perf_counter()
            for v in range(1, args.pushes + 1):
                r = sync.push(trainer, version=v)
                reports.append({"phases": r.phases,
                                "replica_stats": [x.stats for x in r.replicas]})
            wall = time.perf_counter() - t0
            marker.unlink()
            time.sleep(0.3)  # every sampler sees the marker gone and writes its totals
            info = handle.info(60)
    finally:
        if engine is not None:
            engine.close()
    (folder / "pushes.json").write_text(json.dumps(
        {"wall_s": wall, "pushes": args.pushes, "reports": reports, "info": info,
         "bytes": sum(p.numel() * p.element_size() for p in trainer.state_dict().values()),
         "dtype": dtype_name}, indent=1, default=str))
    return 0


def report(folder: Path, args: Any) -> int:
    pushes = json.loads((folder / "pushes.json").read_text())
    n = pushes["pushes"]
    procs = [json.loads(p.read_text()) for p in sorted(folder.glob("proc-*.json"))]
    per_push = pushes["wall_s"] / n
    transfer = sum(r["phases"]["transfer"] for r in pushes["reports"]) / n
    print(f"\nload average at the end: {os.getloadavg()}")
    print(f"{args.engine}, {args.preset} ({pushes['dtype']}, {pushes['bytes'] / 1e6:.1f} MB), "
          f"direct buckets {args.direct}: {per_push * 1e3:.1f} ms per push "
          f"(transfer phase {transfer * 1e3:.1f} ms), {n} pushes sampled")
    phases = Counter()
    for r in pushes["reports"]:
        phases.update(r["phases"])
    print("push phases (PushReport, ms per push): " + ", ".join(
        f"{k} {v / n * 1e3:.1f}" for k, v in phases.items()))
    threads: dict[str, dict[str, float]] = {}
    for p in procs:
        for t, c in p["threads"].items():
            busy = sum(c.values())
            if busy < 0.05 * p["wall_s"]:
                continue  # a thread that was there, not one that worked
            threads[f"pid {p['pid']} {t}"] = c
    for t, c in threads.items():
        print(f"\n  {t}: ms per push")
        for phase, s in sorted(c.items(), key=lambda kv: -kv[1]):
            print(f"    {phase:<30} {s / n * 1e3:8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"engine": args.engine, "preset": args.preset, "direct": args.direct,
             "ms_per_push": per_push * 1e3, "transfer_ms": transfer * 1e3,
             "push_phases_ms": {k: v / n * 1e3 for k, v in phases.items()},
             "threads_ms": {t: {k: v / n * 1e3 for k, v in c.items()}
                            for t, c in threads.items()},
             "leaf": {f"pid {p['pid']}": p["leaf"] for p in procs},
             "info": pushes["info"], "reports": pushes["reports"],
             "load_avg_at_end": os.getloadavg()}, indent=1, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

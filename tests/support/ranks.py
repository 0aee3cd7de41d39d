"""Trainer ranks as processes for tests: `run_ranks` starts `world` copies of a test file
run as a script (`script SCENARIO RANK WORLD PORT OUT`), each reading `OUT/extra.json`
and writing `OUT/rank<r>.json`, and returns what each rank wrote, or fails with the tail
of the log of the first rank that did not finish. The ranks import the enginehooks under
test (its checkout first on PYTHONPATH), not another install of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_ranks(script: str | Path, scenario: str, out: Path, extra: dict[str, Any],
              world: int = 2, timeout_s: float = 150.0) -> list[dict[str, Any]]:
    import enginehooks
    from enginehooks_testkit.servers import free_port

    out.mkdir(parents=True, exist_ok=True)
    (out / "extra.json").write_text(json.dumps(extra))
    root = str(Path(enginehooks.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(Path(script).resolve()), scenario, str(rank), str(world),
             str(port), str(out)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for log in logs:
            log.close()
    results = []
    for rank, p in enumerate(procs):
        f = out / f"rank{rank}.json"
        if p.returncode != 0 or not f.exists():
            tail = (out / f"rank{rank}.log").read_text(errors="replace")[-4000:]
            raise AssertionError(f"{scenario} rank {rank} exited {p.returncode}:\n{tail}")
        results.append(json.loads(f.read_text()))
    return results


def rank_main(scenarios: dict[str, Any]) -> None:
    """A rank's entry point (`script SCENARIO RANK WORLD PORT OUT`): joins a gloo group of
    WORLD ranks on loopback, runs `scenarios["scenario_" + SCENARIO](rank, extra, out)`
    and writes what it returns to `OUT/rank<r>.json` for `run_ranks`. Exits without the
    process group's teardown (a peer may be gone on purpose)."""
    import datetime

    import torch.distributed as dist

    scenario, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), Path(sys.argv[5])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    extra = json.loads((out / "extra.json").read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    res = scenarios[f"scenario_{scenario}"](rank, extra, out)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_modules(module: str, specs: list[dict[str, Any]], cwd: Path,
                timeout_s: float, logdir: Path | str | None = None,
                label: str = "") -> list[dict[str, Any]]:
    """Start `python -m module SPEC_JSON` once per spec, all at once, and return the JSON
    each printed as its last line of output; any still running past `timeout_s` gets
    SIGTERM (a rank with `faulthandler` registered prints its threads' stacks), then is
    killed, and the call fails with the tail of every rank's stderr.

    Each rank's stdout and stderr go to files, never pipes: a pipe read one rank at a time
    blocks the other ranks once they wrote 64 KiB of stderr, and a rank blocked in a
    write stalls its peers' collectives (a hang that looks like the transport's). The
    files live in a temporary folder; with `logdir` (default: env ENGINEHOOKS_GPU_LOGDIR)
    every rank's stderr is also copied, rank after rank, into one file there,
    `{label or module's last part}.log`, whatever the outcome."""
    import signal
    import tempfile

    where = logdir if logdir is not None else os.environ.get("ENGINEHOOKS_GPU_LOGDIR")
    tmp = tempfile.TemporaryDirectory(prefix="enginehooks-ranks-")
    folder = Path(tmp.name)
    stem = label or module.rsplit(".", 1)[-1]
    errs = [folder / f"{stem}-rank{i}.err" for i in range(len(specs))]
    outs = [folder / f"{stem}-rank{i}.out" for i in range(len(specs))]
    files = []
    procs = []
    try:
        for i, spec in enumerate(specs):
            fo, fe = open(outs[i], "w"), open(errs[i], "w")  # noqa: SIM115 - closed below
            files += [fo, fe]
            procs.append(subprocess.Popen([sys.executable, "-m", module, json.dumps(spec)],
                                          cwd=cwd, stdout=fo, stderr=fe, text=True))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)  # faulthandler: the stacks to stderr
            time.sleep(5)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in files:
            f.close()
        result = []
        bad = []
        for i in range(len(procs)):
            lines = outs[i].read_text(errors="replace").strip().splitlines()
            try:
                result.append(json.loads(lines[-1]))
            except (IndexError, ValueError):
                bad.append(i)
        if timed_out or bad:
            tails = "\n".join(
                f"--- rank {i} (exit {p.returncode}) stderr tail ---\n"
                + errs[i].read_text(errors="replace")[-6000:] for i, p in enumerate(procs))
            raise AssertionError(
                f"{module}: {'timed out after ' + str(timeout_s) + ' s' if timed_out else ''}"
                f"{' ' if timed_out and bad else ''}"
                f"{'ranks ' + str(bad) + ' printed no result' if bad else ''}\n{tails}")
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
        if where:
            Path(where).mkdir(parents=True, exist_ok=True)
            with open(Path(where) / f"{stem}.log", "w") as log:
                for i, p in enumerate(procs):
                    log.write(f"=== rank {i} (exit {p.returncode}) stderr ===\n"
                              + (errs[i].read_text(errors="replace") if errs[i].exists()
                                 else "") + "\n")
        tmp.cleanup()


_T0 = time.monotonic()


def progress(what: str) -> None:
    """A timestamped progress line on stderr, flushed (a rank's log says how far it got)."""
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    print(f"[{stamp} +{time.monotonic() - _T0:.1f}s pid {os.getpid()}] {what}",
          file=sys.stderr, flush=True)


def spec_main(main: Any) -> None:
    """The `__main__` of a `run_modules` rank: `main(spec)` on the JSON spec in argv[1],
    its result (or the error, with the traceback on stderr) printed as the last line."""
    import faulthandler
    import signal
    import traceback

    spec = json.loads(sys.argv[1])
    # a stuck rank says where: SIGTERM (run_modules' at its deadline) or the spec's own
    # "deadline_s" prints every thread's stack to stderr (the latter then exits)
    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, all_threads=True)
    if spec.get("deadline_s"):
        faulthandler.dump_traceback_later(float(spec["deadline_s"]), exit=True)
    fast = False
    try:
        result = main(spec)
        # a rank whose group broke says so: it exits at once, skipping teardowns that
        # would wait on its peers (a process group's destructor)
        fast = isinstance(result, dict) and bool(result.pop("_exit_now", False))
    except Exception as err:
        traceback.print_exc()
        result = {"error": str(err), "type": type(err).__name__}
        fast = True
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(result), flush=True)
    if fast:
        sys.stderr.flush()
        os._exit(0)

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
                timeout_s: float) -> list[dict[str, Any]]:
    """Start `python -m module SPEC_JSON` once per spec, all at once, and return the JSON
    each printed as its last line of output (failing with the tail of the stderr of the
    first that printed nothing); any still running past `timeout_s` is killed."""
    procs = [subprocess.Popen([sys.executable, "-m", module, json.dumps(spec)], cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for spec in specs]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout_s)
            lines = stdout.strip().splitlines()
            assert lines, stderr[-3000:]
            out.append(json.loads(lines[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def spec_main(main: Any) -> None:
    """The `__main__` of a `run_modules` rank: `main(spec)` on the JSON spec in argv[1],
    its result (or the error, with the traceback on stderr) printed as the last line."""
    import traceback

    spec = json.loads(sys.argv[1])
    try:
        result = main(spec)
    except Exception as err:
        traceback.print_exc()
        result = {"error": str(err), "type": type(err).__name__}
    print(json.dumps(result), flush=True)

"""Trainer and engines on different hosts: network namespaces on this machine
(`enginehooks_testkit.netns`), made and always torn down by these fixtures. The trainer
runs in host "trainer" (10.78.0.1), the engine in host "engine" (10.78.0.2); this test
process stays on the machine's own network and talks to both through pipes and files.
Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from enginehooks_testkit.netns import Host, Network, unavailable_reason
from enginehooks_testkit.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TRAINER, ENGINE = "trainer", "engine"


class Lines:
    """A child's stdout, line by line, read on a thread: every read has a deadline."""

    def __init__(self, stream: IO[str], what: str) -> None:
        self.what = what
        self.q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.q.put(line)
        self.q.put(None)

    def json(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.what} said nothing within {timeout_s}s") from None
            if line is None:
                raise RuntimeError(f"{self.what} exited")
            if line.startswith("{"):
                return json.loads(line)  # type: ignore[no-any-return]


class TrainerProcess:
    """`tests/multihost/trainer.py` running in the trainer's namespace."""

    def __init__(self, host: Host, spec: dict[str, Any], log: Path) -> None:
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = host.popen([sys.executable, "-m", "tests.multihost.trainer", json.dumps(spec)],
                               cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=self.log, text=True)
        self.lines = Lines(self.proc.stdout, "the trainer")  # type: ignore[arg-type]
        self.lines.json(120.0)  # ready

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> dict[str, Any]:
        return self.lines.json(timeout_s)

    def call(self, cmd: dict[str, Any], timeout_s: float = 180.0) -> dict[str, Any]:
        self.send(cmd)
        return self.answer(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="session")
def netns_ok() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def net(netns_ok: None) -> Iterator[Network]:
    with Network([TRAINER, ENGINE]) as network:
        yield network


@pytest.fixture(scope="session")
def module_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama large enough (about 10 MB in float32) that a push over a shaped link
    takes seconds, so a fault can land in the middle of it."""
    return make_tiny_model(tmp_path_factory.mktemp("multihost") / "llama-10mb",
                           hidden_size=256, layers=4, seed=3)


class ModuleReplica:
    """`tests/multihost/replica.py` serving on the engine host."""

    def __init__(self, host: Host, model: Path, folder: Path, port: int = 8100) -> None:
        self.state_file = folder / "replica-state.json"
        self.log = open(folder / "replica.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = host.popen(
            [sys.executable, "-m", "tests.multihost.replica", str(model), host.address,
             str(port), str(self.state_file)],
            cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True)
        self.url = Lines(self.proc.stdout, "the module replica").json(120.0)["ready"]  # type: ignore[arg-type]
        self.name = f"module-replica@{host.address}"

    def state(self) -> dict[str, Any]:
        from tests.multihost.replica import read_state

        return read_state(self.state_file) or {}

    def wait_state(self, pred: Any, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.state()
            if pred(s):
                return s
            time.sleep(0.05)  # polling a file the replica writes, bounded above
        raise TimeoutError(f"replica never {what} within {timeout_s}s: {self.state()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def module_replica(net: Network, module_model: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleReplica]:
    rep = ModuleReplica(net.hosts[ENGINE], module_model, tmp_path_factory.mktemp("replica"))
    try:
        yield rep
    finally:
        rep.close()

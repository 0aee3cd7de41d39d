"""A real engine server started as a child process: the shared part of the vLLM and
SGLang launchers (for the demo, tests and local experiments).

Each server runs in its own process group, so a test can SIGSTOP / SIGCONT all of it
and `stop()` leaves nothing behind; readiness is a bounded probe of `/health`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineServerProcess:
    """`argv` started with `env`, logging to `log`, answering on `url`."""

    kind = "server"

    def __init__(self, argv: list[str], env: dict[str, str], log: str | Path, url: str) -> None:
        self.url = url
        self.log: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}; see "
                                   f"{self.log.name}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)  # readiness probe of a process we started, bounded above
        raise TimeoutError(f"{self.kind} not ready in {timeout_s}s; see {self.log.name}")

    def __enter__(self) -> EngineServerProcess:
        """`with Server(...) as srv:` waits until it is ready and always stops it."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self.log.close()

"""Start a real vLLM OpenAI server process with the enginehooks worker extension.

For the demo, tests and local experiments; production users start vLLM their own way
with `--worker-extension-cls enginehooks.vllm_ext.WorkerExtension` and
`VLLM_SERVER_DEV_MODE=1`. Binds to loopback: dev-mode routes are unauthenticated.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

from enginehooks.http import request_json

EXTENSION = "enginehooks.vllm_ext.WorkerExtension"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VLLMServerProcess:
    """`python -m vllm.entrypoints.launchers.api_server.entry` in its own process group."""

    def __init__(self, model: str | Path, log: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, dtype: str = "float32", max_model_len: int = 256,
                 python: str = sys.executable, extra_args: list[str] | None = None) -> None:
        self.model = str(model)
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.log: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.launchers.api_server.entry",
             "--model", self.model, "--host", host, "--port", str(self.port),
             "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
             "--worker-extension-cls", EXTENSION, *(extra_args or [])],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)  # readiness probe of a process we started, bounded above
        raise TimeoutError(f"vLLM server not ready in {timeout_s}s; see {self.log.name}")

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        out = []
        for p in prompts:
            body = {"model": self.model, "prompt": p, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            r = request_json(f"{self.url}/v1/completions", body, timeout_s=60, who=self.url)
            out.append(list(r["choices"][0]["token_ids"]))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self.log.close()

"""Start a real SGLang HTTP server process (`python -m sglang.launch_server`).

For the demo, tests and local experiments; production users start SGLang their own way
(the plugin loads by itself wherever enginehooks is installed). Binds to loopback: the
plugin's `/enginehooks/rpc` route, like SGLang's admin routes, is open unless the server
runs with an API key.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from enginehooks.http import request_json
from enginehooks.vllm_ext.server import free_port

#: The test-only `sgl_kernel` stand-in in a source checkout (no CPU build of SGLang's
#: kernel package exists; SGLang's CPU engine imports it but, on the paths used here,
#: never calls it: the stand-in raises if it ever does).
STUB_DIR = Path(__file__).resolve().parents[2] / "tests" / "support" / "sgl_kernel_stub"


def cpu_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for SGLang on a machine without a GPU: the CPU engine, and the
    `sgl_kernel` stand-in on PYTHONPATH when the real kernels cannot be imported."""
    env = dict(os.environ if env is None else env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    if STUB_DIR.is_dir() and not _kernels_importable():
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(STUB_DIR) not in parts:
            env["PYTHONPATH"] = os.pathsep.join([str(STUB_DIR), *parts])
    return env


def _kernels_importable() -> bool:
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        import sgl_kernel  # noqa: F401
    except Exception:  # a CUDA build fails in many ways without a GPU
        return False
    return True


class SGLangServerProcess:
    """`python -m sglang.launch_server` on CPU, in its own process group."""

    def __init__(self, model: str | Path, log: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, dtype: str = "float32",
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.model = str(model)
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [python, "-m", "sglang.launch_server", "--model-path", self.model,
             "--host", host, "--port", str(self.port), "--device", "cpu", "--dtype", dtype,
             "--attention-backend", "torch_native", "--mem-fraction-static", "0.05",
             "--max-total-tokens", "4096", "--log-level", "warning", "--random-seed", "0",
             *(extra_args or [])],
            env=cpu_env(env), stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode}; see "
                                   f"{self.log.name}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)  # readiness probe of a process we started, bounded above
        raise TimeoutError(f"SGLang server not ready in {timeout_s}s; see {self.log.name}")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        sp = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        return [request_json(f"{self.url}/generate", {"input_ids": p, "sampling_params": sp},
                             timeout_s=60, who=self.url) for p in prompts]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [list(o["output_ids"]) for o in self.generate(prompts, max_tokens)]

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

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

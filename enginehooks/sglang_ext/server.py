"""Start a real SGLang HTTP server process (`python -m sglang.launch_server`).

For the demo, tests and local experiments; production users start SGLang their own way
(the plugin loads by itself wherever enginehooks is installed). Binds to loopback: the
plugin's `/enginehooks/rpc` route, like SGLang's admin routes, is open unless the server
runs with an API key.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from enginehooks.http import request_json
from enginehooks.serverproc import EngineServerProcess, free_port

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


class SGLangServerProcess(EngineServerProcess):
    """`python -m sglang.launch_server` on CPU, in its own process group."""

    kind = "SGLang server"

    def __init__(self, model: str | Path, log: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, dtype: str = "float32",
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.model = str(model)
        self.port = port or free_port(host)
        super().__init__(
            [python, "-m", "sglang.launch_server", "--model-path", self.model,
             "--host", host, "--port", str(self.port), "--device", "cpu", "--dtype", dtype,
             "--attention-backend", "torch_native", "--mem-fraction-static", "0.05",
             "--max-total-tokens", "4096", "--log-level", "warning", "--random-seed", "0",
             *(extra_args or [])],
            cpu_env(env), log, f"http://{host}:{self.port}",
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
        sp = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        return [request_json(f"{self.url}/generate", {"input_ids": p, "sampling_params": sp},
                             timeout_s=60, who=self.url) for p in prompts]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [list(o["output_ids"]) for o in self.generate(prompts, max_tokens)]

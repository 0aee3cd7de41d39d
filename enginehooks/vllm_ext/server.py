"""Start a real vLLM OpenAI server process with the enginehooks worker extension.

For the demo, tests and local experiments; production users start vLLM their own way
with `--worker-extension-cls enginehooks.vllm_ext.WorkerExtension` and
`VLLM_SERVER_DEV_MODE=1`. Binds to loopback: dev-mode routes are unauthenticated.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from enginehooks.http import request_json
from enginehooks.serverproc import EngineServerProcess, free_port

EXTENSION = "enginehooks.vllm_ext.WorkerExtension"


class VLLMServerProcess(EngineServerProcess):
    """`python -m vllm.entrypoints.launchers.api_server.entry` with the extension, in
    dev mode. `python` may be another environment's interpreter (vLLM pins its torch)."""

    kind = "vLLM server"

    def __init__(self, model: str | Path, log: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, dtype: str = "float32", max_model_len: int = 256,
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.model = str(model)
        self.port = port or free_port(host)
        env = dict(os.environ if env is None else env)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        super().__init__(
            [python, "-m", "vllm.entrypoints.launchers.api_server.entry",
             "--model", self.model, "--host", host, "--port", str(self.port),
             "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
             "--worker-extension-cls", EXTENSION, *(extra_args or [])],
            env, log, f"http://{host}:{self.port}",
        )

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        out = []
        for p in prompts:
            body = {"model": self.model, "prompt": p, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            r = request_json(f"{self.url}/v1/completions", body, timeout_s=60, who=self.url)
            out.append(list(r["choices"][0]["token_ids"]))
        return out

"""Shared fixtures. Engine tests start the real vLLM CPU engine on tiny models built
here (no model hub is reachable); see shared/reference/engines-on-cpu.md."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: fast start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [[5, 6, 7, 8], [10, 11, 12], [40, 41, 42, 43, 44, 45]]
NEW_TOKENS = 8
EXTENSION = "enginehooks.vllm_ext.WorkerExtension"


def have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


requires_vllm = pytest.mark.skipif(not have("vllm"), reason="vLLM is not installed here")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints: a Llama (untied) and a Qwen2 with qkv bias and tied embeddings."""
    from enginehooks.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_tiny_model(root / "llama", arch="llama", seed=0),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", tie_word_embeddings=True, seed=1),
    }


def load_hf(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def perturb(model: Any, seed: int, scale: float = 0.3) -> Any:
    """'Train' the model: a reproducible change to every weight."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def start_llm(path: Path, dtype: str = "float32") -> Any:
    from vllm import LLM

    return LLM(model=str(path), dtype=dtype, worker_extension_cls=EXTENSION, max_model_len=256,
               enforce_eager=True, seed=0, enable_prefix_caching=True)


def llm_greedy(llm: Any, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="session")
def llms(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """One in-process vLLM per tiny model, shared by the session (each test pushes the
    weights it then checks, so order does not matter)."""
    if not have("vllm"):
        pytest.skip("vLLM is not installed here")
    return {name: start_llm(path) for name, path in model_dirs.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServerProcess:
    """A real `vllm` OpenAI server process in dev mode, on loopback."""

    def __init__(self, model: Path, log: Path) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
             "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
             "--worker-extension-cls", EXTENSION],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)  # readiness probe of a process we started; bounded above
        raise TimeoutError(f"vLLM server not ready in {timeout_s}s; see {self.log.name}")

    def greedy(self, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
        from enginehooks.http import request_json

        out = []
        for p in prompts:
            body = {"model": str(self.model), "prompt": p, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            r = request_json(f"{self.url}/v1/completions", body, timeout_s=60)
            out.append(r["choices"][0]["token_ids"])
        return out

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="session")
def vllm_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[VLLMServerProcess]:
    if not have("vllm"):
        pytest.skip("vLLM is not installed here")
    srv = VLLMServerProcess(model_dirs["llama"], tmp_path_factory.mktemp("logs") / "vllm.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()

"""Fixtures for the SGLang tests: the real SGLang 0.5.23 on CPU, in-process and as an HTTP
server, on tiny models built here (no model hub is reachable).

Run in the SGLang environment (`scripts/run.sh sglang python -m pytest tests/sglang`).
SGLang spawns its scheduler processes, which inherit the environment set below; the
test-only `sgl_kernel` stand-in must be importable there too (it raises if any kernel is
ever called, so a real kernel dependency fails a test instead of passing silently).
Engines start in 20-40 s each, so they are shared by the session: every test pushes
the weights it then checks, so order does not matter.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "tests" / "support" / "sgl_kernel_stub"

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["SGLANG_PLUGINS"] = "enginehooks"  # only our plugin: no third-party hooks
_pp = os.environ.get("PYTHONPATH", "")
if str(STUB) not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUB), _pp) if p)
if str(STUB) not in sys.path:
    sys.path.insert(0, str(STUB))

PROMPTS = [[5, 6, 7, 8], [10, 11, 12], [40, 41, 42, 43, 44, 45]]
NEW_TOKENS = 8
SAMPLING = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", attention_backend="torch_native", mem_fraction_static=0.05,
    max_total_tokens=4096, log_level="error", random_seed=0,
)
VLLM_PYTHON = Path.home() / ".cache" / "enginehooks" / "venv-vllm" / "bin" / "python"


def have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if not have("sglang"):
    pytest.skip("SGLang is not installed here (run in the SGLang environment)",
                allow_module_level=True)


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


def hf_reference(model: Any) -> list[list[int]]:
    from enginehooks.tiny import hf_greedy

    return hf_greedy(model, PROMPTS, NEW_TOKENS)


def engine_generate(engine: Any, prompts: list[list[int]] = PROMPTS) -> list[dict[str, Any]]:
    return engine.generate(input_ids=prompts, sampling_params=dict(SAMPLING))


def engine_greedy(engine: Any) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of every prompt, and the weight versions that produced them."""
    outs = engine_generate(engine)
    return [o["output_ids"] for o in outs], {o["meta_info"]["weight_version"] for o in outs}


@pytest.fixture(scope="module")
def engines(model_dirs: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """One in-process `sglang.Engine` per tiny model, for one test module: idle SGLang
    schedulers still cost CPU, and this machine has two cores."""
    import sglang

    started: dict[str, Any] = {}
    try:
        for name, path in model_dirs.items():
            started[name] = sglang.Engine(model_path=str(path), **ENGINE_ARGS)
        yield started
    finally:
        for e in started.values():
            e.shutdown()


#: Files in the order they run: those that start their own engines first, then the
#: in-process engines (module-scoped), then the shared server (also used by the mixed
#: test), so at most two engines ever run at once on this 2-core machine.
FILE_ORDER = ["test_plugin_and_demo.py", "test_engine.py", "test_server.py", "test_mixed.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def key(item: pytest.Item) -> int:
        name = Path(str(item.fspath)).name
        return FILE_ORDER.index(name) if name in FILE_ORDER else len(FILE_ORDER)

    items.sort(key=key)  # stable: order inside a file is kept


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process of ours on loopback, in its own process group (so a test can
    SIGSTOP / SIGCONT all of it, and stop() leaves nothing behind)."""

    kind = "server"

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}; see "
                                   f"{self.log.name}:\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)  # readiness probe of a process we started; bounded above
        raise TimeoutError(f"{self.kind} not ready in {timeout_s}s; see {self.log.name}")

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


class SGLangServerProcess(ServerProcess):
    kind = "SGLang server"

    def __init__(self, model: Path, log: Path) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                "--dtype", "float32", "--attention-backend", "torch_native",
                "--mem-fraction-static", "0.05", "--max-total-tokens", "4096",
                "--log-level", "warning", "--random-seed", "0"]
        super().__init__(argv, dict(os.environ), log, port)

    def generate(self, prompts: list[list[int]] = PROMPTS) -> list[dict[str, Any]]:
        from enginehooks.http import request_json

        return [request_json(f"{self.url}/generate",
                             {"input_ids": p, "sampling_params": dict(SAMPLING)}, timeout_s=60)
                for p in prompts]

    def greedy(self) -> tuple[list[list[int]], set[str]]:
        outs = self.generate()
        return [o["output_ids"] for o in outs], {o["meta_info"]["weight_version"] for o in outs}


class VLLMServerProcess(ServerProcess):
    """A real vLLM server from the vLLM environment (vLLM and SGLang pin different torch
    builds and cannot share one), with the enginehooks worker extension, in dev mode."""

    kind = "vLLM server"

    def __init__(self, model: Path, log: Path) -> None:
        port = free_port()
        self.model = model
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SGLANG_", "PYTHONPATH", "VIRTUAL_ENV"))}
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
                   VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   PATH=f"{VLLM_PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.launchers.api_server.entry",
                "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
                "--worker-extension-cls", "enginehooks.vllm_ext.WorkerExtension"]
        super().__init__(argv, env, log, port)

    def greedy(self) -> list[list[int]]:
        from enginehooks.http import request_json

        out = []
        for p in PROMPTS:
            body = {"model": str(self.model), "prompt": p, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            r = request_json(f"{self.url}/v1/completions", body, timeout_s=60)
            out.append(r["choices"][0]["token_ids"])
        return out


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def sglang_server(model_dirs: dict[str, Path], logs_dir: Path) -> Iterator[SGLangServerProcess]:
    srv = SGLangServerProcess(model_dirs["llama"], logs_dir / "sglang-server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()

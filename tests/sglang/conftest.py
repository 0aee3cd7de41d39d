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
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks.sglang_ext.server import SGLangServerProcess as _SGLangServer
from enginehooks.tiny import load_tiny as load_hf  # noqa: F401 - re-exported to tests
from enginehooks.tiny import perturb  # noqa: F401 - re-exported to tests
from enginehooks.vllm_ext.server import VLLMServerProcess as _VLLMServer

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
# scripts/test.sh exports the vLLM environment's interpreter (built by setup-vllm-env.sh).
VLLM_PYTHON = Path(os.environ.get(
    "ENGINEHOOKS_VLLM_PYTHON",
    Path(os.environ.get("ENGINEHOOKS_CACHE", Path.home() / ".cache" / "enginehooks"))
    / "venv-vllm" / "bin" / "python"))


def have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if not have("sglang"):
    pytest.skip("SGLang is not installed here (run in the SGLang environment)",
                allow_module_level=True)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints: a Llama (untied) and a Qwen2 with qkv bias and tied embeddings."""
    from enginehooks.tiny import make_test_models

    return make_test_models(tmp_path_factory.mktemp("models"))


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


class SGLangServerProcess(_SGLangServer):
    """The library's launcher, answering with the test prompts (and served versions)."""

    def generate(self, prompts: list[list[int]] = PROMPTS,  # type: ignore[override]
                 max_tokens: int = NEW_TOKENS) -> list[dict[str, Any]]:
        return super().generate(prompts, max_tokens)

    def greedy(self) -> tuple[list[list[int]], set[str]]:  # type: ignore[override]
        outs = self.generate()
        return [o["output_ids"] for o in outs], {o["meta_info"]["weight_version"] for o in outs}


class VLLMServerProcess(_VLLMServer):
    """A real vLLM server from the vLLM environment (vLLM and SGLang pin different torch
    builds and cannot share one), with the enginehooks worker extension, in dev mode."""

    def __init__(self, model: Path, log: Path) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SGLANG_", "PYTHONPATH", "VIRTUAL_ENV"))}
        env.update(HF_HUB_OFFLINE="1",
                   PATH=f"{VLLM_PYTHON.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        super().__init__(model, log, python=str(VLLM_PYTHON), env=env)

    def greedy(self) -> list[list[int]]:  # type: ignore[override]
        return super().greedy(PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def sglang_server(model_dirs: dict[str, Path], logs_dir: Path) -> Iterator[SGLangServerProcess]:
    with SGLangServerProcess(model_dirs["llama"], logs_dir / "sglang-server.log") as srv:
        yield srv

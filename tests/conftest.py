"""Shared fixtures. Engine tests start the real vLLM CPU engine on tiny models built
here (no model hub is reachable); see shared/reference/engines-on-cpu.md."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks.tiny import load_tiny as load_hf  # noqa: F401 - re-exported to tests
from enginehooks.tiny import perturb  # noqa: F401 - re-exported to tests
from enginehooks.vllm_ext.server import VLLMServerProcess as _VLLMServer

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
    from enginehooks.tiny import make_test_models

    return make_test_models(tmp_path_factory.mktemp("models"))


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


class VLLMServerProcess(_VLLMServer):
    """The library's launcher, answering with the test prompts."""

    def greedy(self, prompts: list[list[int]] = PROMPTS,  # type: ignore[override]
               max_tokens: int = NEW_TOKENS) -> list[list[int]]:
        return super().greedy(prompts, max_tokens)


@pytest.fixture(scope="session")
def vllm_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[VLLMServerProcess]:
    if not have("vllm"):
        pytest.skip("vLLM is not installed here")
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    with VLLMServerProcess(model_dirs["llama"], log) as srv:
        yield srv

"""Real engines started in this process, behind one small driver interface, for the
replica-contract suite, the conformance matrix and benchmarks on CPU.

A driver starts an engine from a checkpoint folder with the enginehooks plugin loaded,
generates greedily with the logprob of every chosen token (what the exact oracle
compares), hands out an `EngineHandle` for `WeightSync`, and shuts the engine down.
Engines that cannot start here raise `EngineUnavailable` with the engine's own error
and version, so a suite can list them instead of skipping them silently.
"""

from __future__ import annotations

import gc
import importlib.metadata
import multiprocessing
import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from enginehooks.control.handles import EngineHandle

#: Prompts (token ids) and length of every greedy comparison.
PROMPTS: list[list[int]] = [[5, 6, 7, 8], [10, 11, 12], [40, 41, 42, 43, 44, 45]]
NEW_TOKENS = 8


class EngineUnavailable(RuntimeError):
    """The engine cannot run this model here; the message carries the engine's error."""


@dataclass(frozen=True)
class Generation:
    """Greedy tokens of one prompt, the logprob of each, and the weight version the
    engine says produced them (None where the engine does not say)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: str | None = None


def first_difference(a: Sequence[Generation], b: Sequence[Generation]) -> str | None:
    """Where two runs differ (tokens, then logprobs, exactly), or None if they are equal."""
    if len(a) != len(b):
        return f"{len(a)} generations vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.tokens != y.tokens:
            return f"prompt {i}: tokens {list(x.tokens)} vs {list(y.tokens)}"
        for j, (p, q) in enumerate(zip(x.logprobs, y.logprobs)):
            if p != q:
                return f"prompt {i} token {j}: logprob {p!r} vs {q!r}"
    return None


def version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class RunningEngine(ABC):
    """One engine instance in this process."""

    engine: ClassVar[str]

    @abstractmethod
    def handle(self, name: str | None = None) -> EngineHandle:
        """A trainer-side handle to this engine."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]] = PROMPTS,
                 max_tokens: int = NEW_TOKENS) -> list[Generation]:
        """Greedy generation with the logprob of every chosen token."""

    @abstractmethod
    def close(self) -> None:
        """Shut the engine down and free its memory."""

    def __enter__(self) -> RunningEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- vLLM ----------------------------------------------------------------------------------
class VLLMInProcess(RunningEngine):
    """`vllm.LLM` with the enginehooks worker extension, engine core in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here if unset: a 2-3 s start)."""

    engine = "vllm"

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32",
                 engine_args: dict[str, Any] | None = None) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineUnavailable(f"vLLM is not installed here: {e}") from e
        try:
            self.llm = LLM(model=str(model_dir), dtype=dtype,
                           worker_extension_cls="enginehooks.vllm_ext.WorkerExtension",
                           max_model_len=256, enforce_eager=True, seed=0,
                           enable_prefix_caching=True, **(engine_args or {}))
        except Exception as e:
            raise EngineUnavailable(f"vllm {version_of('vllm-cpu')} cannot start "
                                    f"{model_dir}: {type(e).__name__}: {e}") from e

    def handle(self, name: str | None = None) -> EngineHandle:
        from enginehooks.vllm_ext import VLLMEngine

        return VLLMEngine(self.llm, name=name or "vllm")

    def generate(self, prompts: Sequence[Sequence[int]] = PROMPTS,
                 max_tokens: int = NEW_TOKENS) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            gens.append(Generation(tuple(c.token_ids),
                                   tuple(step[t].logprob for t, step in zip(c.token_ids, c.logprobs))))
        return gens

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # already down
            pass
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:
            pass


# -- SGLang --------------------------------------------------------------------------------
SGLANG_ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", attention_backend="torch_native", mem_fraction_static=0.05,
    max_total_tokens=4096, log_level="error", random_seed=0,
)


class SGLangInProcess(RunningEngine):
    """`sglang.Engine` on CPU (its scheduler runs in a child process; the enginehooks
    plugin loads there by itself). Started under a deadline: when SGLang's child dies
    during start-up, its parent can wait forever."""

    engine = "sglang"

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32",
                 engine_args: dict[str, Any] | None = None, start_timeout_s: float = 240.0) -> None:
        from enginehooks.testing.servers import cpu_env

        # SGLang's CPU engine, and the sgl_kernel stand-in where no kernels import:
        # in this process's path and in the environment its children inherit.
        os.environ.update(cpu_env())
        os.environ.setdefault("SGLANG_PLUGINS", "enginehooks")
        for p in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if p and p not in sys.path:
                sys.path.insert(0, p)
        try:
            import sglang
        except ImportError as e:
            raise EngineUnavailable(f"SGLang is not installed here: {e}") from e
        box: dict[str, Any] = {}

        def start() -> None:
            try:
                box["engine"] = sglang.Engine(model_path=str(model_dir), dtype=dtype,
                                              **{**SGLANG_ENGINE_ARGS, **(engine_args or {})})
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=start, name="enginehooks-sglang-start", daemon=True)
        t.start()
        t.join(start_timeout_s)
        if "engine" not in box:
            for child in multiprocessing.active_children():
                child.kill()
            err = box.get("error")
            raise EngineUnavailable(
                f"sglang {version_of('sglang')} cannot start {model_dir}: "
                + (f"{type(err).__name__}: {err}" if err else f"no engine within {start_timeout_s}s"))
        self.engine_obj = box["engine"]

    def handle(self, name: str | None = None) -> EngineHandle:
        from enginehooks.sglang_ext import SGLangEngine

        return SGLangEngine(self.engine_obj, name=name or "sglang")

    def generate(self, prompts: Sequence[Sequence[int]] = PROMPTS,
                 max_tokens: int = NEW_TOKENS) -> list[Generation]:
        sp = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        outs = self.engine_obj.generate(input_ids=[list(p) for p in prompts], sampling_params=sp,
                                        return_logprob=True)
        gens = []
        for o in outs:
            lps = o["meta_info"]["output_token_logprobs"]
            gens.append(Generation(tuple(o["output_ids"]), tuple(float(lp[0]) for lp in lps),
                                   str(o["meta_info"].get("weight_version"))))
        return gens

    def close(self) -> None:
        eng, self.engine_obj = getattr(self, "engine_obj", None), None
        if eng is not None:
            eng.shutdown()
        gc.collect()


# -- a torch module ---------------------------------------------------------------------
class LocalModule(RunningEngine):
    """A Hugging Face model in this process behind `LocalEngine`: the replica contract
    without an inference engine (greedy generation by transformers)."""

    engine = "local"

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32",
                 engine_args: dict[str, Any] | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.eval()

    def handle(self, name: str | None = None) -> EngineHandle:
        from enginehooks.engine.local import LocalEngine

        if getattr(self, "_handle", None) is None:
            self._handle = LocalEngine(self.model, name=name or "local")
        return self._handle

    def generate(self, prompts: Sequence[Sequence[int]] = PROMPTS,
                 max_tokens: int = NEW_TOKENS) -> list[Generation]:
        import torch

        gens = []
        with torch.no_grad():
            for ids in prompts:
                x = torch.tensor([list(ids)])
                out = self.model.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                    output_scores=True, return_dict_in_generate=True)
                tokens = out.sequences[0, len(ids):].tolist()
                lps = [float(torch.log_softmax(s[0].float(), -1)[t])
                       for s, t in zip(out.scores, tokens)]
                gens.append(Generation(tuple(tokens), tuple(lps)))
        return gens

    def close(self) -> None:
        self.model = None
        gc.collect()


DRIVERS: dict[str, type[RunningEngine]] = {
    "vllm": VLLMInProcess, "sglang": SGLangInProcess, "local": LocalModule,
}


def start_engine(engine: str, model_dir: str | Path, *, dtype: str = "float32",
                 engine_args: dict[str, Any] | None = None) -> RunningEngine:
    return DRIVERS[engine](model_dir, dtype=dtype, engine_args=engine_args)  # type: ignore[call-arg]

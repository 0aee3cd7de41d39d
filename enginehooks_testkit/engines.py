"""Real engines started in this process, behind one small driver interface, for the
replica-contract suite, the conformance matrix and benchmarks on CPU.

A driver starts an engine from a checkpoint folder with the enginehooks plugin loaded,
generates greedily with the logprob of every chosen token (what the exact oracle
compares), hands out an `EngineHandle` for `WeightSync`, and shuts the engine down.
Engines that cannot start here raise `EngineUnavailable` with the engine's own error
and version, so a suite can list them instead of skipping them silently.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from enginehooks.control.handles import EngineHandle
from enginehooks.sglang_ext.versions import answer_version
from enginehooks_testkit.generation import NEW_TOKENS, PROMPTS, Generation, first_difference

__all__ = ["NEW_TOKENS", "PROMPTS", "EngineUnavailable", "Generation", "RunningEngine",
           "first_difference", "fresh_generate", "fresh_generate_of", "hf_generate",
           "processor_files", "register_driver", "save_pushed", "start_engine"]

def synthetic_image(seed: int, side: int) -> Any:
    """A small RGB image drawn from `seed`, the same every time (a prompt
    `{"text": "... {image} ...", "image": seed, "side": side}` sends it)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB")


def _png_data_url(image: Any) -> str:
    """`image` as a `data:image/png;base64,...` URL (lossless: the engine decodes the
    same pixels)."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class EngineUnavailable(RuntimeError):
    """The engine cannot run this model here; the message carries the engine's error."""


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

        self.llm.reset_prefix_cache()  # cold cache, as the exact oracle compares
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        outs = self.llm.generate([self._prompt(p) if isinstance(p, dict)
                                  else TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 sp, use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            gens.append(Generation(tuple(c.token_ids),
                                   tuple(step[t].logprob for t, step in zip(c.token_ids, c.logprobs)),
                                   getattr(o, "enginehooks_weight_version", None)))
        return gens

    def _prompt(self, prompt: dict[str, Any]) -> Any:
        """A prompt with an image (`synthetic_image`): `{image}` in its text becomes the
        prompt's `placeholder`, or the model's own for one image, and the image is drawn
        from its seed."""
        placeholder = prompt.get("placeholder")
        if not placeholder:
            from vllm.model_executor.models.registry import ModelRegistry

            config = self.llm.llm_engine.model_config
            model_cls, _ = ModelRegistry.resolve_model_cls(config.architectures,
                                                           model_config=config)
            placeholder = model_cls.get_placeholder_str("image", 1)
        return {"prompt": prompt["text"].replace("{image}", placeholder),
                "multi_modal_data": {"image": synthetic_image(prompt["image"], prompt["side"])}}

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        with contextlib.suppress(Exception):  # already down
            llm.llm_engine.engine_core.shutdown()
        del llm  # the process's distributed state stays: other engines here share it
        gc.collect()


# -- SGLang --------------------------------------------------------------------------------
# SGLang on CPU checks that the model load used less than `mem_fraction_static` of the
# host's free memory, measured before and after: other processes allocating meanwhile
# count against it, so the fraction leaves room (max_total_tokens bounds the KV cache).
# `sleep_on_idle`: an idle SGLang scheduler otherwise polls its sockets in a busy loop,
# one core at 100% per engine; two engines kept for a test module took both cores of a
# CI machine from the engines the oracle starts beside them (a fresh start: 25 s on a
# quiet machine, 100-150 s beside them). It waits on the same sockets (our RPC socket
# included) with zmq's poller instead; generation and pushes are unchanged.
SGLANG_ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", attention_backend="torch_native", mem_fraction_static=0.2,
    max_total_tokens=4096, log_level="error", random_seed=0, sleep_on_idle=True,
)


def sglang_path_here() -> None:
    """PYTHONPATH's folders in this process's path too (where `cpu_env` put the
    `sgl_kernel` CPU stand-in for SGLang's children): SGLang's modules import here."""
    for p in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)


class SGLangInProcess(RunningEngine):
    """`sglang.Engine` on CPU (its scheduler runs in a child process; the enginehooks
    plugin loads there by itself). Started under a deadline: when SGLang's child dies
    during start-up, its parent can wait forever. When a child crashes, SGLang itself
    sends SIGQUIT to this process: start engines that might not run (the conformance
    matrix) in a child process (`fresh_generate`)."""

    engine = "sglang"

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32",
                 engine_args: dict[str, Any] | None = None, start_timeout_s: float = 240.0) -> None:
        from enginehooks_testkit.servers import cpu_env

        # SGLang's CPU engine, and the sgl_kernel stand-in where no kernels import:
        # in this process's path and in the environment its children inherit.
        os.environ.update(cpu_env())
        os.environ.setdefault("SGLANG_PLUGINS", "enginehooks")
        sglang_path_here()
        try:
            import sglang
        except ImportError as e:
            raise EngineUnavailable(f"SGLang is not installed here: {e}") from e
        # In the main thread (SGLang's engine installs signal handlers and kills
        # children started elsewhere), under an alarm: when a child dies during
        # start-up, SGLang's parent can otherwise wait forever.
        def expired(signum: int, frame: Any) -> None:
            raise TimeoutError(f"no SGLang engine within {start_timeout_s}s")

        use_alarm = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGALRM, expired) if use_alarm else None
        if use_alarm:
            signal.alarm(int(start_timeout_s))
        try:
            self.engine_obj = sglang.Engine(model_path=str(model_dir), dtype=dtype,
                                            **{**SGLANG_ENGINE_ARGS, **(engine_args or {})})
        except Exception as e:
            for child in multiprocessing.active_children():
                child.kill()
            raise EngineUnavailable(f"sglang {version_of('sglang')} cannot start {model_dir}: "
                                    f"{type(e).__name__}: {e}") from e
        finally:
            if use_alarm:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)

    def handle(self, name: str | None = None) -> EngineHandle:
        from enginehooks.sglang_ext import SGLangEngine

        return SGLangEngine(self.engine_obj, name=name or "sglang")

    def _generate(self, prompts: Sequence[Any], max_tokens: int) -> list[Generation]:
        """Token-id prompts in one batch; a prompt with an image (`synthetic_image`) as
        a request of its own: text with the image's placeholder (the prompt's, which
        SGLang's multimodal processor splits on) and the image as a PNG data URL."""
        sp = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        ids = [i for i, p in enumerate(prompts) if not isinstance(p, dict)]
        outs: list[Any] = [None] * len(prompts)
        if ids:
            batch = self.engine_obj.generate(input_ids=[list(prompts[i]) for i in ids],
                                             sampling_params=sp, return_logprob=True)
            for i, o in zip(ids, batch):
                outs[i] = o
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                if not p.get("placeholder"):
                    raise ValueError(f"an image prompt for SGLang needs its placeholder: {p}")
                outs[i] = self.engine_obj.generate(
                    prompt=p["text"].replace("{image}", p["placeholder"]),
                    image_data=_png_data_url(synthetic_image(p["image"], p["side"])),
                    sampling_params=sp, return_logprob=True)
        gens = []
        for o in outs:
            lps = o["meta_info"]["output_token_logprobs"]
            gens.append(Generation(tuple(o["output_ids"]), tuple(float(lp[0]) for lp in lps),
                                   answer_version(o["meta_info"])))
        return gens

    def close(self) -> None:
        eng, self.engine_obj = getattr(self, "engine_obj", None), None
        if eng is None:
            return
        # SGLang's watchdog thread SIGQUITs this process when one of its children
        # exits non-zero, which its own shutdown does (kill -9): ignore SIGQUIT until
        # the watchdog's next tick has passed.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGQUIT, signal.SIG_IGN) if main else None
        try:
            try:
                eng.shutdown()
            except AttributeError as e:
                # SGLang 0.5.23 kills its processes first and then shuts its multimodal
                # processor down, which raises for a wrapper processor (Llava's, for
                # LLaVA and Mistral 3) that never ran the base constructor
                # (docs/engine-bugs.md): the engine is down; say so and go on.
                warnings.warn(f"SGLang's shutdown raised after stopping the engine: {e!r}",
                              stacklevel=2)
                for child in multiprocessing.active_children():
                    child.kill()
            gc.collect()
            if main:
                time.sleep(2.5)  # the watchdog polls every second
        finally:
            if main:
                signal.signal(signal.SIGQUIT, previous)

    def generate(self, prompts: Sequence[Any] = PROMPTS,
                 max_tokens: int = NEW_TOKENS) -> list[Generation]:
        # From a cold prefix cache: a cached prefix takes another kernel path, whose
        # logprobs differ in the last bits; the exact oracle compares cold engines.
        self.engine_obj.flush_cache()
        return self._generate(prompts, max_tokens)


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
        from enginehooks.core.errors import EngineTorn

        side = self.handle().side  # type: ignore[attr-defined]
        refused = side.refusal()
        if refused is not None:  # a module replica fails closed like the engines
            raise EngineTorn(refused)
        state = side.public_state()
        label = (f"torn:{state['failed_version']}" if state["state"] == "torn"
                 else str(state["version"]))
        return hf_generate(self.model, prompts, max_tokens, label)

    def close(self) -> None:
        self.model = None
        gc.collect()


def hf_generate(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                label: str | None) -> list[Generation]:
    """Greedy generation by transformers with the logprob of every chosen token, each
    answer marked `label` (the weight version): how a torch module replica generates."""
    import torch

    gens = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([list(ids)])
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            lps = [float(torch.log_softmax(s[0].float(), -1)[t])
                   for s, t in zip(out.scores, tokens)]
            gens.append(Generation(tuple(tokens), tuple(lps), label))
    return gens


DRIVERS: dict[str, type[RunningEngine]] = {
    "vllm": VLLMInProcess, "sglang": SGLangInProcess, "local": LocalModule,
}


def register_driver(driver: type[RunningEngine]) -> None:
    """Add a driver under its `engine` name: an engine a test suite brings (the one
    written from docs/engines.md). Its module must be importable by name: the exact
    oracle starts it again in a child process (`fresh_generate`)."""
    DRIVERS[driver.engine] = driver


def start_engine(engine: str, model_dir: str | Path, *, dtype: str = "float32",
                 engine_args: dict[str, Any] | None = None) -> RunningEngine:
    return DRIVERS[engine](model_dir, dtype=dtype, engine_args=engine_args)  # type: ignore[call-arg]


#: what an engine loads beside the weights (tokenizer, image processor), which a model's
#: own `save_pretrained` does not write
PROCESSOR_FILES = ("tokenizer", "special_tokens", "preprocessor_config", "processor_config",
                   "video_preprocessor_config", "chat_template")


def processor_files(source: str | Path, folder: str | Path) -> None:
    """Copy `PROCESSOR_FILES` of checkpoint `source` into `folder`."""
    import shutil

    for f in Path(source).iterdir():
        if f.name.startswith(PROCESSOR_FILES):
            shutil.copy(f, Path(folder) / f.name)


def save_pushed(model: Any, source: str | Path, folder: str | Path) -> Path:
    """`model` (what a trainer pushed) as a checkpoint an engine starts from: its
    `save_pretrained` in `folder`, with the processor files of checkpoint `source`."""
    folder = Path(folder)
    model.save_pretrained(folder)
    processor_files(source, folder)
    return folder


def fresh_generate_of(engine: str, model: Any, source: str | Path, folder: str | Path, *,
                      dtype: str = "float32") -> list[Generation]:
    """`fresh_generate` of `model` saved as `save_pushed` saves it (the exact oracle)."""
    return fresh_generate(engine, save_pushed(model, source, folder), dtype=dtype)


def fresh_generate(engine: str, model_dir: str | Path, *, dtype: str = "float32",
                   engine_args: dict[str, Any] | None = None,
                   prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = NEW_TOKENS,
                   timeout_s: float = 300.0) -> list[Generation]:
    """Greedy outputs of `engine` freshly started from `model_dir`, in a child process:
    the exact oracle's reference. (Engines in one process share global state, e.g.
    vLLM's distributed groups, so a second engine shut down there breaks the first.)"""
    import json
    import subprocess

    driver = DRIVERS[engine]
    request = json.dumps({"engine": engine, "driver": f"{driver.__module__}:{driver.__qualname__}",
                          "model_dir": str(model_dir), "dtype": dtype,
                          "engine_args": engine_args or {},
                          "prompts": [p if isinstance(p, dict) else list(p) for p in prompts],
                          "max_tokens": max_tokens})
    try:
        out = subprocess.run([sys.executable, "-m", "enginehooks_testkit.engines"], input=request,
                             capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise EngineUnavailable(f"{engine} on {model_dir}: no answer within {timeout_s}s") from e
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    reply = json.loads(lines[-1]) if lines else {"error": out.stderr[-3000:]}
    if "error" in reply:
        raise EngineUnavailable(reply["error"])
    return [Generation(tuple(g["tokens"]), tuple(g["logprobs"]), g["version"])
            for g in reply["generations"]]


def _serve_one_request() -> None:
    """`python -m enginehooks_testkit.engines`: read one JSON request on stdin, start the
    engine, print its generations as one JSON line (floats round-trip exactly)."""
    import importlib
    import json

    req = json.loads(sys.stdin.read())
    try:
        if req["engine"] not in DRIVERS:  # a driver registered by the parent's suite
            module, _, qualname = req["driver"].partition(":")
            register_driver(getattr(importlib.import_module(module), qualname))
        with start_engine(req["engine"], req["model_dir"], dtype=req["dtype"],
                          engine_args=req["engine_args"]) as running:
            gens = running.generate(req["prompts"], req["max_tokens"])
        print(json.dumps({"generations": [
            {"tokens": list(g.tokens), "logprobs": list(g.logprobs), "version": g.version}
            for g in gens]}), flush=True)
    except EngineUnavailable as e:
        print(json.dumps({"error": str(e)}), flush=True)
    os._exit(0)  # engines may leave non-daemon threads behind


if __name__ == "__main__":
    _serve_one_request()

"""Ray actor classes that hold an engine and answer `RayEngine`.

These are plain classes: make them actors with `ray.remote(...)(VLLMActor)` and your
own resources. An RL framework with its own actor class adds `EngineActorMixin` to it
and returns its engine's in-process handle from `enginehooks_handle()`:

    class Rollout(EngineActorMixin):          # the framework's actor
        def __init__(self, ...):
            self.llm = vllm.LLM(..., worker_extension_cls=
                                "enginehooks.vllm_ext.WorkerExtension")
        def enginehooks_handle(self):
            return VLLMEngine(self.llm)

Engines read their environment when they start: set variables such as
`VLLM_ENABLE_V1_MULTIPROCESSING` or SGLang's `SGLANG_USE_CPU_ENGINE` in the actor's
`runtime_env`, not in the trainer.
"""

from __future__ import annotations

from typing import Any

from enginehooks import wire
from enginehooks.control.handles import EngineHandle
from enginehooks.core.errors import ConfigError
from enginehooks.ray_ext.calls import OPERATIONS

EXTENSION = "enginehooks.vllm_ext.WorkerExtension"


class EngineActorMixin:
    """Gives a Ray actor class the one method `RayEngine` calls."""

    def enginehooks_handle(self) -> EngineHandle:
        """The in-process handle of the engine this actor holds."""
        raise NotImplementedError(f"{type(self).__name__} must implement enginehooks_handle()")

    def enginehooks_call(self, op: str, args: list[Any], timeout_s: float,
                         auth: str | None = None) -> dict[str, Any]:
        """Run handle operation `op` with JSON-able `args` (and the trainer's signature
        `auth`, for the verbs that carry one); reply `{"result": ...}` or
        `{"error": class name, "message": text}` (see `ray_ext.calls`)."""
        try:
            if op not in OPERATIONS:
                raise ConfigError(f"unknown operation {op!r}; RayEngine calls {sorted(OPERATIONS)}")
            handle = self.enginehooks_handle()
            fn = getattr(handle, op, None)
            if fn is None:
                raise ConfigError(f"{type(handle).__name__} has no {op}()")
            extra = {} if auth is None else {"auth": auth}
            return wire.result_reply(fn(*args, timeout_s=timeout_s, **extra))
        except Exception as e:
            return wire.error_reply(e)


class VLLMActor(EngineActorMixin):
    """`vllm.LLM` in a Ray actor, with the enginehooks worker extension.

    `VLLMActor(model, name=..., **engine_kwargs)`: `engine_kwargs` go to `vllm.LLM`
    (add `weight_transfer_config={"backend": "enginehooks"}` for vLLM's own calls).
    """

    def __init__(self, model: str, name: str = "vllm", **engine_kwargs: Any) -> None:
        from vllm import LLM

        from enginehooks.vllm_ext import VLLMEngine

        engine_kwargs.setdefault("worker_extension_cls", EXTENSION)
        self.llm = LLM(model=model, **engine_kwargs)
        self._handle = VLLMEngine(self.llm, name=name)

    def enginehooks_handle(self) -> EngineHandle:
        return self._handle

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """Generate from token-id prompts with vLLM `SamplingParams(**sampling)`;
        JSON-able outputs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 SamplingParams(**sampling), use_tqdm=False)
        return [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text}
                for o in outs]

    def weight_version(self) -> str:
        return self.llm.get_weight_version()


class SGLangActor(EngineActorMixin):
    """`sglang.Engine` in a Ray actor (the enginehooks plugin loads in its scheduler by
    itself when enginehooks is installed in the actor's environment).

    `SGLangActor(model_path, name=..., pause_mode="retract", **engine_kwargs)`:
    `engine_kwargs` go to `sglang.Engine`. SGLang pins its own torch, so the actor
    usually runs SGLang's interpreter: `runtime_env={"py_executable": SGLANG_PYTHON}`
    (that environment needs the same Ray version as the cluster).
    """

    def __init__(self, model_path: str, name: str = "sglang", pause_mode: str = "retract",
                 **engine_kwargs: Any) -> None:
        import sglang

        from enginehooks.sglang_ext import SGLangEngine

        self.engine = sglang.Engine(model_path=model_path, **engine_kwargs)
        self._handle = SGLangEngine(self.engine, name=name, pause_mode=pause_mode)

    def enginehooks_handle(self) -> EngineHandle:
        return self._handle

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """Generate from token-id prompts with SGLang `sampling_params=sampling`;
        JSON-able outputs, with the weight version SGLang stamps on each."""
        outs = self.engine.generate(input_ids=[list(p) for p in prompts], sampling_params=sampling)
        return [{"token_ids": list(o["output_ids"]), "text": o.get("text", ""),
                 "weight_version": o["meta_info"].get("weight_version")} for o in outs]

    def shutdown(self) -> None:
        self.engine.shutdown()

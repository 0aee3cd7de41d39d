"""Engines that live in Ray actors (the verl / OpenRLHF / NeMo-RL / SkyRL layout).

`RayEngine(actor)` is an `EngineHandle` for an engine inside a Ray actor whose class
mixes in `EngineActorMixin`: every call goes through `ray.get(..., timeout=...)`, so a
hung actor makes a `PushTimeout` and a dead one a `ReplicaError` naming it, within the
push's timeout. `VLLMActor` (wrapping `vllm.LLM`) and `SGLangActor` (wrapping
`sglang.Engine`) are ready-made actor classes. Importing this package does not import
Ray, vLLM or SGLang. See docs/ray.md.
"""

from __future__ import annotations

from enginehooks.ray_ext.actors import EngineActorMixin, SGLangActor, VLLMActor
from enginehooks.ray_ext.handle import RayEngine

__all__ = ["EngineActorMixin", "RayEngine", "SGLangActor", "VLLMActor"]

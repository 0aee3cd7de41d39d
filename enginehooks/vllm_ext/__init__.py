"""vLLM engine plugin: the worker extension (rollout side) and engine handles (trainer
side). Importing this package does not import vLLM; the handles import it lazily."""

from __future__ import annotations

from enginehooks.vllm_ext.handles import VLLMAsyncEngine, VLLMEngine, VLLMServer
from enginehooks.vllm_ext.worker_extension import WorkerExtension

__all__ = ["VLLMAsyncEngine", "VLLMEngine", "VLLMServer", "WorkerExtension"]

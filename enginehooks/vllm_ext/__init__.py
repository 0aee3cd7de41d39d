"""vLLM engine plugin: the worker extension (rollout side) and engine handles (trainer
side); and backend "enginehooks" of vLLM's own weight-transfer API
(`transfer_engine`: worker side, `transfer_trainer`: trainer side, `plugin`: the
`vllm.general_plugins` entry point). Importing this package does not import vLLM; the
handles import it lazily, the backend modules only when vLLM or a trainer loads them."""

from __future__ import annotations

from enginehooks.vllm_ext.handles import VLLMAsyncEngine, VLLMEngine, VLLMServer
from enginehooks.vllm_ext.worker_extension import WorkerExtension

__all__ = ["VLLMAsyncEngine", "VLLMEngine", "VLLMServer", "WorkerExtension"]

"""vLLM worker extension: `--worker-extension-cls enginehooks.vllm_ext.WorkerExtension`.

vLLM appends this class to its worker's bases, so its methods run inside every worker
process and are reachable through `collective_rpc` (in-process `LLM`, `AsyncLLM`, or
the dev-mode HTTP route). vLLM asserts on any name its worker already has, so every
method here is prefixed `enginehooks_`; arguments arrive as strings over HTTP, so they
are JSON text, and results are dicts or lists.

Weights are applied through the worker's `reload_weights`, never `model.load_weights`:
on CPU vLLM prepacks linear layers, and a plain `load_weights` either fails or returns
success while generation stays on the old weights. `reload_weights` runs vLLM's
layerwise reload, which also re-runs quantisation post-processing on GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.engine.contract import VERBS, EngineBinding, method_name
from enginehooks.engine.expectations import (
    CheckpointExpectations,
    Expectations,
    checkpoint_specs,
    resolve_model_dir,
)
from enginehooks.engine.side import EngineSide
from enginehooks.transports.base import Target


class VLLMTarget(Target):
    """Applies tensors to the worker's model through vLLM's own reload path."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.device = torch.device(worker.device) if hasattr(worker, "device") else torch.device("cpu")

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        # Layerwise reload keeps the tensors it is given until their whole layer has
        # arrived, and the transport reuses bucket buffers: hand it copies, so at most
        # one layer's worth is held, never views into a buffer being overwritten.
        copies = ((name, t.clone()) for name, t in tensors)
        try:
            self.worker.reload_weights(weights_iterator=copies, is_checkpoint_format=True)
        except BaseException:
            self._unwind_reload()
            raise

    def _unwind_reload(self) -> None:
        """After a reload died mid-stream, finish vLLM's layerwise reload anyway.

        Without this the model keeps the reload's wrapped loaders and meta tensors, and
        every later reload fails. Finalising places the old kernel tensors back for
        layers that received nothing and processes the others: the model is consistent
        again (though torn between versions, which `EngineSide` reports) and the next
        update repairs it.
        """
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.layerwise import (
                finalize_layerwise_reload,
            )

            cfg = self.worker.vllm_config
            with set_current_vllm_config(cfg):
                finalize_layerwise_reload(self.worker.model_runner.get_model(), cfg.model_config)
        except Exception:
            import logging

            logging.getLogger(__name__).exception("could not unwind vLLM's layerwise reload")

    def load_path(self, path: str) -> bool:
        self.worker.reload_weights(weights_path=path, is_checkpoint_format=True)
        return True


class VLLMBinding(EngineBinding):
    """What a vLLM worker supplies to the engine contract."""

    engine = "vllm"

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.worker_rank = int(getattr(worker, "rank", 0))
        self._target = VLLMTarget(worker)

    def target(self) -> Target:
        return self._target

    def dtype(self) -> str:
        return dtype_name(self.worker.vllm_config.model_config.dtype)

    def expectations(self) -> Expectations:
        mc = self.worker.vllm_config.model_config
        tie = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
        return CheckpointExpectations(checkpoint_specs(
            resolve_model_dir(mc.model), engine_dtype=self.dtype(), tie_word_embeddings=tie))

    def readable(self) -> Mapping[str, torch.Tensor]:
        # On CPU linear layers are prepacked and not readable; embeddings and norms are.
        return dict(self.worker.model_runner.get_model().named_parameters())


class WorkerExtension:
    """Mixed into vLLM's worker; see the module docstring. Its methods are the engine
    contract's verbs (`enginehooks_<verb>`), generated below from `VERBS`."""

    def _enginehooks_side(self) -> EngineSide:
        side: EngineSide | None = getattr(self, "_enginehooks_state", None)
        if side is None:
            side = EngineSide(VLLMBinding(self))
            self._enginehooks_state = side
        return side


def _worker_method(verb: str) -> Any:
    def method(self: Any, *args: Any) -> Any:
        return self._enginehooks_side().call(verb, *args)

    method.__name__ = method.__qualname__ = method_name(verb)
    method.__doc__ = f"The engine contract's `{verb}` verb (enginehooks.engine.contract)."
    return method


for _verb in VERBS:
    setattr(WorkerExtension, method_name(_verb), _worker_method(_verb))

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

import json
from collections.abc import Iterator
from typing import Any

import torch

from enginehooks.checkpoint import checkpoint_specs, readable_digests, resolve_model_dir
from enginehooks.dtypes import dtype_name
from enginehooks.engine_side import EngineSide
from enginehooks.manifest import TensorSpec


class _VLLMTarget:
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


class WorkerExtension:
    """Mixed into vLLM's worker; see the module docstring."""

    def _enginehooks_side(self) -> EngineSide:
        side = getattr(self, "_enginehooks_state", None)
        if side is None:
            side = EngineSide(
                _VLLMTarget(self),
                self._enginehooks_expected,
                device=_VLLMTarget(self).device,
                worker_rank=int(getattr(self, "rank", 0)),
            )
            self._enginehooks_state = side
        return side

    def _enginehooks_dtype(self) -> str:
        return dtype_name(self.vllm_config.model_config.dtype)

    def _enginehooks_expected(self) -> dict[str, TensorSpec]:
        mc = self.vllm_config.model_config
        tie = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
        return checkpoint_specs(
            resolve_model_dir(mc.model), engine_dtype=self._enginehooks_dtype(),
            tie_word_embeddings=tie,
        )

    # -- RPCs -------------------------------------------------------------------------
    def enginehooks_info(self) -> dict[str, Any]:
        info = self._enginehooks_side().info()
        info["dtype"] = self._enginehooks_dtype()
        info["engine"] = "vllm"
        return info

    def enginehooks_join(self, endpoint: str, rank_offset: str | int) -> dict[str, Any]:
        side = self._enginehooks_side()
        side.expected()  # read the checkpoint layout now, before the model path can move
        return side.join(endpoint, int(rank_offset) + side.worker_rank)

    def enginehooks_leave(self) -> dict[str, Any]:
        self._enginehooks_side().leave()
        return {"left": True}

    def enginehooks_check(self, manifest: str) -> list[str]:
        return self._enginehooks_side().check(manifest)

    def enginehooks_receive(self, manifest: str) -> dict[str, Any]:
        return self._enginehooks_side().receive(manifest)

    def enginehooks_digests(self, names: str) -> dict[str, Any]:
        """crc32 of parameters vLLM keeps in checkpoint layout (embeddings, norms; on
        CPU linear layers are prepacked and not readable), for bit-exact checks."""
        params = dict(self.model_runner.get_model().named_parameters())
        return readable_digests(params, self._enginehooks_side().expected(), json.loads(names))

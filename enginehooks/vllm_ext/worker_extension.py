"""vLLM worker extension: `--worker-extension-cls enginehooks.vllm_ext.WorkerExtension`.

vLLM appends this class to its worker's bases, so its methods run inside every worker
process and are reachable through `collective_rpc` (in-process `LLM`, `AsyncLLM`, or
the dev-mode HTTP route). vLLM asserts on any name its worker already has, so every
method here is prefixed `enginehooks_`; arguments arrive as strings over HTTP, so they
are JSON text, and results are dicts or lists.

Weights are applied through the worker's `reload_weights`, never `model.load_weights`:
on CPU vLLM prepacks linear layers, and a plain `load_weights` either fails or returns
success while generation stays on the old weights. `reload_weights` runs vLLM's
layerwise reload, which also re-runs quantisation post-processing on GPU. Two layers it
leaves stale are repaired after each update (`_repair_after_reload`, checked by the
exact oracle): a module that only aliases another's weight (a tied output head), and,
on CPU, fused-MoE experts, which vLLM prepacks for its CPU kernel only at first load.

What an update may carry is decided by vLLM's own loader: the model class is built a
second time on the meta device, exactly as vLLM builds it, and its `load_weights` is
dry-run on meta tensors of the update under the byte tracer
(`engine.expectations.LoaderExpectations`, `engine.trace`). What the reload got wrong
beyond the two known layers is found by verify-after-apply (`engine.verify`): a shadow
built by vLLM's fresh-load path from the same tensors, compared and repaired in place.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.engine.beacon import Beacon
from enginehooks.engine.contract import VERBS, EngineBinding, method_name
from enginehooks.engine.expectations import (
    Expectations,
    LoaderExpectations,
    checkpoint_specs,
    resolve_model_dir,
    skeleton_on_meta,
)
from enginehooks.engine.side import EngineSide
from enginehooks.engine.verify import Verifier, ensure_room
from enginehooks.transports.base import Target


def private_config(vllm_config: Any) -> Any:
    """The worker's config with a private layer registry: vLLM registers every attention
    layer of a model it builds, and refuses a second one by name (the dry-run skeleton
    and the verification shadow are second models)."""
    cfg = copy.copy(vllm_config)
    cfg.compilation_config = copy.copy(cfg.compilation_config)
    cfg.compilation_config.static_forward_context = {}
    return cfg


class VLLMTarget(Target):
    """Applies tensors to the worker's model through vLLM's own reload path."""

    def __init__(self, worker: Any, landed: Callable[[list[TensorSpec]], set[str]]) -> None:
        self.worker = worker
        self.landed = landed
        self.verifier = Verifier("vLLM")
        self.requested = False  # the trainer asked this update to be verified
        self.device = torch.device(worker.device) if hasattr(worker, "device") else torch.device("cpu")

    def prepare(self, manifest: Manifest) -> None:
        self.requested = bool(manifest.meta.get("verify"))

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        # Layerwise reload keeps the tensors it is given until their whole layer has
        # arrived, and the transport reuses bucket buffers: hand it copies, so at most
        # one layer's worth is held, never views into a buffer being overwritten. When
        # this update is verified, the copies are kept for the fresh-load shadow.
        fed: list[TensorSpec] = []
        verify = self.verifier.wanted(self.requested)
        kept: list[tuple[str, torch.Tensor]] = []

        def copies() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                fed.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)))
                c = t.clone()
                if verify:  # on the host: the shadow must never cost the engine's memory
                    kept.append((name, c.to("cpu", copy=True) if c.device.type != "cpu" else c))
                yield name, c

        try:
            self.worker.reload_weights(weights_iterator=copies(), is_checkpoint_format=True)
        except BaseException:
            self._unwind_reload()
            raise
        model = self.worker.model_runner.get_model()
        landed = self.landed(fed)
        _repair_after_reload(model, landed)
        if verify:
            self.verifier.run(model, lambda: self.fresh_load(kept), landed)

    def fresh_load(self, weights: list[tuple[str, torch.Tensor]]) -> torch.nn.Module:
        """The engine's fresh-load path on `weights`, in a model of its own: vLLM's model
        class built on the worker's device, its `load_weights`, then its post-load
        processing (what `DefaultModelLoader.load_model` does with a checkpoint)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import (
            initialize_model,
            process_weights_after_loading,
        )
        from vllm.utils.torch_utils import set_default_torch_dtype

        ensure_room(self.device, sum(t.nbytes for _, t in weights))
        cfg = private_config(self.worker.vllm_config)
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
            with self.device:
                model = initialize_model(vllm_config=cfg)
            with torch.no_grad():
                model.load_weights(iter(weights))
                process_weights_after_loading(model, cfg.model_config, self.device)
        return model

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
        # From disk the update is a complete checkpoint: every parameter is reloaded.
        self.worker.reload_weights(weights_path=path, is_checkpoint_format=True)
        model = self.worker.model_runner.get_model()
        _repair_after_reload(model, {n for n, _ in model.named_parameters()})
        return True


def _repair_after_reload(model: torch.nn.Module, loaded: set[str]) -> None:
    """Re-run the post-load processing vLLM's layerwise reload skips, for the layers
    whose parameters this update loaded (`loaded`: parameter names).

    - A module whose every parameter is another module's (a tied output head): vLLM
      reprocesses only the owner (its reload's documented limitation 2), so on CPU the
      head keeps the packed copy of the old embedding. Its quant method's
      `process_weights_after_loading` is re-run; for embeddings that only rebuilds the
      packed copy.
    - On CPU, fused-MoE experts: vLLM prepacks their weights for the CPU kernel at first
      load only (`_setup_kernel` skips it on updates), so reloaded experts would be read
      in the wrong layout. The experts' own `process_weights_after_loading` is re-run.
    """
    from vllm.platforms import current_platform

    owners: dict[int, str] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), f"{mname}.{pname}".lstrip("."))
    cpu = current_platform.is_cpu()
    with torch.no_grad():
        for mname, module in model.named_modules():
            own = [(f"{mname}.{n}".lstrip("."), p) for n, p in module.named_parameters(recurse=False)]
            qm = getattr(module, "quant_method", None)
            if qm is None or not own:
                continue
            aliases = [owners[id(p)] for full, p in own if owners[id(p)] != full]
            if len(aliases) == len(own) and loaded.intersection(aliases):
                qm.process_weights_after_loading(module)
                continue
            kernel = getattr(qm, "moe_kernel", None)
            if cpu and kernel is not None and loaded.intersection(full for full, _ in own):
                kernel.fused_experts.process_weights_after_loading(module)


class VLLMBinding(EngineBinding):
    """What a vLLM worker supplies to the engine contract."""

    engine = "vllm"

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.worker_rank = int(getattr(worker, "rank", 0))
        self._expectations: LoaderExpectations | None = None
        self._target = VLLMTarget(worker, self._landed)
        self.beacon = Beacon.create(f"worker-{self.worker_rank}")

    def target(self) -> Target:
        return self._target

    def dtype(self) -> str:
        return dtype_name(self.worker.vllm_config.model_config.dtype)

    def expectations(self) -> Expectations:
        return self._loader_expectations()

    def _loader_expectations(self) -> LoaderExpectations:
        if self._expectations is None:
            mc = self.worker.vllm_config.model_config
            self._expectations = LoaderExpectations(
                self._skeleton, self._dry_load, checkpoint_specs(resolve_model_dir(mc.model)),
                engine="vLLM")
        return self._expectations

    def _landed(self, fed: list[TensorSpec]) -> set[str]:
        """Parameter names the update's tensors land in (from the loader dry run)."""
        return {p for landing in self._loader_expectations().landings(fed).values()
                for p in landing.params}

    def _skeleton(self) -> torch.nn.Module:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        def build(device: torch.device) -> torch.nn.Module:
            cfg = private_config(self.worker.vllm_config)  # fresh for each attempt
            with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), \
                    device:
                return initialize_model(vllm_config=cfg)

        # Never `model.to(...)`: vLLM caches modules such as rotary embeddings and shares
        # them with the live model, whose parameters must stay where they are.
        live = {id(p) for p in self.worker.model_runner.get_model().parameters()}
        return skeleton_on_meta(build, keep=live, engine="vLLM")

    def _dry_load(self, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> Any:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(private_config(self.worker.vllm_config)):
            return model.load_weights(weights)

    def readable(self) -> Mapping[str, torch.Tensor]:
        # On CPU linear layers are prepacked and not readable; embeddings and norms are.
        return dict(self.worker.model_runner.get_model().named_parameters())

    def state_changed(self, state: dict[str, Any]) -> None:
        self.beacon.publish(state)

    def info(self) -> dict[str, Any]:
        return {"beacon": str(self.beacon.path), "verification": self._target.verifier.state()}


class WorkerExtension:
    """Mixed into vLLM's worker; see the module docstring. Its methods are the engine
    contract's verbs (`enginehooks_<verb>`), generated below from `VERBS`."""

    def _enginehooks_side(self) -> EngineSide:
        side: EngineSide | None = getattr(self, "_enginehooks_state", None)
        if side is None:
            # One receiving state per worker: when vLLM runs the "enginehooks"
            # weight-transfer backend too, its state is the worker's, so both ways
            # of pushing report the same version and torn state.
            side = getattr(getattr(self, "weight_transfer_engine", None), "side", None)
            if not isinstance(side, EngineSide):
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

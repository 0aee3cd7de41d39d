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
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import EngineHooksError
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.engine.apply import ApplyTarget
from enginehooks.engine.companions import CompanionBinding
from enginehooks.engine.contract import VERBS, method_name
from enginehooks.engine.copy_plan import (
    CopyPlan,
    Layout,
    Route,
    coverage,
    named_tensors,
    replay,
)
from enginehooks.engine.expectations import skeleton_on_meta
from enginehooks.engine.shadow import Pass, ShadowParts, Timers
from enginehooks.engine.side import EngineSide
from enginehooks.engine.twin import TwinLayers, twin_mode
from enginehooks.engine.verify import ensure_room
from enginehooks.vllm_ext.cpu_amx import allow_amx

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM imports this module in each worker before its first forward: a worker whose
# general plugins were filtered out still gets AMX permission (cpu_amx).
allow_amx()


def private_config(vllm_config: Any) -> Any:
    """The worker's config with a private layer registry: vLLM registers every attention
    layer of a model it builds, and refuses a second one by name (the dry-run skeleton
    and the verification shadow are second models)."""
    cfg = copy.copy(vllm_config)
    cfg.compilation_config = copy.copy(cfg.compilation_config)
    cfg.compilation_config.static_forward_context = {}
    return cfg


class VLLMTarget(ApplyTarget):
    """Applies tensors to the worker's model through vLLM's own reload path, or, once a
    copy plan is recorded and verified (`engine.copy_plan`), writes planned tensors
    straight into vLLM's layers (`PlannedLayers`) and reloads only the rest. The apply
    routine itself (routes, bookkeeping, recording, verification, statistics) is
    `engine.apply.ApplyTarget`'s; what is vLLM's is below."""

    engine = "vLLM"

    def __init__(self, worker: Any) -> None:
        super().__init__(torch.device(worker.device) if hasattr(worker, "device")
                         else torch.device("cpu"))
        self.worker = worker
        self.loader_too = False  # some of this update's tensors go through the loader
        self.layers: PlannedLayers | None = None  # during `apply`: where planned bytes land
        #: this update's twins (`engine.twin`), from `writable` until it is verified
        self.twins: TwinLayers | None = None

    def model(self) -> torch.nn.Module:
        return self.worker.model_runner.get_model()

    def checkpoint_dir(self) -> str:
        return str(self.worker.vllm_config.model_config.model)

    def skeleton(self) -> torch.nn.Module:
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
        live = {id(p) for p in self.model().parameters()}
        return skeleton_on_meta(build, keep=live, engine="vLLM")

    def dry_load(self, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> Any:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(private_config(self.worker.vllm_config)):
            return model.load_weights(weights)  # type: ignore[operator]

    def prepare(self, manifest: Manifest) -> None:
        self.loader_too, self.layers = False, None
        super().prepare(manifest)
        # some tensors stay on the loader: planned layers are then rebuilt inside
        # vLLM's reload (no update-sized temporaries, one reload)
        self.loader_too = len(self.routes) < len(manifest.tensors)

    def plan_routes(self, plan: CopyPlan, specs: list[TensorSpec]) -> dict[str, Route]:
        return plannable(self.model(), plan, specs)

    def writable(self, routes: dict[str, Route]) -> dict[str, Route]:
        # post-load processing on a thread of its own on CPU only, where it is oneDNN's
        # prepacking on the cores; on GPUs it is queued on the receiving thread's stream
        self.twins = self._twins()
        self.layers = PlannedLayers(self.model(), routes, background=self.device.type == "cpu",
                                    twins=self.twins)
        return routes

    def _twins(self) -> TwinLayers | None:
        """Twins for this update's planned layers (`engine.twin`): where it is verified in
        the plan's steady state (the plan's first use is judged against a whole fresh
        load) and `ENGINEHOOKS_TWIN=on`, on the host only (a GPU would hold every twin's
        processed tensors until the check)."""
        if self.twins is not None:  # an update that failed before its check: released
            self.twins.drop()
            self.twins = None
        if (twin_mode() != "on" or self.device.type != "cpu" or self.plan.state == "verifying"
                or not self.verifier.wanted(self.requested)):
            return None
        try:
            return TwinLayers(self.shadow_parts().build, self.model())
        except Exception as e:  # our limitation: the live layers process themselves
            logging.getLogger(__name__).info("no twins for this update: %s: %s",
                                             type(e).__name__, e)
            return None

    def _streamer(self, kept: list[tuple[str, torch.Tensor]]) -> Callable[..., Iterator[Pass]] | None:
        """The shadow streamed unit by unit, where this update's twins (their layers'
        fresh loads, processed as the update applied) stand for the units it needs."""
        base = super()._streamer(kept)
        twins = self.twins
        if twins is None or base is None or twins.model is None:
            return base

        def streamer(needed: Collection[str], before_processing: Any = None) -> Iterator[Pass]:
            done = twins.processed()
            covered = {m for m in needed if m in done}
            if covered:
                assert twins.model is not None
                yield Pass("twins", covered, twins.model, 0, Timers(twins.seconds))
            left = set(needed) - covered
            if left:
                yield from base(left, before_processing)

        return streamer

    def _record_and_verify(self, *args: Any, **kw: Any) -> None:
        try:
            super()._record_and_verify(*args, **kw)
        finally:
            twins, self.twins = self.twins, None
            if twins is not None:
                twins.drop()

    def write_planned(self, name: str, t: torch.Tensor, route: Route) -> None:
        assert self.layers is not None
        self.layers.write(name, t)

    def loader_copy(self, t: torch.Tensor) -> torch.Tensor:
        # Layerwise reload keeps the tensors it is given until their whole layer has
        # arrived, and the transport reuses bucket buffers: hand it copies, so at most
        # one layer's worth is held, never views into a buffer being overwritten.
        return t.clone()

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        layers = self.layers
        if layers is None:  # nothing planned: all through vLLM's reload
            try:
                self.worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            except BaseException:
                self._unwind_reload()
                raise
        elif self.loader_too:
            def mixed() -> Iterator[tuple[str, torch.Tensor]]:
                # Inside vLLM's layerwise reload: planned layers are rebuilt here as they
                # arrive (and leave the reload's bookkeeping), the loader takes the rest.
                yield from weights
                layers.finish()

            try:
                self.worker.reload_weights(weights_iterator=mixed(), is_checkpoint_format=True)
            except BaseException:
                layers.unwind()  # its thread must not process while vLLM unwinds
                self._unwind_reload()
                raise
        else:
            from vllm.config import set_current_vllm_config

            try:
                with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
                    # names the manifest did not announce: the loader's, after the stream
                    rest = list(weights)
                    layers.finish()
            except BaseException:
                layers.unwind()
                raise
            if rest:
                try:
                    self.worker.reload_weights(weights_iterator=iter(rest),
                                               is_checkpoint_format=True)
                except BaseException:
                    self._unwind_reload()
                    raise

    def end(self) -> None:
        self.layers = None

    def session_stats(self) -> tuple[float, dict[str, Any]]:
        layers, twins = self.layers, self.twins
        extra: dict[str, Any] = {"in_place_last": layers.in_place if layers is not None else 0}
        if twins is not None:  # layers processed on their twins, and moved (`engine.twin`)
            extra["twins_last"] = {"moved": len(twins.moved), "kept_live": len(twins.kept_live),
                                   "refused": dict(list(twins.refused.items())[:8]),
                                   "seconds": {k: round(v, 4) for k, v in twins.seconds.items()}}
        return (layers.worker_cpu if layers is not None else 0.0), extra

    def after_load(self, model: torch.nn.Module, landed: set[str]) -> None:
        _repair_after_reload(model, landed, self.twins)

    def fresh_load(self, weights: list[tuple[str, torch.Tensor]],
                   before_processing: Callable[[torch.nn.Module], None] | None = None
                   ) -> torch.nn.Module:
        """The engine's fresh-load path on `weights`, in a model of its own: vLLM's model
        class built on the worker's device, its `load_weights`, then its post-load
        processing (what `DefaultModelLoader.load_model` does with a checkpoint).
        `before_processing(model)` sees what the loader alone wrote (the copy plan's
        check)."""
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
                if before_processing is not None:
                    before_processing(model)
                process_weights_after_loading(model, cfg.model_config, self.device)
        return model

    def shadow_parts(self) -> ShadowParts:
        """`fresh_load` in its three steps, for the streamed shadow (`engine.shadow`):
        vLLM's `initialize_model`, the model's `load_weights`, vLLM's
        `process_weights_after_loading`, each in the config and dtype contexts
        `fresh_load` gives them."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import (
            initialize_model,
            process_weights_after_loading,
        )
        from vllm.utils.torch_utils import set_default_torch_dtype

        cfg = private_config(self.worker.vllm_config)
        device = self.device

        def build() -> torch.nn.Module:
            with set_current_vllm_config(cfg), set_default_torch_dtype(
                    cfg.model_config.dtype), device:
                return initialize_model(vllm_config=cfg)

        def load(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
            with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
                model.load_weights(iter(weights))  # type: ignore[operator]

        def process(model: torch.nn.Module) -> None:
            with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
                process_weights_after_loading(model, cfg.model_config, device)

        return ShadowParts(build, load, process, self.lands, device)

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

    def destination(self, name: str) -> torch.Tensor | None:
        """Where a planned plain full copy lands while `apply` rebuilds its layer: vLLM
        keeps a layer's loader layout only while it reloads it (on CPU linear weights
        are prepacked), so the layer is materialised now and the bytes are received
        straight into it (the replay's copy is then skipped). None otherwise."""
        layers, plan = self.layers, self.plan.plan
        if layers is None or plan is None:
            return None
        return layers.destination(name, plan)

    def load_path(self, path: str) -> bool:
        # From disk the update is a complete checkpoint: every parameter is reloaded.
        self.worker.reload_weights(weights_path=path, is_checkpoint_format=True)
        model = self.worker.model_runner.get_model()
        _repair_after_reload(model, {n for n, _ in model.named_parameters()})
        return True


def _process_own(layer: torch.nn.Module) -> None:
    """A layer's own quant method's post-load processing (a twin's: `engine.twin`)."""
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr, operator]


def _split(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr


def plannable(model: torch.nn.Module, plan: CopyPlan,
              specs: list[TensorSpec]) -> dict[str, Route]:
    """The tensors of an update that `PlannedLayers` can write: planned, and every layer
    they land in (a) receives nothing from the loader in this update, (b) has every
    tensor vLLM's reload restores for it covered exactly by planned writes (the layer is
    rebuilt from them alone), in the layout the plan was recorded for, and (c) is not an
    attention layer (vLLM processes those after all others). Others go to the loader."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    modules = dict(model.named_modules())
    live = dict(named_tensors(model))
    routes: dict[str, Route] = {}
    blocked: set[str] = set()  # modules some loader tensor writes into
    for s in specs:
        r = plan.route_for_spec(s)
        if r is None:
            full = plan.routes.get(s.name)
            blocked |= {_split(d)[0] for d in (full.lands if full else ())}
            if full is None:
                return {}  # a tensor the plan never saw: where it lands is unknown
        else:
            routes[s.name] = r
    while True:
        cover = coverage(plan, routes)
        bad: set[str] = set(blocked)
        for dest in plan.destinations(routes):
            mname, attr = _split(dest)
            layer = modules.get(mname)
            if layer is None or is_deferred_attention_layer(layer):
                bad.add(mname)
                continue
            params, buffers = get_layerwise_info(layer).restore_metadata
            restored = {**params, **buffers}
            if attr in restored:
                if not cover.get(dest) or Layout.of(restored[attr]) != plan.layouts.get(dest):
                    bad.add(mname)
            elif attr in SKIP_TENSORS or dest in live:
                # written in place, as vLLM's reload writes it (it keeps these live):
                # the copy casts into whatever dtype processing gave it (CPU small
                # GEMMs keep an fp32 bias), so only sizes and strides must agree
                t, want = live.get(dest), plan.layouts.get(dest)
                if t is None or want is None or (tuple(t.shape), tuple(t.stride())) != (
                        want.sizes, want.strides):
                    bad.add(mname)
            else:
                bad.add(mname)
        for mname in {_split(d)[0] for d in plan.destinations(routes)} - bad:
            params, buffers = get_layerwise_info(modules[mname]).restore_metadata
            wanted = {f"{mname}.{a}".lstrip(".") for a in {**params, **buffers}
                      if a not in SKIP_TENSORS}
            if not wanted <= set(cover):
                bad.add(mname)  # the layer would be rebuilt with tensors nobody writes
        drop = {n for n, r in routes.items() if {_split(st.dest)[0] for st in r.steps} & bad}
        if not drop:
            return routes
        blocked |= bad
        for n in drop:
            del routes[n]


class PlannedLayers:
    """Writes planned tensors straight into vLLM's layers, layer by layer, the way vLLM's
    layerwise reload processes a layer but without its loader: the layer's loader-layout
    tensors are materialised (`restore_layer_on_meta` + `materialize_layer`), the plan's
    copies land in them, and once every planned tensor of the layer has arrived its
    quant method's `process_weights_after_loading` runs (CPU prepacking, ...) and the
    result is copied into the kernel tensors the engine holds (CUDA graphs keep their
    references). Layers receiving nothing are not touched at all.

    With `background` (the target asks for it on CPU), the post-load processing of a
    complete layer (oneDNN prepacking, most of a planned update's CPU time) runs on a
    worker thread while the receiving thread goes on with the next buckets and layers;
    prepacking releases the GIL, so on a machine with a core to spare the two overlap.
    (On GPUs it stays on the receiving thread: a CUDA stream is per thread, and the
    layer's copies are queued on the receiver's.) At most `ahead` layers wait for it (each
    holds its loader-layout tensors: no model-sized temporary), and the first error
    it raises fails the update at the next write or at `finish`."""

    #: complete layers that may wait for the processing thread before writes block
    ahead = 2

    def __init__(self, model: torch.nn.Module, routes: Mapping[str, Route],
                 background: bool = True, twins: TwinLayers | None = None) -> None:
        self.twins = twins
        self.modules = dict(model.named_modules())
        self.routes = routes
        self.pending: dict[str, set[str]] = {}
        for name, r in routes.items():
            for st in r.steps:
                self.pending.setdefault(_split(st.dest)[0], set()).add(name)
        self.open: dict[str, Any] = {}
        self.loaded: dict[str, set[str]] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="enginehooks-postload") \
            if background else None
        self.closing: list[Future[None]] = []
        self.in_place = 0  # tensors offered as destinations to receive straight into
        self.worker_cpu = 0.0  # CPU seconds of the processing thread

    def write(self, name: str, t: torch.Tensor) -> None:
        self._check_closing()
        route = self.routes[name]
        layers = {_split(st.dest)[0] for st in route.steps}
        for mname in layers:
            if mname not in self.open:
                self._open(mname)
        dests = {st.dest: getattr(self.modules[_split(st.dest)[0]], _split(st.dest)[1])
                 for st in route.steps}
        replay(route, t, dests)
        for st in route.steps:
            self.loaded.setdefault(_split(st.dest)[0], set()).add(_split(st.dest)[1])
        for mname in layers:
            self.pending[mname].discard(name)
            if not self.pending[mname]:
                self._submit(mname)

    def destination(self, name: str, plan: CopyPlan) -> torch.Tensor | None:
        """The loader-layout tensor planned `name` is a plain full copy into (its layer
        is materialised now if it is not yet)."""
        route, step = self.routes.get(name), plan.full_copy(name)
        if route is None or step is None:
            return None
        mname, attr = _split(step.dest)
        if name not in self.pending.get(mname, ()):
            return None  # written already: its layer may be processing
        if mname not in self.open:
            self._open(mname)
        t = getattr(self.modules[mname], attr, None)
        if not isinstance(t, torch.Tensor):
            return None
        # the transport receives into it only where dtype, shape and contiguity match
        self.in_place += 1
        return t.data

    def _submit(self, mname: str) -> None:
        """Process the complete layer `mname`: on the worker thread, or here."""
        if self.pool is None:
            self._close(mname)
            return
        self.closing.append(self.pool.submit(self._close_in_worker, mname))
        while len(self.closing) > self.ahead:  # bounded memory: wait for the oldest
            self.closing.pop(0).result()

    def _close_in_worker(self, mname: str) -> None:
        c0 = time.thread_time()
        try:
            with torch.no_grad():  # grad mode is per thread
                self._close(mname)
        finally:  # the apply's CPU cost includes this thread's
            self.worker_cpu += time.thread_time() - c0

    def _check_closing(self) -> None:
        """Raise the first error of the processing thread (the update fails there)."""
        while self.closing and self.closing[0].done():
            self.closing.pop(0).result()

    def _drain(self, raise_first: bool) -> None:
        """Wait for every submitted layer; raise the first error if asked, else log."""
        error: BaseException | None = None
        for fut in self.closing:
            try:
                fut.result()
            except BaseException as e:  # re-raised or logged below
                error = error or e
        self.closing.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        if error is not None:
            if raise_first:
                raise error
            logging.getLogger(__name__).error("post-load processing failed: %s", error)

    def _open(self, mname: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import (
            materialize_layer,
            restore_layer_on_meta,
        )
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        layer = self.modules[mname]
        info = get_layerwise_info(layer)
        if not info.can_load():  # outside vLLM's reload: save the kernel tensors first
            info.kernel_tensors = get_layer_params_buffers(layer)
            info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
            restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        self.open[mname] = info

    def _close(self, mname: str) -> None:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload.layerwise import (
            _copy_and_restore_kernel_tensors,
        )

        layer, info = self.modules[mname], self.open[mname]
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        qm = getattr(layer, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase):
            # on a verified update, where wanted: processed on its twin, products moved
            if self.twins is None or not self.twins.process(mname, layer, _process_own):
                qm.process_weights_after_loading(layer)
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
        info.loaded_weights = [(a, None) for a in sorted(self.loaded.get(mname, ()))]
        _copy_and_restore_kernel_tensors(layer, info)
        info.reset()  # inside vLLM's reload: this layer is done, its finalize skips it
        del self.open[mname]  # only now: a layer that failed is put back by `unwind`

    def finish(self) -> None:
        """Every layer the update planned was processed (the stream carried all of it);
        raises the processing thread's first error."""
        self._drain(raise_first=True)
        left = sorted(m for m, names in self.pending.items() if names)
        if left:
            raise EngineHooksError(f"the update ended before layers {left[:5]} received all "
                                   "their planned tensors")

    def unwind(self) -> None:
        """After a failure mid-stream: wait for the processing thread, then put the kernel
        tensors (old values) back in every layer still open, so the model is consistent
        (torn between versions, which `EngineSide` reports) and the next update repairs
        it."""
        from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors

        self._drain(raise_first=False)
        for mname, info in list(self.open.items()):
            try:
                _place_kernel_tensors(self.modules[mname], info)
                info.reset()
            except Exception:
                logging.getLogger(__name__).exception("could not unwind layer %s", mname)
        self.open.clear()


def _repair_after_reload(model: torch.nn.Module, loaded: set[str],
                         twins: TwinLayers | None = None) -> None:
    """Re-run the post-load processing vLLM's layerwise reload skips, for the layers
    whose parameters this update loaded (`loaded`: parameter names).

    - A module whose every parameter is another module's (a tied output head): vLLM
      reprocesses only the owner (its reload's documented limitation 2), so on CPU the
      head keeps the packed copy of the old embedding. Its quant method's
      `process_weights_after_loading` is re-run; for embeddings that only rebuilds the
      packed copy. Where this update's `twins` processed the owner, the head is
      processed on its twin instead and what that sets is moved in (`engine.twin`).
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
                # processed on its twin where the update has them (`engine.twin`)
                if twins is None or not twins.process(mname, module, _process_own, tied=True):
                    qm.process_weights_after_loading(module)
                continue
            kernel = getattr(qm, "moe_kernel", None)
            if cpu and kernel is not None and loaded.intersection(full for full, _ in own):
                kernel.fused_experts.process_weights_after_loading(module)


class ModelWorker:
    """The parts of a vLLM worker that `VLLMBinding` uses, built from a config, a device
    and a model: what vLLM hands a weight-transfer engine (which is never given its
    worker), or a worker's speculative drafter (`mtp_companions`).

    Its `reload_weights` is vLLM's in-place reload on the model, as the worker's own
    does; the worker additionally resets LoRA state (vLLM's `finish_weight_update` does
    that here too) and its encoder and multimodal caches, which this engine cannot
    reach: text models hold none.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module):
        self.vllm_config = vllm_config
        self.device = device
        # A rank unique across data-parallel groups, counted as vLLM's own backends do
        # (`nccl_common`): every worker of the deployment has its own rank in the group.
        pc = vllm_config.parallel_config
        per_dp = int(getattr(pc, "world_size", 1) or 1)
        self.rank = int(getattr(pc, "data_parallel_index", 0) or 0) * per_dp + int(pc.rank)
        #: the deployment's workers (data-parallel size x TP x PP)
        self.workers = int(getattr(pc, "data_parallel_size", 1) or 1) * per_dp
        self._model = model
        self.model_runner = self  # VLLMBinding reads `worker.model_runner.get_model()`

    def get_model(self) -> torch.nn.Module:
        return self._model

    def reload_weights(self, *, weights_iterator: Any = None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with set_current_vllm_config(self.vllm_config):
            reload_weights(self.vllm_config, self._model, weights_iterator=weights_iterator,
                           weights_path=weights_path, is_checkpoint_format=is_checkpoint_format)


def mtp_companions(worker: Any) -> list[tuple[str, ApplyTarget]]:
    """The worker's MTP drafter as a companion of its model (`engine.companions`), when
    vLLM runs speculative decoding with multi-token-prediction layers of the model's own
    checkpoint (one of vLLM's MTP methods): its drafter is a second model (vLLM's MTP
    class for the architecture) whose loader takes the checkpoint's MTP layers, which the
    main model's loader skips. A separate draft model ("draft_model", EAGLE heads of their
    own checkpoint) is pushed on its own through vLLM's `start_draft_weight_update`."""
    from typing import get_args

    spec = getattr(worker.vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "draft_model_config", None) is None:
        return []
    try:
        from vllm.config.speculative import MTPModelTypes
    except ImportError:  # a vLLM without MTP methods
        return []
    if spec.method not in get_args(MTPModelTypes):
        return []
    runner = getattr(worker, "model_runner", None)
    get_draft = getattr(runner, "get_draft_model", None)
    draft = get_draft() if callable(get_draft) else None
    if draft is None:
        return []
    cfg = copy.copy(worker.vllm_config)
    cfg.model_config = spec.draft_model_config  # vLLM's config of its MTP model class
    device = torch.device(getattr(worker, "device", "cpu"))
    return [("the MTP drafter", VLLMTarget(ModelWorker(cfg, device, draft)))]


class VLLMBinding(CompanionBinding):
    """What a vLLM worker supplies to the engine contract (with its MTP drafter as a
    companion, when it runs one: `mtp_companions`)."""

    engine = "vllm"

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        rank = int(getattr(worker, "rank", 0))
        # models vLLM loads from the same checkpoint (an MTP drafter) are updated with it
        super().__init__(VLLMTarget(worker), mtp_companions(worker), rank,
                         beacon=f"worker-{rank}")

    def dtype(self) -> str:
        return dtype_name(self.worker.vllm_config.model_config.dtype)

    def readable(self) -> Mapping[str, torch.Tensor]:
        # On CPU linear layers are prepacked and not readable; embeddings and norms are.
        return dict(self.worker.model_runner.get_model().named_parameters())

    def deployment(self) -> str | None:
        # vLLM draws `instance_id` once per engine and hands the same config to every
        # worker; prefixed so that it never equals a worker's own id
        instance = getattr(self.worker.vllm_config, "instance_id", None)
        return f"vllm-{instance}" if instance else None


class WorkerExtension:
    """Mixed into vLLM's worker; see the module docstring. Its methods are the engine
    contract's verbs (`enginehooks_<verb>`), generated below from `VERBS`."""

    def _enginehooks_side(self) -> EngineSide:
        side: EngineSide | None = getattr(self, "_enginehooks_state", None)
        if side is None:
            # One receiving state per worker: when vLLM runs the "enginehooks"
            # weight-transfer backend too, its state is the worker's, so both ways
            # of pushing report the same version and torn state.
            engine: Any = getattr(self, "weight_transfer_engine", None)
            side = getattr(engine, "side", None)
            if not isinstance(side, EngineSide):
                side = EngineSide(VLLMBinding(self))
            elif _pristine(side) and mtp_companions(self):
                # vLLM hands the backend the model, never the worker, so the backend's
                # state cannot reach an MTP drafter: while it has taken no update yet,
                # the worker's own state (drafter included) replaces it for both
                side = EngineSide(VLLMBinding(self))
                engine.side = side
            self._enginehooks_state = side
        return side


def _pristine(side: EngineSide) -> bool:
    """Whether a receiving state has done nothing yet: no group, no update, no draft."""
    return (side.state == "initial" and side.group is None and side.version is None
            and not getattr(side, "_others", None))


def _worker_method(verb: str) -> Any:
    def method(self: Any, *args: Any) -> Any:
        return self._enginehooks_side().call(verb, *args)

    method.__name__ = method.__qualname__ = method_name(verb)
    method.__doc__ = f"The engine contract's `{verb}` verb (enginehooks.engine.contract)."
    return method


for _verb in VERBS:
    setattr(WorkerExtension, method_name(_verb), _worker_method(_verb))

"""Inside SGLang's scheduler: the `enginehooks_*` methods and the `Target` they apply with.

SGLang runs one scheduler process per TP rank (the "worker" of vLLM's vocabulary), and
its `collective_rpc` reaches any method of the Scheduler object. The plugin attaches the
methods below to every Scheduler after its `__init__` (see `plugin.py`), each forwarding
to one `EngineSide`, exactly as the vLLM worker extension does.

SGLang drops an RPC method's return value (`RpcReqOutput` carries only `success` and a
message), so every method here stores a JSON reply under the caller's `call_id`; an
AFTER hook on `Scheduler.handle_rpc_request` puts that reply, JSON text, into the
`RpcReqOutput.message` the caller receives. Arguments arrive as one JSON string (`args`),
because SGLang's RPC parameters are declared as flat scalars.

Weights go through the model's own `load_weights` (HF checkpoint names in, SGLang's
fused qkv / gate_up layout out) inside the model runner's weight-update session
(`begin_weight_update` / `end_weight_update`), which is what SGLang's own update
requests use: it restores and re-processes weights that the engine repacks or
quantises in place (a no-op for plain weights). Then the prefix cache is flushed and
the version recorded, so `meta_info["weight_version"]` of later generations says which
weights produced them.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ConfigError
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.engine.beacon import Beacon
from enginehooks.engine.contract import PREFIX, VERBS, EngineBinding, method_name
from enginehooks.engine.copy_plan import (
    CopyPlan,
    Layout,
    PlanState,
    Route,
    named_tensors,
    replay,
)
from enginehooks.engine.expectations import (
    Expectations,
    LoaderExpectations,
    checkpoint_specs,
    resolve_model_dir,
    skeleton_on_meta,
)
from enginehooks.engine.side import EngineSide
from enginehooks.engine.transplant import transplant
from enginehooks.engine.verify import Verifier, ensure_room
from enginehooks.transports.base import Target

log = logging.getLogger("enginehooks.sglang")

#: Scheduler attribute names this plugin adds (everything else of SGLang is untouched).
STATE_ATTR = "_enginehooks_side"
REPLIES_ATTR = "_enginehooks_replies"
#: Marks an `RpcReqOutput.message` written by us, so clients never mistake another
#: RPC's reply (or a stale one) for theirs.
REPLY_TAG = "enginehooks-reply/1"


def _model_runner(sched: Any) -> Any:
    return sched.tp_worker.model_runner


def _tp(sched: Any) -> tuple[int, int]:
    return int(getattr(sched, "tp_rank", 0) or 0), int(getattr(sched, "tp_size", 1) or 1)


def flush_kwargs(flush_cache: Callable[..., Any], device: torch.device) -> dict[str, Any]:
    """Arguments for SGLang's `Scheduler.flush_cache` after an update on `device`.

    The flush drops the prefix cache (stale under new weights) and then, by default,
    empties the device's allocator cache. On CPU that last step is a full `gc.collect()`
    of the scheduler's heap (SGLang's CPU platform has no allocator cache to empty):
    0.5-1.6 s per update at 1 GB on the 2-core CI machine, for nothing an update leaves
    behind (its temporaries are freed by reference counting). So on CPU it is skipped
    where SGLang's signature allows (`empty_cache`, SGLang 0.5.23); on GPUs the cached
    blocks go back, which a trainer colocated on the same GPU needs."""
    import inspect

    try:
        params = inspect.signature(flush_cache).parameters
    except (TypeError, ValueError):
        return {}
    if device.type == "cpu" and "empty_cache" in params:
        return {"empty_cache": False}
    return {}


def _device(sched: Any) -> torch.device:
    mr = _model_runner(sched)
    kind = str(getattr(mr, "device", "cpu"))
    if kind.startswith("cuda") and ":" not in kind:
        return torch.device("cuda", int(getattr(mr, "gpu_id", 0)))
    return torch.device(kind)


class SGLangTarget(Target):
    """Applies received tensors with the model's own `load_weights`, inside SGLang's
    weight-update session; then flushes the cache and records the version. Updates are
    verified against a fresh-load shadow (`engine.verify`) as the policy asks. Once a
    copy plan is recorded and verified (`engine.copy_plan`), planned tensors are written
    straight into the parameters inside the same session, and only the rest goes
    through `load_weights`."""

    def __init__(self, sched: Any, landed: Callable[[list[TensorSpec]], set[str]],
                 record: Callable[[list[TensorSpec]], CopyPlan] | None = None,
                 fresh_needed: Callable[[list[TensorSpec]], list[str]] | None = None) -> None:
        self.sched = sched
        self.device = _device(sched)
        self.flushed: bool | None = None
        self.landed = landed
        self.record = record
        self.verifier = Verifier("SGLang")
        self.plan = PlanState("SGLang")
        self.requested = False  # the trainer asked this update to be verified
        self.routes: dict[str, Route] = {}
        self._live: dict[str, torch.Tensor] | None = None  # during apply: name -> tensor
        self.fresh_needed = fresh_needed
        self.by_fresh_load: list[str] = []  # this update: parameters only a fresh load fills

    def prepare(self, manifest: Manifest) -> None:
        self.requested = bool(manifest.meta.get("verify"))
        self.routes = {}
        self.by_fresh_load = self.fresh_needed(manifest.specs()) if self.fresh_needed else []
        if self.by_fresh_load:
            self.plan.disable(f"the loader removed {self.by_fresh_load[:3]} from the live "
                              "model after its first load; updates go through a fresh load")
            return
        plan = self.plan.plan
        if self.plan.usable and plan is not None:
            for spec in manifest.specs():
                r = plan.route_for_spec(spec)
                if r is not None:
                    self.routes[spec.name] = r

    def destination(self, name: str) -> torch.Tensor | None:
        """The parameter a planned plain full copy lands in, while `apply` holds the
        weight-update session (the parameters are in the loader's layout then)."""
        plan, live = self.plan.plan, self._live
        if live is None or plan is None or name not in self.routes:
            return None
        step = plan.full_copy(name)
        if step is None:
            return None
        t = live.get(step.dest)
        if t is None or Layout.of(t) != plan.layouts.get(step.dest) or not t.is_contiguous():
            return None
        return t.data

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.by_fresh_load:
            self._apply_by_fresh_load(tensors)
            return
        mr = _model_runner(self.sched)
        updater = mr.weight_updater
        model = mr.model
        routes, self.routes = self.routes, {}
        checking = self.plan.state == "verifying" and bool(routes)
        verify = self.verifier.wanted(self.requested) or checking
        recording = self.plan.state == "pending" and self.record is not None
        fed: list[TensorSpec] = []
        kept: list[tuple[str, torch.Tensor]] = []
        planned = 0

        def watched() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal planned
            live = self._live or {}
            for name, t in tensors:
                fed.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)))
                if verify or recording:  # the buffer is reused: the shadow needs a copy
                    kept.append((name, t.to("cpu", copy=True)))
                route = routes.get(name)
                if route is not None:
                    replay(route, t, live)
                    planned += 1
                    continue
                yield name, t

        t0, c0 = time.perf_counter(), time.thread_time()
        updater.begin_weight_update()
        try:
            if routes:
                # inside the session the parameters are in the loader's layout; a
                # tensor whose destination is not (yet) goes to the loader
                live = dict(named_tensors(model))
                layouts = self.plan.plan.layouts if self.plan.plan is not None else {}
                routes = {n: r for n, r in routes.items()
                          if all(st.dest in live and Layout.of(live[st.dest]) == layouts.get(st.dest)
                                 for st in r.steps)}
                self.routes, self._live = routes, live
            # `load_weights` copies each tensor into its (fused) parameter as it goes,
            # so views into the transport's reusable buffers are safe to pass through.
            with torch.no_grad():
                model.load_weights(watched())
        finally:
            self._live, self.routes = None, {}
            # After a load, SGLang's own request path ends with run_post_load=False
            # (post-load already ran inside load_weights where the model needs it).
            # Always end the session, even after a failed load, so the model's
            # repacked / quantised weights are put back in their serving layout.
            updater.end_weight_update(run_post_load=False)
        if routes:
            self.plan.applied += 1
        # wall and this thread's CPU seconds (the latter is what the apply costs when
        # other processes share the cores)
        self.plan.last = {"seconds": round(time.perf_counter() - t0, 4),
                          "cpu_seconds": round(time.thread_time() - c0, 4),
                          "planned_last": planned, "loader_last": len(fed) - planned}
        landed = self.landed(fed)
        plan: CopyPlan | None = None
        if recording and fed:
            try:
                plan = self.record(fed)  # type: ignore[misc]
            except Exception as e:
                self.plan.disable(f"recording failed: {type(e).__name__}: {e}")
        if plan is not None:
            self.plan.check_on_shadow(plan, self.verifier, model,
                                      lambda hook: self.fresh_load(kept, before_processing=hook),
                                      dict(kept), landed, verify)
        elif verify:
            dests = {st.dest for r in routes.values() for st in r.steps}
            self._verify(model, kept, landed, checking and planned > 0, dests)

    def _apply_by_fresh_load(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The update through SGLang's fresh-load path, copied into the live model's
        storage (`engine.transplant`): for a model whose loader removed parameters it
        needs from the live model. Nothing is written until the fresh model is built and
        matches the live one tensor for tensor."""
        model = _model_runner(self.sched).model
        t0, c0 = time.perf_counter(), time.thread_time()
        kept = [(name, t.to("cpu", copy=True)) for name, t in tensors]
        fresh = self.fresh_load(kept)
        nbytes = transplant(fresh, model)
        del fresh
        self.plan.last = {"seconds": round(time.perf_counter() - t0, 4),
                          "cpu_seconds": round(time.thread_time() - c0, 4),
                          "planned_last": 0, "loader_last": len(kept),
                          "fresh_load": {"removed": self.by_fresh_load[:8], "bytes": nbytes}}
        fed = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in kept]
        if self.verifier.wanted(self.requested):
            self._verify(model, kept, self.landed(fed) - set(self.by_fresh_load), False, set())

    def _verify(self, model: torch.nn.Module, kept: list[tuple[str, torch.Tensor]],
                landed: set[str], checking: bool, planned: set[str]) -> None:
        """Verify after apply; the first update applied through the plan is always
        verified, and any difference from a fresh load turns the plan off."""
        self.plan.verify_update(self.verifier, model, lambda: self.fresh_load(kept), landed,
                                checking, planned)

    def fresh_load(self, weights: list[tuple[str, torch.Tensor]],
                   before_processing: Callable[[torch.nn.Module], None] | None = None
                   ) -> torch.nn.Module:
        """SGLang's fresh-load path on `weights`: the model class built as its loader
        builds it, then `DefaultModelLoader.load_weights_and_postprocess` (in its two
        halves, `before_processing(model)` between them: the copy plan's check)."""
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import (
            DefaultModelLoader,
            _get_quantization_config,
            _initialize_model,
        )
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        mr = _model_runner(self.sched)
        load_config = getattr(mr, "load_config", None) or LoadConfig(load_format="auto")
        quant = _get_quantization_config(mr.model_config, load_config)
        ensure_room(self.device, sum(t.nbytes for _, t in weights))
        with set_default_torch_dtype(mr.model_config.dtype):
            with self.device:
                model = _initialize_model(mr.model_config, load_config, quant)
            DefaultModelLoader.load_weights_only(model, iter(weights), self.device)
            if before_processing is not None:
                before_processing(model)
            DefaultModelLoader.postprocess_weights(model, self.device)
        return model

    # `load_path` stays False (the default): SGLang's reload-from-disk rewrites the
    # runner's model_path to the update's folder (which the disk transport later
    # prunes) and needs a full HF folder; streaming the verified shards through
    # `apply` uses the same loader instead.


class SGLangBinding(EngineBinding):
    """What an SGLang scheduler (one TP rank) supplies to the engine contract."""

    engine = "sglang"

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.worker_rank = _tp(sched)[0]
        self._target = SGLangTarget(sched, self._landed, self._record_plan,
                                    lambda specs: self._loader_expectations().fresh_load_needed(specs))
        self._expectations: LoaderExpectations | None = None
        # The state, readable on the host without an RPC (which would queue behind
        # the update this scheduler is applying).
        self.beacon = Beacon.create(f"sglang-tp{self.worker_rank}")

    def target(self) -> Target:
        return self._target

    def dtype(self) -> str:
        return dtype_name(_model_runner(self.sched).model_config.dtype)

    def expectations(self) -> Expectations:
        return self._loader_expectations()

    def _loader_expectations(self) -> LoaderExpectations:
        """SGLang's own `load_weights`, dry-run on a meta-device copy of the model
        (built as SGLang's loader builds it), against the checkpoint it started from."""
        if self._expectations is None:
            mr = _model_runner(self.sched)
            path = getattr(self.sched.server_args, "model_path", None) or \
                mr.model_config.model_path
            self._expectations = LoaderExpectations(
                self._skeleton,
                lambda model, weights: model.load_weights(weights),  # type: ignore[operator]
                checkpoint_specs(resolve_model_dir(path)), engine="SGLang",
                live=lambda: _model_runner(self.sched).model)
        return self._expectations

    def _landed(self, fed: list[TensorSpec]) -> set[str]:
        """Parameter names the update's tensors land in (from the loader dry run)."""
        return {p for landing in self._loader_expectations().landings(fed).values()
                for p in landing.params}

    def _record_plan(self, fed: list[TensorSpec]) -> CopyPlan:
        return self._loader_expectations().record_plan(fed)

    def _skeleton(self) -> torch.nn.Module:
        # SGLang's DefaultModelLoader.load_model minus the weights, on the meta device.
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        mr = _model_runner(self.sched)
        load_config = getattr(mr, "load_config", None) or LoadConfig(load_format="auto")
        quant = _get_quantization_config(mr.model_config, load_config)

        def build(device: torch.device) -> torch.nn.Module:
            with set_default_torch_dtype(mr.model_config.dtype), device:
                return _initialize_model(mr.model_config, load_config, quant)

        # to_meta inside: SGLang's Transformers backend (GPT-NeoX) builds on the CPU
        return skeleton_on_meta(build, engine="SGLang")

    def readable(self) -> Mapping[str, torch.Tensor]:
        # qkv / gate_up are fused; embeddings and norms keep their checkpoint layout.
        return dict(_model_runner(self.sched).model.named_parameters())

    def after_update(self, version: int | str) -> dict[str, Any]:
        # The RPC runs inside the scheduler's event loop, so no batch runs now: this is
        # the moment a flush can succeed (it refuses while requests are in flight,
        # which a paused engine has none of, in abort / retract mode).
        flushed = self.flush()
        self.sched.record_weight_version_change(new_version=str(version))
        return {"flushed": flushed}

    def flush(self) -> bool:
        flush_cache = self.sched.flush_cache
        return bool(flush_cache(**flush_kwargs(flush_cache, self._target.device)))

    def info(self) -> dict[str, Any]:
        from sglang.srt.runtime_context import get_serving

        return {"engine_weight_version": get_serving().weight_version,
                "beacon": str(self.beacon.path), "verification": self._target.verifier.state(),
                "copy_plan": self._target.plan.info()}

    def state_changed(self, state: dict[str, Any]) -> None:
        self.beacon.publish(state)
        # Every answer's meta_info["weight_version"] says which weights produced it: a
        # torn engine (policy "serve") marks its answers so they can be discarded.
        if state["state"] == "torn":
            self.sched.record_weight_version_change(new_version=f"torn:{state['failed_version']}")


def refuse_if_torn(original: Any, sched: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """Around `Scheduler.handle_generate_request`: queue the request as SGLang does, then,
    while this worker refuses generation (`EngineSide.refusal`), finish it at once with
    status 503, the way SGLang finishes requests it cannot serve."""
    side = getattr(sched, STATE_ATTR, None)
    refused = side.refusal() if side is not None else None
    result = original(sched, recv_req, *args, **kwargs)
    if refused is not None:
        rid = getattr(recv_req, "rid", None)
        for req in list(getattr(sched, "waiting_queue", [])):
            if getattr(req, "rid", None) == rid:
                req.set_finish_with_abort(refused["error"], status_code=503,
                                          err_type="ServiceUnavailableError")
    return result


def side_of(sched: Any) -> EngineSide:
    """The scheduler's `EngineSide`, created on first use."""
    side = getattr(sched, STATE_ATTR, None)
    if side is None:
        side = EngineSide(SGLangBinding(sched))
        setattr(sched, STATE_ATTR, side)
    return side


def _make_method(verb: str) -> Any:
    def method(self: Any, call_id: str = "", args: str = "[]") -> None:
        """Run `verb` with JSON `args`; keep the JSON reply for `handle_rpc_request`'s
        AFTER hook, and re-raise failures so SGLang's own `success` flag is right."""
        replies = getattr(self, REPLIES_ATTR, None)
        if replies is None:
            replies = {}
            setattr(self, REPLIES_ATTR, replies)
        replies.clear()  # one RPC at a time per scheduler: older replies are stale
        try:
            parsed = json.loads(args) if isinstance(args, str) else list(args or [])
            if not isinstance(parsed, list):
                raise ConfigError("args must be a JSON list")
            result = side_of(self).call(verb, *parsed)
            reply = {"ok": True, "result": json.loads(json.dumps(result, default=str))}
        except Exception as e:
            log.error("%s failed:\n%s", method_name(verb), traceback.format_exc())
            replies[call_id] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            raise
        replies[call_id] = reply

    method.__name__ = method_name(verb)
    method.__qualname__ = f"Scheduler.{method_name(verb)}"
    return method


METHODS: dict[str, Any] = {method_name(v): _make_method(v) for v in VERBS}


def attach(sched: Any) -> None:
    """Bind every `enginehooks_*` method to this Scheduler (AFTER `Scheduler.__init__`)."""
    import types

    for name, fn in METHODS.items():
        setattr(sched, name, types.MethodType(fn, sched))
    setattr(sched, REPLIES_ATTR, {})


def _gather_json(sched: Any, text: str) -> list[Any]:
    """Every TP rank's reply, in rank order, gathered over the TP CPU group as bytes
    (never pickles): the RPC answer comes from TP rank 0 only."""
    size = _tp(sched)[1]
    if size <= 1:
        return [json.loads(text)]
    import torch.distributed as dist

    group = sched.tp_group.cpu_group
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(bufs, padded, group=group)
    return [json.loads(bytes(b[: int(s.item())].tolist()).decode()) for b, s in zip(bufs, sizes)]


def reply_message(sched: Any, recv_req: Any) -> str | None:
    """The JSON text that replaces `RpcReqOutput.message` for our methods (None for
    other methods, whose replies are left alone)."""
    method = getattr(recv_req, "method", "") or ""
    if not method.startswith(PREFIX):
        return None
    params = getattr(recv_req, "parameters", None) or {}
    call_id = str(params.get("call_id", ""))
    replies = getattr(sched, REPLIES_ATTR, None) or {}
    mine = replies.pop(call_id, None) or {
        "ok": False, "error": f"{method} did not run (unknown method or bad arguments)"}
    workers = _gather_json(sched, json.dumps(mine))
    return json.dumps({"tag": REPLY_TAG, "call_id": call_id, "workers": workers})

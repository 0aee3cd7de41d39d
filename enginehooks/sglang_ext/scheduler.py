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
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ConfigError
from enginehooks.engine.apply import ApplyBinding, ApplyTarget
from enginehooks.engine.contract import PREFIX, VERBS, method_name
from enginehooks.engine.expectations import skeleton_on_meta
from enginehooks.engine.shadow import ShadowParts
from enginehooks.engine.side import EngineSide
from enginehooks.engine.verify import ensure_room

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


def mm_embedding_cache() -> Any:
    """SGLang's multimodal embedding cache of this process (`mm_schedule.embedding_cache`:
    vision-encoder outputs keyed by the input's hash), or None where this SGLang has none."""
    try:
        from sglang.srt.managers import mm_schedule
    except ImportError:
        return None
    return getattr(mm_schedule, "embedding_cache", None)


def drop_stale_caches(sched: Any, device: torch.device) -> bool:
    """Drop every cache SGLang 0.5.23 derives from the weights (read in its source):

    - the multimodal embedding cache (`mm_embedding_cache`): encoder outputs of the old
      vision tower, reused for the same image otherwise; SGLang's own `flush_cache`
      leaves it, and its weight updates do not touch it. Cleared always (an entry a
      running request needs again is recomputed on a miss);
    - the radix (prefix) cache and the KV pools, and a speculative draft's cache pool:
      `Scheduler.flush_cache`, which refuses while requests run (returns False).

    SGLang's tokenizer-side caches hold processor outputs (pixel values, token ids),
    which do not depend on the weights."""
    cache = mm_embedding_cache()
    if cache is not None:
        cache.clear()
    flush_cache = sched.flush_cache
    return bool(flush_cache(**flush_kwargs(flush_cache, device)))


def _device(sched: Any) -> torch.device:
    mr = _model_runner(sched)
    kind = str(getattr(mr, "device", "cpu"))
    if kind.startswith("cuda") and ":" not in kind:
        return torch.device("cuda", int(getattr(mr, "gpu_id", 0)))
    return torch.device(kind)


class SGLangTarget(ApplyTarget):
    """Applies received tensors with the model's own `load_weights`, inside SGLang's
    weight-update session; then flushes the cache and records the version. Updates are
    verified against a fresh-load shadow (`engine.verify`) as the policy asks. Once a
    copy plan is recorded and verified (`engine.copy_plan`), planned tensors are written
    straight into the parameters inside the same session, and only the rest goes
    through `load_weights`. The apply routine itself is `engine.apply.ApplyTarget`'s;
    what is SGLang's is below."""

    engine = "SGLang"
    # MiniCPM3's loader removes `kv_b_proj` from the live model (`engine.transplant`)
    loader_may_remove = True

    def __init__(self, sched: Any) -> None:
        super().__init__(_device(sched))
        self.sched = sched

    def model(self) -> torch.nn.Module:
        return _model_runner(self.sched).model

    def checkpoint_dir(self) -> str:
        mr = _model_runner(self.sched)
        return str(getattr(self.sched.server_args, "model_path", None)
                   or mr.model_config.model_path)

    def skeleton(self) -> torch.nn.Module:
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

    def begin(self) -> None:
        _model_runner(self.sched).weight_updater.begin_weight_update()

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        # `load_weights` copies each tensor into its (fused) parameter as it goes,
        # so views into the transport's reusable buffers are safe to pass through.
        with torch.no_grad():
            self.model().load_weights(weights)  # type: ignore[operator]

    def end(self) -> None:
        # After a load, SGLang's own request path ends with run_post_load=False
        # (post-load already ran inside load_weights where the model needs it).
        # Always end the session, even after a failed load, so the model's
        # repacked / quantised weights are put back in their serving layout.
        _model_runner(self.sched).weight_updater.end_weight_update(run_post_load=False)

    def fresh_load(self, weights: list[tuple[str, torch.Tensor]],
                   before_processing: Callable[[torch.nn.Module], None] | None = None
                   ) -> torch.nn.Module:
        """SGLang's fresh-load path on `weights`: the model class built as its loader
        builds it, then `DefaultModelLoader.load_weights_and_postprocess` (in its two
        halves, `before_processing(model)` between them: the copy plan's check), through
        the same three steps the streamed shadow takes (`shadow_parts`)."""
        parts = self.shadow_parts()
        ensure_room(self.device, sum(t.nbytes for _, t in weights))
        model = parts.build()
        parts.load(model, weights)
        if before_processing is not None:
            before_processing(model)
        parts.process(model)
        return model

    def shadow_parts(self) -> ShadowParts:
        """`fresh_load` in its three steps, for the streamed shadow (`engine.shadow`):
        SGLang's `_initialize_model`, `DefaultModelLoader.load_weights_only`, then its
        `postprocess_weights`, in the dtype context `fresh_load` gives them."""
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
        device, dtype = self.device, mr.model_config.dtype

        def build() -> torch.nn.Module:
            with set_default_torch_dtype(dtype), device:
                return _initialize_model(mr.model_config, load_config, quant)

        def load(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
            with set_default_torch_dtype(dtype):
                DefaultModelLoader.load_weights_only(model, iter(weights), device)

        def process(model: torch.nn.Module) -> None:
            with set_default_torch_dtype(dtype):
                DefaultModelLoader.postprocess_weights(model, device)

        return ShadowParts(build, load, process, self.lands, device)

    # `load_path` stays False (the default): SGLang's reload-from-disk rewrites the
    # runner's model_path to the update's folder (which the disk transport later
    # prunes) and needs a full HF folder; streaming the verified shards through
    # `apply` uses the same loader instead.


class SGLangBinding(ApplyBinding):
    """What an SGLang scheduler (one TP rank) supplies to the engine contract."""

    engine = "sglang"

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        rank = _tp(sched)[0]
        # The state, readable on the host without an RPC (which would queue behind
        # the update this scheduler is applying).
        super().__init__(SGLangTarget(sched), rank, beacon=f"sglang-tp{rank}")

    def dtype(self) -> str:
        return dtype_name(_model_runner(self.sched).model_config.dtype)

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
        """Drop what the new weights make stale (`drop_stale_caches`); True when the
        prefix cache went too (SGLang refuses that while requests run)."""
        return drop_stale_caches(self.sched, self._target.device)

    def info(self) -> dict[str, Any]:
        from sglang.srt.runtime_context import get_serving

        cache = mm_embedding_cache()
        return {"engine_weight_version": get_serving().weight_version,
                # entries of the multimodal embedding cache (emptied by every update)
                "mm_embedding_cache": len(cache) if cache is not None else None,
                **super().info()}

    def state_changed(self, state: dict[str, Any]) -> None:
        super().state_changed(state)
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

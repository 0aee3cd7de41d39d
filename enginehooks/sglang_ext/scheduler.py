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
from collections.abc import Iterator
from typing import Any

import torch

from enginehooks.checkpoint import checkpoint_specs, readable_digests, resolve_model_dir
from enginehooks.dtypes import dtype_name
from enginehooks.engine_side import EngineSide
from enginehooks.manifest import TensorSpec

log = logging.getLogger("enginehooks.sglang")

#: Scheduler attribute names this plugin adds (everything else of SGLang is untouched).
STATE_ATTR = "_enginehooks_side"
REPLIES_ATTR = "_enginehooks_replies"
RPC_PREFIX = "enginehooks_"
#: Marks an `RpcReqOutput.message` written by us, so clients never mistake another
#: RPC's reply (or a stale one) for theirs.
REPLY_TAG = "enginehooks-reply/1"


def _model_runner(sched: Any) -> Any:
    return sched.tp_worker.model_runner


def _tp(sched: Any) -> tuple[int, int]:
    return int(getattr(sched, "tp_rank", 0) or 0), int(getattr(sched, "tp_size", 1) or 1)


def _device(sched: Any) -> torch.device:
    mr = _model_runner(sched)
    kind = str(getattr(mr, "device", "cpu"))
    if kind.startswith("cuda") and ":" not in kind:
        return torch.device("cuda", int(getattr(mr, "gpu_id", 0)))
    return torch.device(kind)


class SGLangTarget:
    """Applies received tensors with the model's own `load_weights`, inside SGLang's
    weight-update session; then flushes the cache and records the version."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.device = _device(sched)
        self.flushed: bool | None = None

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        mr = _model_runner(self.sched)
        updater = mr.weight_updater
        model = mr.model
        updater.begin_weight_update()
        try:
            # `load_weights` copies each tensor into its (fused) parameter as it goes,
            # so views into the transport's reusable buffers are safe to pass through.
            model.load_weights(tensors)
        finally:
            # After a load, SGLang's own request path ends with run_post_load=False
            # (post-load already ran inside load_weights where the model needs it).
            # Always end the session, even after a failed load, so the model's
            # repacked / quantised weights are put back in their serving layout.
            updater.end_weight_update(run_post_load=False)

    def load_path(self, path: str) -> bool:
        # SGLang's reload-from-disk rewrites the runner's model_path to the update's
        # folder (which the disk transport later prunes) and needs a full HF folder;
        # streaming the verified shards through `apply` uses the same loader instead.
        return False


class SchedulerExtension:
    """The methods attached to SGLang's Scheduler (as `enginehooks_<verb>`); `self`
    is the Scheduler. Kept as a class only to group them; never instantiated."""

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def side(sched: Any) -> EngineSide:
        side = getattr(sched, STATE_ATTR, None)
        if side is None:
            target = SGLangTarget(sched)
            side = EngineSide(
                target, lambda: SchedulerExtension.expected(sched),
                device=target.device, worker_rank=_tp(sched)[0],
            )
            setattr(sched, STATE_ATTR, side)
        return side

    @staticmethod
    def dtype(sched: Any) -> str:
        return dtype_name(_model_runner(sched).model_config.dtype)

    @staticmethod
    def expected(sched: Any) -> dict[str, TensorSpec]:
        """HF-format tensors an update must carry: read from the checkpoint the engine
        loaded (SGLang fuses qkv / gate_up, so its own parameters do not say)."""
        mc = _model_runner(sched).model_config
        tie = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
        path = getattr(sched.server_args, "model_path", None) or mc.model_path
        return checkpoint_specs(resolve_model_dir(path), engine_dtype=SchedulerExtension.dtype(sched),
                                tie_word_embeddings=tie)

    # -- verbs (JSON in, JSON out) ------------------------------------------------------
    @staticmethod
    def info(sched: Any) -> dict[str, Any]:
        info = SchedulerExtension.side(sched).info()
        info["dtype"] = SchedulerExtension.dtype(sched)
        info["engine"] = "sglang"
        from sglang.srt.runtime_context import get_serving

        info["engine_weight_version"] = get_serving().weight_version
        return info

    @staticmethod
    def join(sched: Any, endpoint: str, rank_offset: int | str) -> dict[str, Any]:
        side = SchedulerExtension.side(sched)
        side.expected()  # read the checkpoint layout now, before an update could move it
        return side.join(endpoint, int(rank_offset) + side.worker_rank)

    @staticmethod
    def leave(sched: Any) -> dict[str, Any]:
        SchedulerExtension.side(sched).leave()
        return {"left": True}

    @staticmethod
    def check(sched: Any, manifest: str) -> list[str]:
        return SchedulerExtension.side(sched).check(manifest)

    @staticmethod
    def receive(sched: Any, manifest: str) -> dict[str, Any]:
        side = SchedulerExtension.side(sched)
        stats = side.receive(manifest)
        # The RPC runs inside the scheduler's event loop, so no batch runs now: this is
        # the moment a flush can succeed (it refuses while requests are in flight,
        # which a paused engine has none of, in abort / retract mode).
        stats["flushed"] = bool(sched.flush_cache())
        sched.record_weight_version_change(new_version=str(stats["version"]))
        return stats

    @staticmethod
    def flush(sched: Any) -> dict[str, Any]:
        return {"flushed": bool(sched.flush_cache())}

    @staticmethod
    def digests(sched: Any, names: str) -> dict[str, Any]:
        """crc32 of parameters SGLang keeps in checkpoint layout (embeddings, norms;
        qkv / gate_up are fused), for bit-exact checks without moving tensors."""
        wanted = json.loads(names) if isinstance(names, str) else list(names)
        params = dict(_model_runner(sched).model.named_parameters())
        return readable_digests(params, SchedulerExtension.side(sched).expected(), wanted)


#: verb -> (callable, number of positional args it takes)
VERBS: dict[str, Any] = {
    "info": SchedulerExtension.info,
    "join": SchedulerExtension.join,
    "leave": SchedulerExtension.leave,
    "check": SchedulerExtension.check,
    "receive": SchedulerExtension.receive,
    "flush": SchedulerExtension.flush,
    "digests": SchedulerExtension.digests,
}


def _make_method(verb: str, fn: Any) -> Any:
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
            result = fn(self, *parsed)
            reply = {"ok": True, "result": json.loads(json.dumps(result, default=str))}
        except Exception as e:
            log.error("enginehooks_%s failed:\n%s", verb, traceback.format_exc())
            replies[call_id] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            raise
        replies[call_id] = reply

    method.__name__ = f"{RPC_PREFIX}{verb}"
    method.__qualname__ = f"Scheduler.{RPC_PREFIX}{verb}"
    return method


METHODS: dict[str, Any] = {f"{RPC_PREFIX}{v}": _make_method(v, fn) for v, fn in VERBS.items()}


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
    if not method.startswith(RPC_PREFIX):
        return None
    params = getattr(recv_req, "parameters", None) or {}
    call_id = str(params.get("call_id", ""))
    replies = getattr(sched, REPLIES_ATTR, None) or {}
    mine = replies.pop(call_id, None) or {
        "ok": False, "error": f"{method} did not run (unknown method or bad arguments)"}
    workers = _gather_json(sched, json.dumps(mine))
    return json.dumps({"tag": REPLY_TAG, "call_id": call_id, "workers": workers})

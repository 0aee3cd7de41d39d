"""Post-load processing on a fresh twin of each layer, its products moved into the live one.

An engine that processes a layer after its weights load (oneDNN prepacking on CPU, MoE
repacking, quantisation) runs that processing again on the live layer at every update:
the same module object, holding what the last processing left (its packed handles,
flags, converted biases). Where that processing is not safe to run twice, the update is
wrong in ways only a comparison with a fresh load finds; and verifying it means
processing the layer a second time, on the shadow (`engine.shadow`), which on vLLM CPU
is most of what a verified push costs (the prepack is done twice, then both handles are
probed).

A twin is the same layer from the engine's own model class, constructed fresh (on the
meta device, the shadow's `construct`), never processed. Handed the live layer's
loader-layout tensors (what the update wrote, in the loader's layout: the live layer
will not process them itself), the engine's processing of that layer runs on the twin
as on a layer of a fresh load; what it
produced (the tensors it left, the attributes it set or rebound) is then moved into the
live layer, which the engine's code then finishes as it would have after processing it
(vLLM copies the processed tensors into the kernel tensors its graphs hold).

What is moved must stand on its own: a product that refers to a module (a bound method,
a closure over the twin) would keep the twin alive and serve from it, so where any does
the live layer is processed as before. The twin stays as it was processed until the
update is verified: `verify` then compares the live layer with it (a moved callable is
the twin's own object, equal by identity, no probe; tensors are compared as always), in
place of a shadow unit the verification would otherwise build, load and process again.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import types
import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch

from enginehooks.engine.shadow import _collect_if_held, _drop, _move, construct
from enginehooks.engine.verify import _MODULE_STATE

log = logging.getLogger("enginehooks.verify")

TWIN_ENV = "ENGINEHOOKS_TWIN"
#: `on` (default): verified updates in the copy plan's steady state process planned
#: layers on twins; `off`: on the live layers, and the verification builds its shadow
TWIN_MODES = ("on", "off")

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_OPS = (torch._ops.OpOverloadPacket, torch._ops.OpOverload)


def _recast(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of `t` is exactly one of `dtype` (floating both): a live
    loader-layout tensor held wider than the fresh model's (vLLM CPU restores a small
    linear's bias in float32 on AMX hosts) whose bytes, cast back, are exactly what a
    fresh load's loader wrote there from the same update."""
    if not (t.is_floating_point() and dtype.is_floating_point):
        return False
    return bool(torch.equal(t.to(dtype).to(t.dtype), t))


def twin_mode() -> str:
    """`ENGINEHOOKS_TWIN`: "on" (the default) or "off"; anything else is logged and
    taken as "off" (the live layers process themselves, as they always could)."""
    raw = os.environ.get(TWIN_ENV, "on").strip().lower()
    if raw in TWIN_MODES:
        return raw
    if raw not in _WARNED:
        _WARNED.add(raw)
        log.warning("%s=%r is not one of %s: twins are off", TWIN_ENV, raw,
                    "/".join(TWIN_MODES))
    return "off"


_WARNED: set[str] = set()


def movable(value: Any, twin: Collection[int] = (), depth: int = 0) -> bool:
    """Whether `value`, a product of processing, can serve from the live layer: a tensor
    of its own, a plain value, an engine's object (a packed handle), or a function,
    partial or container holding only such (looked into four levels deep, an object's
    attributes too; an object without a `__dict__`, a C++ one, is taken as it is). Never
    a module, a method bound to anything, or anything reaching one of the twin's own
    tensors (`twin`: their ids): the live layer would keep serving from the twin."""
    if depth > 4:
        return False
    if isinstance(value, torch.Tensor):
        return id(value) not in twin
    if isinstance(value, (*_PLAIN, type)):
        return True
    if isinstance(value, (torch.nn.Module, types.MethodType)):
        return False
    deeper = depth + 1
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(movable(v, twin, deeper) for v in value)
    if isinstance(value, dict):
        return all(movable(v, twin, deeper) for v in value.values())
    if isinstance(value, functools.partial):
        return (movable(value.func, twin, deeper) and movable(value.args, twin, deeper)
                and movable(value.keywords, twin, deeper))
    if isinstance(value, types.FunctionType):
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        return all(movable(v, twin, deeper) for v in (*cells, *(value.__defaults__ or ())))
    if isinstance(value, _OPS):  # an operator of torch's registry (a handle's destructor)
        return True
    if isinstance(value, types.BuiltinFunctionType):
        owner = getattr(value, "__self__", None)
        return (owner is None or isinstance(owner, types.ModuleType)
                or movable(owner, twin, deeper))
    attrs = getattr(value, "__dict__", None)  # an engine's object: what it holds
    return attrs is None or movable(dict(attrs), twin, deeper)


class TwinLayers:
    """The twins of one update's planned layers: built (`construct`) once per update,
    each processed when its live layer is complete (`process`), kept until the update
    is verified (`model`, `moved`, `kept_live`), then dropped (`drop`).

    `build`: the engine's model class as its fresh load constructs it (parameters on the
    meta device as they register); `live`: the live model."""

    def __init__(self, build: Callable[[], torch.nn.Module], live: torch.nn.Module) -> None:
        t0 = time.perf_counter()
        #: modules the engine shares between its models (a cached rotary embedding):
        #: the live model's, never dropped with the twins
        self.live_ids = {id(m) for m in live.modules()}
        self.model: torch.nn.Module | None = construct(build)
        self.modules = dict(self.model.named_modules())
        #: layers whose twin's products now serve in the live layer
        self.moved: set[str] = set()
        #: layers processed on their twin but served by the live layer's own processing
        #: (a product that could not be moved): the twin is still their fresh load
        self.kept_live: set[str] = set()
        #: layers not moved, and why
        self.refused: dict[str, str] = {}
        self.seconds = {"twin_construct": time.perf_counter() - t0, "twin_hand_over": 0.0,
                        "twin_process": 0.0}

    def process(self, mname: str, live: torch.nn.Module,
                run: Callable[[torch.nn.Module], None], tied: bool = False) -> bool:
        """Process the twin of live layer `mname` (complete, in the loader's layout) with
        `run` (the engine's processing of one layer) and move its products into `live`.
        True when moved (the live layer needs no processing of its own); False where it
        must process itself (no twin of that class and layout, or a product that cannot
        move; the twin is then still kept as its fresh load where it was processed).

        The live layer's loader-layout tensors are handed to the twin, not copied: once
        moved the live layer holds the twin's products, and where it processes itself
        after all, the check compares it with the twin and repairs it from there.
        `tied`: every tensor of the layer is another layer's (a tied output head,
        processed after its owner): only what processing set besides its tensors moves,
        and where processing replaced a tensor of it, the live layer processes itself."""
        twin = self.modules.get(mname)
        if twin is None or type(twin) is not type(live):
            self.refused[mname] = "no twin of its class"
            return False
        mine = {k: t for k, t in (*live._parameters.items(), *live._buffers.items())
                if t is not None}
        theirs = {k: t for k, t in (*twin._parameters.items(), *twin._buffers.items())
                  if t is not None}
        wrong = [k for k, t in mine.items() if k not in theirs or t.shape != theirs[k].shape
                 or (t.dtype != theirs[k].dtype and not _recast(t, theirs[k].dtype))]
        if mine.keys() != theirs.keys() or wrong:
            self.refused[mname] = "not the twin's layout: " + ", ".join(
                f"{k} {tuple(t.shape)} {t.dtype}" + (
                    f" (twin {tuple(theirs[k].shape)} {theirs[k].dtype})" if k in theirs else "")
                for k, t in mine.items() if k in wrong)[:200]
            return False
        if tied and any(t.is_meta for t in theirs.values()):
            self.refused[mname] = "its owner's twin was not processed"
            return False  # its owner's twin was not processed: nothing of the live one's
            # (the owner's kernel tensors) is ever handed to a twin
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for k, t in mine.items():
                    p = theirs[k]
                    if p.is_meta:  # handed over: the live layer will not process them
                        _move(p, t.device, t.detach() if t.dtype == p.dtype
                              else t.detach().to(p.dtype))
                    elif not tied:
                        p.copy_(t)
                    # (tied: the twin's own, which the twin owning it was given and
                    # processed, as a fresh load processes the owner before the module
                    # sharing it)
        except Exception as e:  # a twin tensor something else holds (a view of it: vLLM's
            # Mamba mixers alias their conv weight), which `_move` cannot swap in place:
            # half handed over, never compared against; the live layer processes itself
            log.info("%s: its twin could not be handed the live tensors (%s: %s): processed "
                     "in place", mname, type(e).__name__, e)
            self.modules.pop(mname, None)
            self.refused[mname] = f"hand-over failed: {type(e).__name__}"
            return False
        t1 = time.perf_counter()
        before = dict(vars(twin))
        try:
            run(twin)
        except Exception as e:  # the live layer processes itself; its check takes a shadow
            log.info("%s: processing its twin failed (%s: %s): processed in place", mname,
                     type(e).__name__, e)
            self.modules.pop(mname, None)  # half processed: never compared against
            self.refused[mname] = f"processing raised {type(e).__name__}"
            return False
        t2 = time.perf_counter()
        self.seconds["twin_hand_over"] += t1 - t0
        self.seconds["twin_process"] += t2 - t1
        after = vars(twin)
        products = {k: v for k, v in after.items()
                    if k not in _MODULE_STATE and (k not in before or before[k] is not v)}
        removed = [k for k in before if k not in after]
        now = {k: t for k, t in (*twin._parameters.items(), *twin._buffers.items())
               if t is not None}
        if tied and (now.keys() != theirs.keys()
                     or any(now[k] is not t for k, t in theirs.items())):
            self.kept_live.add(mname)  # its tensors replaced: not the owner's any more
            self.refused[mname] = "processing replaced the owner's tensors"
            return False
        # a moved product must not reach the twin's tensors (moved tensors are the
        # live layer's own from here on: vLLM copies them into its kernel tensors)
        owned = {id(t) for t in now.values()}
        wrong = sorted(k for k, v in products.items() if not movable(v, owned))
        if wrong:
            log.info("%s: products of processing its twin cannot move (%s): processed in "
                     "place", mname, wrong)
            self.kept_live.add(mname)
            self.refused[mname] = f"products reach the twin: {wrong[:3]}"
            return False
        for own in ("_parameters", "_buffers") if not tied else ():
            mine_d, theirs_d = getattr(live, own), getattr(twin, own)
            for k in [k for k in mine_d if k not in theirs_d]:
                del mine_d[k]
            mine_d.update(theirs_d)
        if not tied:
            live._non_persistent_buffers_set = set(twin._non_persistent_buffers_set)
        for k in removed:
            live.__dict__.pop(k, None)
        live.__dict__.update(products)
        self.moved.add(mname)
        return True

    def processed(self) -> set[str]:
        """Layers whose twin was processed: the fresh load of each, kept for the check."""
        return self.moved | self.kept_live

    def drop(self) -> None:
        """Release the twins, as the streamed shadow releases a unit (`shadow._drop`: the
        modules reference each other through their parameters' loaders, so the tensors
        are dropped at once, not left to the collector; modules the engine shares with
        the live model are left alone)."""
        model, self.model = self.model, None
        if model is None:
            return
        released: list[weakref.ref[torch.Tensor]] = []
        _drop(model, self.live_ids, released)
        self.modules = {}
        _collect_if_held(released, TwinLayers)

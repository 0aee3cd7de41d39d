"""A fresh-load shadow streamed unit by unit: its memory bounded by one layer.

Verification (`engine.verify`) compares the live model with a **shadow**, the engine's
own model class loaded from the same update by the engine's own fresh-load path. Built
whole, the shadow is a second model: on an accelerator whose memory the KV cache holds
it rarely fits. So the shadow is streamed instead, one **unit** at a time:

- the engine's model class is constructed once, exactly as the engine constructs it,
  with every parameter moved to the meta device as it is registered (a global parameter
  registration hook moves each to meta in place, the same object of the same class and
  attributes: at most one parameter is real at any time of the construction). Buffers stay as constructed (a
  rotary cache is computed there, small);
- a unit is an element of the model's first-level `ModuleList`s (a decoder layer), and
  the **rest** (embeddings, final norm, output head, and every ancestor) is one more;
- for each unit holding a touched module that the digests did not prove, only that
  unit is in the model tree (the other elements of its list are hidden for the moment),
  its parameters are made real on the engine's device, the update's tensors that the
  loader dry run says land there are loaded through the engine's own loader, then the
  engine's own post-load processing runs over the tree as it stands (the engine's
  function, on the model: its per-module steps see this unit's modules only); the unit
  is compared and repaired, then its tensors are dropped before the next one.

What the engine's loader and processing do is theirs; what is ours is only which
modules are in the tree at a time. That is exact where post-load processing is local
to a module below the first list (per-module quantisation and repacking, attention's
own step), and it is checked rather than assumed where it could not be: the shadow is
built whole instead (`Unstreamable`) when an update tensor lands in no known place or
in more than one unit, when a parameter is shared between units, or when an ancestor
of the units holds tensors of its own in the live model (something derived across
layers).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("enginehooks.verify")

SHADOW_ENV = "ENGINEHOOKS_SHADOW"
#: `streamed` (default): unit by unit; `whole`: a second model at once (the old way,
#: kept to measure against and as the fallback)
SHADOW_MODES = ("streamed", "whole")
REST = ""  # the unit of everything outside the first-level lists


def shadow_mode() -> str:
    mode = os.environ.get(SHADOW_ENV, "streamed").strip().lower()
    return mode if mode in SHADOW_MODES else "streamed"


class Unstreamable(Exception):
    """The shadow cannot be streamed exactly for this model or update: build it whole."""


@dataclass
class ShadowParts:
    """The engine's fresh-load path in its three steps, each the engine's own code:

    - `build()`: the model class constructed as the engine constructs it, on its device
      (parameters are moved to meta as they are registered, see `construct`);
    - `load(model, weights)`: the engine's loader on `weights`;
    - `process(model)`: the engine's post-load processing of `model`;
    - `lands(names)`: where each update tensor lands (live parameter names), from the
      engine's loader dry run, or None for a tensor whose landing is unknown.
    """

    build: Callable[[], torch.nn.Module]
    load: Callable[[torch.nn.Module, list[tuple[str, torch.Tensor]]], None]
    process: Callable[[torch.nn.Module], None]
    lands: Callable[[Sequence[tuple[str, torch.Tensor]]], Mapping[str, Collection[str] | None]]
    device: torch.device


def _move(p: torch.Tensor, device: torch.device | str, data: torch.Tensor | None = None) -> None:
    """Turn parameter `p` into an empty one on `device` (or one on `data`'s storage), in
    place: the same object (so every reference the engine's code holds, ties between
    modules, and attributes it sets on it later, such as `weight_loader` after
    registering it, all follow), of its own class, with its attributes."""
    twin = torch.Tensor._make_subclass(
        type(p), torch.empty_like(p, device=device) if data is None else data, p.requires_grad)
    twin.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, twin)


def construct(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The engine's model class built by `build`, every parameter on the meta device:
    each is moved there as it is registered, so construction never holds more than one
    real parameter."""
    def on_register(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and not param.is_meta:
            _move(param, "meta")

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(on_register)
    try:
        return build()
    finally:
        handle.remove()


def units(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Unit name -> (the list holding it, its key): the elements of the model's
    first-level `ModuleList`s (lists inside a unit stay part of it)."""
    out: dict[str, tuple[torch.nn.Module, str]] = {}

    def walk(prefix: str, module: torch.nn.Module) -> None:
        for key, child in module.named_children():
            full = f"{prefix}.{key}" if prefix else key
            if isinstance(module, torch.nn.ModuleList):
                out[full] = (module, key)
            else:
                walk(full, child)

    walk("", model)
    return out


def unit_of(name: str, names: Collection[str]) -> str:
    """The unit a module or tensor name belongs to (REST when under none)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in names:
            return prefix
    return REST


def _ancestors(unit_names: Collection[str]) -> set[str]:
    out: set[str] = set()
    for u in unit_names:
        parts = u.split(".")
        out.update(".".join(parts[:i]) for i in range(len(parts)))
    return out


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct real storages `model` holds as parameters and buffers."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t is None or t.is_meta:
            continue
        try:
            s = t.untyped_storage()
            key = s.data_ptr()
        except Exception:
            continue
        if key and key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


#: set on a whole shadow's model by the engine's `before_processing` hook: the bytes
#: its loader left (after processing, CPU prepacking holds them where no tensor shows)
LOADED_ATTR = "_enginehooks_loaded_bytes"


def mark_loaded(model: torch.nn.Module) -> None:
    """Record on `model` the bytes of tensors it holds now (`held_bytes`): called
    between the loader and post-load processing of a whole shadow."""
    setattr(model, LOADED_ATTR, held_bytes(model))


class PeakMemory:
    """The most device memory the shadow added at once, where the allocator tracks it
    (CUDA: its peak above what was allocated before); None on the host, where freed
    memory the process keeps resident hides new allocations from any measure short of
    the allocator's (what the shadow held is then `Verdict.shadow_tensor_bytes`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base: int | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)

    def peak(self) -> int | None:
        if self.base is None:
            return None
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)


@contextmanager
def _only(slots: Mapping[str, tuple[torch.nn.Module, str, torch.nn.Module]],
          keep: Collection[str]) -> Iterator[None]:
    """The shadow's tree with every slot (parent, key, child) emptied but those in
    `keep`, put back after (the shadow is never run, so the order of children does not
    matter)."""
    try:
        for name, (parent, key, _) in slots.items():
            if name not in keep:
                del parent._modules[key]
        yield
    finally:
        for parent, key, child in slots.values():
            parent._modules[key] = child


def _slots(model: torch.nn.Module, unit_names: Collection[str]
           ) -> dict[str, tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Every unit, and every subtree of the rest hanging off an ancestor of the units
    (embeddings, final norm, output head), as (parent, key, child) by full name. Order
    of the parents' children is kept when restored (a `ModuleList` indexes by key)."""
    ancestors = _ancestors(unit_names)
    out: dict[str, tuple[torch.nn.Module, str, torch.nn.Module]] = {}
    for aname, module in model.named_modules():
        if aname not in ancestors:
            continue
        for key, child in module._modules.items():
            full = f"{aname}.{key}" if aname else key
            if child is not None and full not in ancestors:
                out[full] = (module, key, child)
    return out


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Every meta parameter of the tree as it stands made real (empty) on `device`, in
    place (tied ones are one object: made real once)."""
    for p in model.parameters():
        if p.is_meta:
            _move(p, device)


def _drop(root: torch.nn.Module, live_ids: Collection[int],
          released: list[weakref.ref[torch.Tensor]]) -> None:
    """Drop the tensors and callables a processed unit holds (its modules reference each
    other through their parameters' loaders, so waiting for the garbage collector would
    keep every unit alive at once); modules the live model shares (an engine's cached
    rotary embedding) are left alone. `released`: where a weak reference to each tensor
    dropped is added (`_collect_if_held`)."""
    for m in list(root.modules()):
        if id(m) in live_ids:
            continue
        released.extend(weakref.ref(t) for own in (m._parameters, m._buffers)
                        for t in own.values() if t is not None)
        m._parameters.clear()
        m._buffers.clear()
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) or (callable(v) and not isinstance(v, torch.nn.Module)
                                                and not isinstance(v, type)):
                if isinstance(v, torch.Tensor):
                    released.append(weakref.ref(v))
                with suppress(AttributeError):
                    delattr(m, k)


#: per live model class: what a full collection left alive of a shadow's dropped tensors
#: (shape, dtype, device of each) the last time it freed none of them
_UNFREED: dict[type, tuple[tuple[Any, ...], ...]] = {}


def _collect_if_held(released: list[weakref.ref[torch.Tensor]], key: type) -> bool:
    """A full garbage collection where a tensor the shadow dropped is still alive (a
    reference cycle may hold it), so that its memory is back before the next update.
    None where every one was freed when dropped, and none where the same tensors stayed
    alive through a collection last time for this model class (something live holds
    them, a tied weight say: a collection frees nothing there). A full collection costs
    what the process holds, not what the shadow held: ~0.4 s in a vLLM worker on CPU,
    most of a verified push's shadow time (`shadow_drop`), freeing nothing each time.
    Returns whether it collected."""
    def left() -> tuple[tuple[Any, ...], ...]:
        return tuple(sorted((tuple(t.shape), str(t.dtype), str(t.device))
                            for t in (r() for r in released) if t is not None))

    alive = left()
    if not alive or _UNFREED.get(key) == alive:
        return False
    gc.collect()
    if left() == alive:
        _UNFREED[key] = alive  # it freed none: not again while the same stay alive
    else:
        _UNFREED.pop(key, None)
    return True


class Timers(dict[str, float]):
    """Seconds per step, summed over units: where a streamed shadow's time goes
    (`construct`, `load`, `process`, `drop`), reported in the verdict's `seconds`."""

    @contextmanager
    def time(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[key] = self.get(key, 0.0) + time.perf_counter() - t0


@dataclass
class Pass:
    """One unit of the streamed shadow, loaded and processed: compare the modules named
    in `modules` of `model` with the live model's."""

    unit: str
    modules: set[str]
    model: torch.nn.Module
    loaded_bytes: int
    #: the stream's timers so far (the same object in every pass: its totals at the end)
    timers: Timers = field(default_factory=lambda: Timers())


def stream(parts: ShadowParts, weights: list[tuple[str, torch.Tensor]], live: torch.nn.Module,
           needed: Collection[str], readable: Callable[[torch.nn.Module], Mapping[str, Any]],
           before_processing: Callable[[torch.nn.Module, list[tuple[str, torch.Tensor]]], None]
           | None = None, timers: Timers | None = None) -> Iterator[Pass]:
    """The shadow, one unit at a time, for the units holding a module of `needed` (the
    touched modules left to the shadow). Raises `Unstreamable` before loading anything
    where streaming would not be exactly a fresh load. `readable(module)`: the tensors
    a module itself holds that a forward can read (`verify.readable_tensors`).
    `before_processing(model, unit_weights)`: called after each unit's load, before its
    processing (the copy plan's check of what the loader alone wrote). `timers`: where
    the time goes, step by step."""
    timers = timers if timers is not None else Timers()
    with timers.time("lands"):
        lands = parts.lands(weights)
    with timers.time("construct"):
        model = construct(parts.build)
    found = units(model)
    if not found:
        raise Unstreamable("the model has no list of layers")
    names = set(found)
    live_modules = dict(live.named_modules())
    for anc in sorted(_ancestors(names)):
        m = live_modules.get(anc)
        if m is not None and readable(m):
            raise Unstreamable(f"{anc or '<root>'} holds tensors of its own")
    owners: dict[int, set[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta:  # (a real one is the live model's: an engine's cached module)
            owners.setdefault(id(p), set()).add(unit_of(pname, names))
    if any(len(u) > 1 for u in owners.values()):
        raise Unstreamable("a parameter is shared between units")
    by_unit: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in weights:
        dests = lands.get(name)
        where = {unit_of(d, names) for d in dests} if dests else set()
        if len(where) != 1:
            raise Unstreamable(f"{name} lands in {sorted(where) or 'no known place'}")
        by_unit.setdefault(where.pop(), []).append((name, t))
    order = list(found)
    todo = sorted({unit_of(m, names) for m in needed},
                  key=lambda u: (u == REST, order.index(u) if u in found else 0))
    slots = _slots(model, names)
    rest = [s for s in slots if s not in found]
    live_ids = {id(m) for m in live.modules()}
    all_modules = dict(model.named_modules())
    released: list[weakref.ref[torch.Tensor]] = []  # what `_drop` dropped
    try:
        for u in todo:
            with _only(slots, [u] if u != REST else rest):
                with timers.time("load"):
                    _materialize(model, parts.device)
                    parts.load(model, by_unit.get(u, []))
                    loaded = held_bytes(model)
                if before_processing is not None:
                    before_processing(model, by_unit.get(u, []))
                with timers.time("process"):
                    parts.process(model)
                mods = {n for n in all_modules if unit_of(n, names) == u}
                yield Pass(u, mods, model, loaded, timers)
                with timers.time("drop"):
                    for s in ([u] if u != REST else rest):
                        _drop(slots[s][2], live_ids, released)
    finally:
        with timers.time("drop"):
            _drop(model, live_ids, released)
            del model, all_modules, slots
            _collect_if_held(released, type(live))

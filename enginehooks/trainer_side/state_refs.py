"""Where each entry of a sharded model's `state_dict()` lives, so that a later push can
read the same tensors without walking every module again.

Why: `state_dict()` visits every module, runs its hooks and `detach()`es every tensor
(through DTensor's dispatch for FSDP2: ~20-40 us a tensor). On the colocated GPU path a
push of a 5.9 GB model costs about 4 ms of device copy, and the walk alone cost 3 ms of
host time per push before the first byte moved (`docs/benchmarks.md`, issue 37).

What a reuse must prove, per push, is that `state_dict()` would hand out the same
tensors again:
- the module tree is the one walked: every child is still registered under its name on
  its parent, and no module gained or lost a parameter, a buffer, a child or a
  state-dict hook (each module's fingerprint: those counts and the hooks' handle ids);
- every entry's registered object is the object registered when the map was built
  (identity), with the same dtype and shape (`param.data = ...` keeps the object but may
  change both).
FSDP2 registers other objects while a module is unsharded (its pre-save hook reshards
it, which is why the walk cannot simply be skipped), so an unsharded module fails the
check and that push walks the model in full. The map is built only from a
`state_dict()` whose every value is the detached alias of the tensor registered under its
key, with no other entry: a model whose state-dict hooks rename, drop, add or replace
entries never gets a map, and one that gains a hook later loses it.

The map holds weak references only (modules and tensors), so it never keeps a
parameter the trainer dropped alive; it is kept per model object (`state_of`). Its
memos may hold the last push's stream (`StreamRecord`), whose views keep the memory
they view until the next push replaces the record.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_MAPS: weakref.WeakKeyDictionary[nn.Module, StateRefs] = weakref.WeakKeyDictionary()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding `t`'s bytes on this rank (a DTensor's local shard)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


@dataclass
class _Entry:
    key: str
    module: weakref.ref[nn.Module]
    attr: str
    parameter: bool
    tensor: weakref.ref[torch.Tensor]
    dtype: torch.dtype
    shape: torch.Size


def _fingerprint(mod: nn.Module) -> tuple[Any, ...]:
    """What of a module decides what `state_dict()` walks and returns, besides the
    registered objects themselves."""
    return (len(mod._parameters), len(mod._buffers), len(mod._modules),
            len(mod._non_persistent_buffers_set), tuple(mod._state_dict_hooks),
            tuple(mod._state_dict_pre_hooks))


@dataclass
class _Node:
    parent: weakref.ref[nn.Module] | None
    name: str
    module: weakref.ref[nn.Module]
    fingerprint: tuple[Any, ...]


@dataclass
class StateRefs:
    """The registered tensor behind each key of one model's `state_dict()`, in order,
    and the module tree that walk went through."""

    entries: list[_Entry]
    tree: list[_Node]
    #: memos keyed by what else they depend on (e.g. the adapter's layout key per wire
    #: dtype and options); cleared whenever the map is rebuilt
    memos: dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, model: nn.Module, state: Mapping[str, torch.Tensor]) -> StateRefs | None:
        """The map of `state` (`model.state_dict()`, just taken), or None where an entry
        is not the plain alias of a tensor registered on a module under its key."""
        found: dict[str, tuple[nn.Module, str, bool, torch.Tensor]] = {}
        tree: list[_Node] = []

        def walk(mod: nn.Module, stem: str, parent: nn.Module | None, name: str) -> None:
            # the order and the rules of `nn.Module.state_dict`
            tree.append(_Node(None if parent is None else weakref.ref(parent), name,
                              weakref.ref(mod), _fingerprint(mod)))
            for attr, p in mod._parameters.items():
                if p is not None:
                    found.setdefault(stem + attr, (mod, attr, True, p))
            skip = mod._non_persistent_buffers_set
            for attr, b in mod._buffers.items():
                if b is not None and attr not in skip:
                    found.setdefault(stem + attr, (mod, attr, False, b))
            for child_name, child in mod._modules.items():
                if child is not None:
                    walk(child, f"{stem}{child_name}.", mod, child_name)

        walk(model, "", None, "")
        if list(found) != list(state):
            return None
        entries: list[_Entry] = []
        for key, value in state.items():
            mod, attr, is_param, reg = found[key]
            if (value.dtype != reg.dtype or value.shape != reg.shape
                    or local_tensor(value).data_ptr() != local_tensor(reg).data_ptr()):
                return None
            entries.append(_Entry(key, weakref.ref(mod), attr, is_param, weakref.ref(reg),
                                  reg.dtype, reg.shape))
        return cls(entries, tree)

    def current(self) -> dict[str, torch.Tensor] | None:
        """`{key: registered tensor}` if the tree and every entry still hold (module
        docstring), else None (walk the model)."""
        for node in self.tree:
            mod = node.module()
            if mod is None or _fingerprint(mod) != node.fingerprint:
                return None
            if node.parent is not None:
                parent = node.parent()
                if parent is None or parent._modules.get(node.name) is not mod:
                    return None
        out: dict[str, torch.Tensor] = {}
        for e in self.entries:
            mod, want = e.module(), e.tensor()
            if mod is None or want is None:
                return None
            reg = (mod._parameters if e.parameter else mod._buffers).get(e.attr)
            if reg is not want or reg.dtype != e.dtype or reg.shape != e.shape:
                return None
            out[e.key] = reg
        return out


def state_of(model: nn.Module) -> tuple[dict[str, torch.Tensor], StateRefs | None]:
    """The model's state-dict tensors, through the kept map where it still holds, else
    through `state_dict()` (and a new map). The map comes back for its memos (None: the
    model's state dict cannot be mapped)."""
    refs = _MAPS.get(model)
    if refs is not None:
        state = refs.current()
        if state is not None:
            return state, refs
    state = model.state_dict()
    refs = StateRefs.build(model, state)
    if refs is None:
        _MAPS.pop(model, None)
    else:
        _MAPS[model] = refs
    return state, refs


@dataclass
class StreamRecord:
    """One push's checkpoint-format stream, kept to be replayed by the next push of the
    same layout, where every tensor it yielded was a view of the model's own memory.

    Why: the checkpoint format is made per push by transformers' conversion (a MoE's
    fused experts cut into thousands of per-expert tensors: ~40 ms of Python per push
    for Qwen3-30B-A3B's widths, 1.3 ms for a dense 7B-wide model), and by the wire cast.
    Where every output is a view of a source (no cast, no copy), the outputs of the next
    push are the same views: their bytes are read when they are sent, so in-place
    training shows through them. A replay is allowed only while each source's local
    tensor still has the address, dtype and shape it had when the views were taken; the
    views keep that memory alive, so the address cannot have been reused by another
    tensor. An output that is not such a view (a cast, a copy, a gathered tensor)
    makes the push unrecorded. The record keeps the viewed memory alive until the next
    push replaces it (at most the model's own memory, which the model holds anyway
    while it is trained in place)."""

    refs: StateRefs
    layout: Any
    key: tuple[Any, ...]
    sources: dict[str, tuple[int, torch.dtype, torch.Size]]
    storages: set[int]
    items: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: how many tensors the stream yields: the record is kept once they all were
    expected: int = -1

    @classmethod
    def start(cls, refs: StateRefs, layout: Any, key: tuple[Any, ...],
              state: Mapping[str, torch.Tensor]) -> StreamRecord:
        sources: dict[str, tuple[int, torch.dtype, torch.Size]] = {}
        storages: set[int] = set()
        for name, t in state.items():
            loc = local_tensor(t)
            sources[name] = (loc.data_ptr(), loc.dtype, loc.shape)
            storages.add(loc.untyped_storage().data_ptr())
        return cls(refs, layout, key, sources, storages)

    def add(self, name: str, t: torch.Tensor | None) -> StreamRecord | None:
        """Record one output; None (stop recording) if it is not a view of a source."""
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() not in self.storages:
            return None
        self.items.append((name, t))
        if len(self.items) == self.expected:
            self.refs.memos[self.key] = self
        return self

    def holds(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether every source is still the memory the recorded views read."""
        if len(state) != len(self.sources):
            return False
        for name, t in state.items():
            want = self.sources.get(name)
            loc = local_tensor(t)
            if want is None or (loc.data_ptr(), loc.dtype, loc.shape) != want:
                return False
        return True

"""Which tensors a conversion hands back are views of the tensors it was given.

Why: transformers' save-path conversion (`checkpoint_format.py`) cuts a MoE's fused
experts into one checkpoint tensor per expert. On the way it makes contiguous copies
(Qwen3-MoE: `chunk` the fused gate/up projection, `contiguous()` each half, then
`unbind` per expert), so every push copies most of the experts' bytes and runs
thousands of tensor ops in Python (28 ms of a 44 ms push of 7.5 GB on an H200,
`bench_e2e.py --arch qwen3_moe`). Yet each expert's tensor is a plain strided view of
the fused one: the copy changes where the bytes are, not what they are.

What this does: run the conversion once on META tensors (no data) under a dispatch
mode that sees every op, and follow each output back through the views and copies
that made it. A copy (`clone`, what `contiguous()` runs) of a view of a tracked
storage is recorded as such; a view of a copy is then a view of the original wherever
its steps stay inside one dimension of the copy (no index carries into the next one).
Anything else (arithmetic, a cast, a concatenation, a write into a tracked storage,
an output made any other way) leaves that output without a view, and the caller runs
the conversion itself. The answer is exact by construction (it is the conversion's
own sequence of ops); `CheckpointFormat` still compares it, bit for bit, with the
conversion's real output the first time it is used.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ops that make a new storage holding exactly their first argument's elements
_COPIES = {torch.ops.aten.clone.default}


@dataclass(frozen=True)
class ViewOf:
    """`source.as_strided(sizes, strides, source.storage_offset() + offset)`, for a
    contiguous `source`."""

    source: str
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.sizes, self.strides, t.storage_offset() + self.offset)


class ViewBatch:
    """A group's `ViewOf`s made with few calls per push: views of one source with the
    same sizes and strides whose offsets step evenly (a fused tensor's experts) are one
    `as_strided` with a leading dimension, `unbind` into its views (~0.45 us a view
    against ~1.15 us for an `as_strided` each, thousands of views a push). The views
    are the same (offset, sizes, strides) either way; the rest are made one by one."""

    def __init__(self, views: tuple[ViewOf, ...]) -> None:
        self.count = len(views)
        families: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
        for pos, v in enumerate(views):
            families.setdefault((v.source, v.sizes, v.strides), []).append((v.offset, pos))
        #: (source, first offset, step, sizes, strides, output positions by offset)
        self.runs: list[tuple[str, int, int, tuple[int, ...], tuple[int, ...], list[int]]] = []
        self.single: list[tuple[int, ViewOf]] = []
        for (source, sizes, strides), members in families.items():
            members.sort()
            offs = [o for o, _ in members]
            step = offs[1] - offs[0] if len(offs) > 1 else 0
            if step > 0 and all(b - a == step for a, b in itertools.pairwise(offs)):
                self.runs.append((source, offs[0], step, sizes, strides,
                                  [p for _, p in members]))
            else:
                self.single.extend((p, views[p]) for _, p in members)

    def of(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Every view, in the group's output order."""
        out: list[Any] = [None] * self.count
        for source, first, step, sizes, strides, positions in self.runs:
            t = tensors[source]
            stacked = t.as_strided((len(positions), *sizes), (step, *strides),
                                   t.storage_offset() + first)
            for p, v in zip(positions, stacked.unbind(0), strict=True):
                out[p] = v
        for p, view in self.single:
            out[p] = view.of(tensors[view.source])
        return out


@dataclass(frozen=True)
class _Layout:
    """Where a tensor's elements are in its storage (in elements)."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor) -> _Layout:
        return _Layout(int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _Tracer(TorchDispatchMode):
    """Per storage made by a copy: (the storage copied from, the view of it copied, the
    copy's own layout). Storages written in place are `poisoned`."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: dict[int, tuple[int, _Layout, _Layout]] = {}
        self.poisoned: set[int] = set()
        self.alive: list[torch.Tensor] = []  # keeps every storage (and so its key) alive

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                arg = args[i] if i < len(args) else (kwargs or {}).get(a.name)
                if isinstance(arg, torch.Tensor):
                    self.poisoned.add(_key(arg))
        if func in _COPIES and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            src = args[0]
            self.copies[_key(out)] = (_key(src), _Layout.of(src), _Layout.of(out))
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.alive.append(t)
        return out


def trace_views(convert: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]],
                given: Mapping[str, torch.Tensor]) -> dict[str, ViewOf | None]:
    """Per output of `convert(given)` (`given`: contiguous META tensors at offset 0, one
    storage each): the view of one given tensor it is, or None."""
    sources = {_key(t): name for name, t in given.items()}
    tracer = _Tracer()
    with tracer:
        out = dict(convert(dict(given)))
    found: dict[str, ViewOf | None] = {}
    for name, t in out.items():
        found[name] = _resolve(_key(t), _Layout.of(t), sources, tracer)
    return found


def _resolve(storage: int, view: _Layout, sources: Mapping[int, str],
             tracer: _Tracer) -> ViewOf | None:
    """`view` of `storage`, followed back through copies to a given tensor's storage."""
    for _ in range(64):  # a chain of copies is short; a cycle cannot be
        if storage in tracer.poisoned:
            return None
        if storage in sources:
            return ViewOf(sources[storage], view.offset, view.sizes, view.strides)
        made = tracer.copies.get(storage)
        if made is None:
            return None
        parent, copied, layout = made
        mapped = _compose(view, copied, layout)
        if mapped is None:
            return None
        storage, view = parent, mapped
    return None


def _compose(view: _Layout, copied: _Layout, copy: _Layout) -> _Layout | None:
    """`view` of a copy's storage (the copy has `copy`'s layout and holds `copied`'s
    elements, index for index) as a view of the storage `copied` is a view of; None
    where a step of `view` would carry from one dimension of the copy into another (no
    single strided view can say that)."""
    sizes, strides = copy.sizes, copy.strides
    if any(s == 0 for s in view.sizes):
        return _Layout(copied.offset, view.sizes, tuple(0 for _ in view.sizes))
    dims = [j for j in range(len(sizes)) if sizes[j] > 1]
    # the copy's non-trivial dims, outermost first; it must be dense (a clone's own
    # layout is), each dim's stride the size of everything inside it
    dims.sort(key=lambda j: -strides[j])
    inner = 1
    for j in reversed(dims):
        if strides[j] != inner:
            return None
        inner *= sizes[j]
    # the view's first element, as an index into the copy
    rest = view.offset - copy.offset
    index = [0] * len(sizes)
    for j in dims:
        index[j], rest = divmod(rest, strides[j])
    if rest or any(index[j] >= sizes[j] for j in dims):
        return None
    new_strides: list[int] = []
    reach = list(index)
    for size, step in zip(view.sizes, view.strides, strict=True):
        if size == 1:
            new_strides.append(0)
            continue
        at = next((j for j in dims if step % strides[j] == 0 and step // strides[j] >= 1
                   and step < strides[j] * sizes[j]), None)
        if at is None:
            return None
        j = at
        m = step // strides[j]
        reach[j] += m * (size - 1)
        new_strides.append(m * copied.strides[j])
    if any(reach[j] >= sizes[j] for j in range(len(sizes))):
        return None
    offset = copied.offset + sum(index[j] * copied.strides[j] for j in range(len(sizes)))
    return _Layout(offset, view.sizes, tuple(new_strides))


__all__ = ["ViewOf", "trace_views"]

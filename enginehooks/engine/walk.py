"""The live model's modules and tensors, read from `nn.Module`'s own dicts.

Every update reads the whole live model several times: the copy plan's destinations
(`named_tensors`), what verification checks (`named_live`), which modules an update
touched (`named_modules`). torch's `named_parameters` / `named_buffers` /
`named_modules` walk it through nested generators and a memo set, about 3 us per module:
for a model of a few hundred modules that is a millisecond per walk, paid on every push
(the verification of a GPU push measured 35 us per tensor, most of it such walks).

These functions read the same dicts (`_modules`, `_parameters`, `_buffers`) in plain
loops, and return what torch's walks return, in the same order: every module under
every name it is reachable by, every tensor by every name (aliases included), `None`
entries skipped. Nothing is cached: a module an engine replaced, or a parameter whose
data it swapped, is seen on the next walk as torch would see it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch


def modules_by_name(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for every module under every name, depth first, children in
    registration order: `model.named_modules(remove_duplicate=False)`."""
    out: list[tuple[str, torch.nn.Module]] = []
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, m = stack.pop()
        out.append((prefix, m))
        children = [(f"{prefix}.{k}" if prefix else k, c)
                    for k, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))
    return out


def unique_modules(mods: list[tuple[str, torch.nn.Module]]) -> dict[str, torch.nn.Module]:
    """The first name of each module (`dict(model.named_modules())`): a module reachable
    by two names is kept under the one met first."""
    seen: set[int] = set()
    out: dict[str, torch.nn.Module] = {}
    for name, m in mods:
        if id(m) not in seen:
            seen.add(id(m))
            out[name] = m
    return out


def tensors_by_name(mods: list[tuple[str, torch.nn.Module]]) -> dict[str, torch.Tensor]:
    """Every parameter, then every buffer, by every name (aliases included):
    `named_parameters(remove_duplicate=False)` followed by
    `named_buffers(remove_duplicate=False)`."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for prefix, m in mods:
        d = m.__dict__
        own_p, own_b = d["_parameters"], d["_buffers"]
        if not own_p and not own_b:
            continue
        dot = f"{prefix}." if prefix else ""
        for k, t in own_p.items():
            if t is not None:
                params[dot + k] = t
        for k, t in own_b.items():
            if t is not None:
                buffers[dot + k] = t
    params.update(buffers)
    return params


def live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`tensors_by_name` of the whole model."""
    return tensors_by_name(modules_by_name(model))


class Structure:
    """What the digest-only verdict of an update depends on, read in one walk: every
    module, child, parameter, buffer and attribute value by identity, and every
    parameter's and buffer's address, shape, strides and dtype. A model `matches` a
    structure while it is the same model to `verify.digest_only_modules` and
    `DigestCheck.check`: the same modules holding the same objects, the tensors still
    at the same addresses.

    A module that holds a plain callable (a closure may capture a tensor, and a cell's
    contents can change without any dict changing) has no structure (`of` is None):
    nothing is kept for such a model."""

    __slots__ = ("entries", "keys", "root")

    def __init__(self, root: torch.nn.Module,
                 entries: list[tuple[torch.nn.Module, tuple[object, ...]]],
                 keys: list[object]) -> None:
        self.root, self.entries, self.keys = root, entries, keys

    @staticmethod
    def of(model: torch.nn.Module) -> Structure | None:
        """Per module, depth first: the module and what it holds (`_held`); then every
        tensor's address, shape, strides and dtype."""
        entries = []
        stack: list[torch.nn.Module] = [model]
        while stack:
            m = stack.pop()
            values = m.__dict__.values()
            if any(map(callable, values)) and any(
                    callable(v) and not isinstance(v, torch.nn.Module) for v in values):
                return None
            entries.append((m, _held(m)))
            stack.extend(c for c in reversed(m._modules.values()) if c is not None)
        return Structure(model, entries, _keys(entries))

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether `model` is still this structure. Module by module, from the root:
        the same attribute values, parameters, buffers and children (by identity; the
        children being the same, the modules walked are the model's own), then the same
        tensor keys."""
        if model is not self.root:
            return False
        is_ = operator.is_
        for m, held in self.entries:
            now = _held(m)
            if len(now) != len(held) or not all(map(is_, now, held)):
                return False
        return _keys(self.entries) == self.keys


def _held(m: torch.nn.Module) -> tuple[object, ...]:
    """What a module holds, in one tuple: its attribute values, then its parameters,
    buffers and children (a marker before each group, so that nothing moves from one
    group to another unseen)."""
    d = m.__dict__
    return (*d.values(), _PARAMS, *d["_parameters"].values(), _BUFFERS,
            *d["_buffers"].values(), _CHILDREN, *d["_modules"].values())


_PARAMS, _BUFFERS, _CHILDREN = object(), object(), object()


def tensor_keys(tensors: Iterable[torch.Tensor | None]) -> list[tuple[object, ...]]:
    """Each tensor's (address, shape, strides, dtype), `None`s skipped: what a tensor
    kept by identity must still have for an answer about it to stand (`Structure`, and
    `engine/apply.py`'s kept destinations and writable routes). `.data = ...` keeps the
    object and may change any of them."""
    return [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors if t is not None]


def _keys(entries: list[tuple[torch.nn.Module, tuple[object, ...]]]) -> list[object]:
    """Every parameter's and buffer's `tensor_keys`."""
    out: list[object] = []
    for m, _ in entries:
        d = m.__dict__
        for own in (d["_parameters"], d["_buffers"]):
            if own:
                out.extend(tensor_keys(own.values()))
    return out

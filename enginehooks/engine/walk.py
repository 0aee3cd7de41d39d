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
    parameter's and buffer's address, shape, strides and dtype. Two equal structures
    are the same model to `verify.digest_only_modules` and `DigestCheck.check`: the same
    modules holding the same objects, the tensors still at the same addresses.

    A module that holds a plain callable (a closure may capture a tensor, and a cell's
    contents can change without any dict changing) has no structure (`of` is None):
    nothing is kept for such a model."""

    __slots__ = ("keys", "objects")

    def __init__(self, objects: list[object], keys: list[object]) -> None:
        self.objects, self.keys = objects, keys

    @staticmethod
    def of(model: torch.nn.Module) -> Structure | None:
        objects: list[object] = []
        keys: list[object] = []
        stack: list[torch.nn.Module] = [model]
        while stack:
            m = stack.pop()
            d = m.__dict__
            values = d.values()
            objects.append(m)
            objects.extend(values)
            if any(map(callable, values)) and any(
                    callable(v) and not isinstance(v, torch.nn.Module) for v in values):
                return None
            for own in (d["_parameters"], d["_buffers"]):
                if own:
                    ts = own.values()
                    objects.extend(ts)
                    keys.extend([(t.data_ptr(), t.shape, t.stride(), t.dtype)
                                 for t in ts if t is not None])
            children = d["_modules"].values()
            objects.extend(children)
            stack.extend(c for c in children if c is not None)
        return Structure(objects, keys)

    def same(self, other: Structure | None) -> bool:
        """Whether `other` is this structure: the same objects (by identity) and keys."""
        return (other is not None and len(other.objects) == len(self.objects)
                and all(map(operator.is_, self.objects, other.objects))
                and self.keys == other.keys)

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

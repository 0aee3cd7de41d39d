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
from itertools import chain

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
    nothing is kept for such a model.

    `matches` runs on every settled update, after the load, so it is written as a few
    passes of C-level `map`s, not a Python call per module: the modules' own dicts by
    identity (`__dict__`; then the parameters, buffers and children dicts it holds),
    every dict's length (so that nothing moves from one dict to the next unseen), every
    value of every dict by identity, then the tensors' keys as columns (`tensor_keys`).
    For the 1 GB benchmark model (62 modules, 60 tensors) on a 2-core Intel host: ~210
    us module by module through a tuple each, ~120 us so."""

    __slots__ = ("dicts", "keys", "lens", "modules", "root", "tensors", "values")

    def __init__(self, root: torch.nn.Module, modules: list[torch.nn.Module]) -> None:
        self.root, self.modules = root, modules
        #: the modules' `__dict__`s, then their parameters, buffers and children dicts
        self.dicts = _dicts(modules)
        self.lens = list(map(len, self.dicts))
        #: every value of every one of those dicts, in order (held: ids stay theirs)
        self.values = list(chain.from_iterable(map(dict.values, self.dicts)))
        #: every parameter and buffer, in walk order (held alive: ids stay theirs)
        self.tensors = [t for m in modules for own in (m.__dict__["_parameters"],
                                                       m.__dict__["_buffers"])
                        for t in own.values() if t is not None]
        self.keys = tensor_keys(self.tensors)

    @staticmethod
    def of(model: torch.nn.Module) -> Structure | None:
        """Per module, depth first: the module and what it holds; then every tensor's
        address, shape, strides and dtype."""
        modules = []
        stack: list[torch.nn.Module] = [model]
        while stack:
            m = stack.pop()
            values = m.__dict__.values()
            if any(map(callable, values)) and any(
                    callable(v) and not isinstance(v, torch.nn.Module) for v in values):
                return None
            modules.append(m)
            stack.extend(c for c in reversed(m._modules.values()) if c is not None)
        try:
            return Structure(model, modules)
        except (KeyError, TypeError):  # a module without torch's own dicts: none kept
            return None

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether `model` is still this structure: from the root, module by module,
        the same `__dict__`, attribute values, parameters, buffers and children (by
        identity; the children being the same, the modules walked are the model's
        own), then the same tensor keys."""
        if model is not self.root:
            return False
        n = len(self.modules)
        own = list(map(_VARS, self.modules))
        if not all(map(operator.is_, own, self.dicts[:n])):
            return False  # a module given another `__dict__`
        try:
            dicts = own + list(chain.from_iterable(map(_OWN_DICTS, own)))
            if list(map(len, dicts)) != self.lens:
                return False
            now = list(chain.from_iterable(map(dict.values, dicts)))
        except (KeyError, TypeError):
            return False  # a module's parameters, buffers or children dict removed
        if not all(map(operator.is_, now, self.values)):
            return False
        # the same objects: the same tensors, whose keys `.data = ...` may have changed
        return tensor_keys(self.tensors) == self.keys


def _dicts(modules: list[torch.nn.Module]) -> list[dict[str, object]]:
    """The modules' `__dict__`s, then each one's parameters, buffers and children
    dicts, in order."""
    own = list(map(_VARS, modules))
    return own + list(chain.from_iterable(map(_OWN_DICTS, own)))


_VARS = operator.attrgetter("__dict__")
_OWN_DICTS = operator.itemgetter("_parameters", "_buffers", "_modules")
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


def tensor_keys(tensors: Iterable[torch.Tensor | None]) -> tuple[list[object], ...]:
    """The addresses, shapes, strides and dtypes of `tensors` (`None`s skipped), as four
    columns: what a tensor kept by identity must still have for an answer about it to
    stand (`Structure`, and `engine/apply.py`'s kept destinations and writable routes).
    `.data = ...` keeps the object and may change any of them. Only compared with
    another `tensor_keys`. The address and strides are read with `torch.Tensor`'s own
    methods (what the storage really is, whatever a subclass overrides): a column per
    attribute costs a third of a tuple per tensor."""
    ts = [t for t in tensors if t is not None]
    return (list(map(torch.Tensor.data_ptr, ts)), list(map(_SHAPE, ts)),
            list(map(torch.Tensor.stride, ts)), list(map(_DTYPE, ts)))

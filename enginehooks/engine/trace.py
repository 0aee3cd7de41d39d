"""Follow every tensor of an update through the engine's own loader, op by op.

The engines' loaders write most weights through a parameter's `weight_loader`, but not
all: some write with a direct `param.data.copy_(...)` (GPT-OSS experts and attention
sinks in vLLM), or `param.data.fill_(w.item())` (SGLang's default loader for
one-element tensors). A dry run that only counts `weight_loader` calls cannot tell a
tensor that lands from one that is dropped. This tracer sits under the loader as a
`TorchDispatchMode` and sees every aten op it runs:

- every tensor fed to the loader is *tainted* with its checkpoint name; an op that
  reads a tainted tensor taints its outputs (views share the storage, so they are
  tainted already);
- an op that writes (its schema marks the argument mutable, or `out=`) into the
  storage of a model parameter or buffer records a landing: source name -> the
  parameter (or buffer) and how many elements were written;
- `.item()` of a meta tensor cannot run (there is no data): the tracer answers 0 and
  remembers which names the scalar came from, so a `fill_` of a parameter with that
  scalar still counts as a landing. Model constructors that read a parameter's value
  (`float(self.beta.item())`) can then be built on the meta device as well.

The tracer never changes what the loader does with real tensors: it only records.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_SCALAR = torch.ops.aten._local_scalar_dense.default


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # tensors without storage (sparse, nested, some subclasses)
        return None


@dataclass
class Written:
    """What the tracer saw one update tensor do: where it landed (tensor name -> elements
    written) and in what dtype each destination holds it."""

    into: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)


_TO_COPY = torch.ops.aten._to_copy.default


def _out_of_meta(func: Any, args: Any, kwargs: Any) -> Any:
    """What reading data out of a meta tensor gives under the tracers: `.item()` -> 0,
    `.cpu()` / `.to(device)` -> zeros on that device. None: not such an op."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not first.is_meta:
        return None
    if func is _SCALAR:
        return _zero(first.dtype)
    if func is _TO_COPY:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "meta":
            return torch.zeros(first.shape, dtype=kwargs.get("dtype") or first.dtype,
                               device=device)
    return None


class MetaScalars(TorchDispatchMode):
    """Reading a meta tensor's value answers zeros instead of raising: lets
    constructors that read a parameter's value (`float(self.beta.cpu().item())`) build
    on the meta device (the value is never used to load anything real)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        faked = _out_of_meta(func, args, kwargs)
        if faked is not None:
            return faked
        return func(*args, **kwargs)


def _zero(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


class ByteTracer(TorchDispatchMode):
    """Records which model tensors each fed update tensor is written into (see the
    module docstring). Use: `with ByteTracer(model) as tr: loader(tr.feed(...))`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.owner: dict[int, str] = {}
        self.sizes: dict[str, int] = {}
        # The model's storages stay alive while tracing: a loader that assigns
        # `param.data = w` frees the old one, and a temporary allocated at its address
        # would be taken for that parameter (never tainted, its copies lost).
        self._owned: list[Any] = []
        for name, t in _named_tensors(model):
            key = _storage_key(t)
            if key is not None:
                self.owner.setdefault(key, name)
                self.sizes[name] = t.numel()
                self._owned.append(t.untyped_storage())
        self.taint: dict[int, set[str]] = {}
        self._keep: list[torch.Tensor] = []   # no storage address is reused mid-trace
        self._scalar_from: set[str] = set()
        self.written: dict[str, Written] = {}
        self.current: str | None = None

    # -- feeding ----------------------------------------------------------------------
    def mark(self, name: str, t: torch.Tensor) -> None:
        """Taint `t` (a tensor about to be handed to the loader) with `name`."""
        key = _storage_key(t)
        if key is not None:
            self.taint.setdefault(key, set()).add(name)
            self._keep.append(t)
        self.written.setdefault(name, Written())

    def feed(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in items:
            self.mark(name, t)
            self.current = name
            yield name, t
        self.current = None

    def settle(self, model: torch.nn.Module) -> None:
        """After the loader returned: a parameter whose storage IS a fed tensor's (the
        loader assigned `param.data = w` instead of copying) holds it too."""
        for name, t in _named_tensors(model):
            key = _storage_key(t)
            for src in self.taint.get(key, set()) if key is not None else ():
                w = self.written.setdefault(src, Written())
                w.into.setdefault(name, t.numel())
                w.dtypes.setdefault(name, t.dtype)

    # -- the mode ---------------------------------------------------------------------
    def _sources(self, tensors: Iterable[torch.Tensor]) -> set[str]:
        found: set[str] = set()
        for t in tensors:
            key = _storage_key(t)
            if key is not None and key in self.taint:
                found |= self.taint[key]
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        faked = _out_of_meta(func, args, kwargs)
        if faked is not None:
            if func is _SCALAR:
                self._scalar_from = self._sources(flat_in)
            else:  # data read out of a fed tensor stays tainted with its name
                self._mark_derived(faked, self._sources(flat_in))
            return faked
        written = self._destinations(func, args, kwargs)
        out = func(*args, **kwargs)
        sources = self._sources(t for t in flat_in if all(t is not w for w in written))
        if written:
            if not sources and self._scalar_from:
                sources = self._scalar_from
            for dest in written:
                owner = self.owner.get(_storage_key(dest) or -1)
                if owner is None:
                    # a write into a temporary: the temporary now carries the sources
                    key = _storage_key(dest)
                    if key is not None and sources:
                        self.taint.setdefault(key, set()).update(sources)
                        self._keep.append(dest)
                    continue
                for src in sources:
                    w = self.written.setdefault(src, Written())
                    w.into[owner] = w.into.get(owner, 0) + dest.numel()
                    w.dtypes[owner] = dest.dtype
            self._scalar_from = set()
        self._mark_derived(out, sources)
        return out

    def _mark_derived(self, out: Any, sources: set[str]) -> None:
        if not sources:
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key is not None and key not in self.owner:
                    self.taint.setdefault(key, set()).update(sources)
                    self._keep.append(t)

    @staticmethod
    def _destinations(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
        """The tensors `func` writes into (mutable schema arguments)."""
        out: list[torch.Tensor] = []
        schema = getattr(func, "_schema", None)
        if schema is None:
            return out
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            out.extend(v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor))
        return out


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers (aliases included: a buffer that views a parameter
    shares its storage, and the parameter's name wins)."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)

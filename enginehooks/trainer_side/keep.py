"""Partial updates by whole modules: an update that leaves out the modules the trainer
keeps frozen (a vision tower, the embeddings).

`WeightSync.push(model, version, keep=[...])` sends every tensor except those of the
named modules (checkpoint name prefixes) and lists them in the manifest
(`meta["keep"]`, `engine.expectations.kept_modules`). The engine then checks that every
module the update sends is whole and keeps the rest as it holds them; a module sent in
part is refused as before, before any byte moves. The adapters that convert from module
layout (`CheckpointAdapter`) skip the kept modules' groups before gathering them, so a
sharded trainer never gathers a frozen tower; other adapters are filtered as they stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from enginehooks.core.errors import ConfigError
from enginehooks.core.keep import under
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.contract import CheckpointAdapter, TrainerAdapter

__all__ = ["LeaveOut", "leave_out", "module_names"]


def module_names(keep: Sequence[str] | str) -> tuple[str, ...]:
    """`keep` as a tuple of module names (checkpoint name prefixes), checked."""
    names = (keep,) if isinstance(keep, str) else tuple(keep)
    if not all(isinstance(k, str) and k.strip(".") for k in names):
        raise ConfigError(f"keep= names modules by their checkpoint prefix "
                          f"('model.vision_tower'), not {keep!r}")
    return tuple(k.strip(".") for k in names)


class LeaveOut(TrainerAdapter):
    """Another adapter's update without the tensors of the modules in `keep`."""

    name = "leave_out"

    def __init__(self, inner: TrainerAdapter, keep: Sequence[str]) -> None:
        super().__init__(inner.model, dtype=inner.dtype, dtypes=inner.dtypes)
        self.inner, self.keep = inner, tuple(keep)

    @classmethod
    def accepts(cls, model: object) -> bool:
        return False  # only built by `leave_out`

    def specs(self) -> list[TensorSpec]:
        return [s for s in self.inner.specs() if not under(s.name, self.keep)]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in self.inner.stream() if not under(n, self.keep))

    def cancel(self, reason: str) -> None:
        self.inner.cancel(reason)


def leave_out(adapter: TrainerAdapter, keep: Sequence[str], *,
              in_place: bool = False) -> TrainerAdapter:
    """`adapter` sending nothing of the modules in `keep`; the update must still send
    something, and every name in `keep` must name tensors the model holds (a typo would
    otherwise keep nothing and send the module). `in_place`: the adapter is this push's
    own, and a `CheckpointAdapter` gets the filter itself (kept groups are then never
    gathered); otherwise it is wrapped."""
    keep = module_names(keep)
    if not keep:
        return adapter
    if in_place and isinstance(adapter, CheckpointAdapter):
        include: Callable[[str], bool] | None = adapter.include
        adapter.include = (lambda n: not under(n, keep) and (include is None or include(n)))
        full = [s.name for s in _without_filter(adapter, include)]
        out: TrainerAdapter = adapter
    else:
        full = [s.name for s in adapter.specs()]
        out = LeaveOut(adapter, keep)
    unknown = [k for k in keep if not any(under(n, (k,)) for n in full)]
    if unknown:
        raise ConfigError(f"keep={list(keep)}: {unknown} name no tensors of this model "
                          f"(checkpoint names look like {full[:3]})")
    if all(under(n, keep) for n in full):
        raise ConfigError(f"keep={list(keep)} leaves nothing to send")
    return out


def _without_filter(adapter: CheckpointAdapter,
                    include: Callable[[str], bool] | None) -> list[TensorSpec]:
    """The adapter's planned specs under filter `include` (its own, before `keep`)."""
    mine, adapter.include = adapter.include, include
    try:
        return adapter.specs()
    finally:
        adapter.include = mine

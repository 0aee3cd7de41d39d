"""Megatron-Core models through Megatron-Bridge's HF export stream.

Megatron-Bridge (`megatron.bridge.AutoBridge`) already knows every supported
architecture's layouts: `bridge.export_hf_weights(model, cpu=...)` gathers TP / PP / EP
shards, un-fuses QKV and gate/up, and yields `(hf_name, tensor)` one at a time, on
every rank (its `next()` runs the gathers, so every rank iterates: the lockstep rule).
We consume that stream; there are no per-model converters here.

The bridge has no "names and shapes without gathering" call, so the plan comes from,
in order: `specs=` given by the user (e.g. from the HF checkpoint's safetensors
headers, in the export's order); the names and shapes recorded during the previous
push; or, on the first push, a dry run of the export on every rank (one extra gather
pass, then cached: names and shapes do not change while training). Any mismatch
between plan and stream is a clear `ManifestError` from the transport, never a
silent mix-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from enginehooks.core.errors import EngineHooksError
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.contract import hf_name
from enginehooks.trainer_side.lockstep import LockstepAdapter


def _is_megatron(model: Any) -> bool:
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    return type(first).__module__.startswith(("megatron.core", "megatron.bridge"))


class MegatronBridgeAdapter(LockstepAdapter):
    """A Megatron-Core model (or its list of virtual-pipeline chunks) and its bridge.

    Args:
        model: what `bridge.export_hf_weights` takes.
        bridge: a Megatron-Bridge `AutoBridge` (anything with `export_hf_weights(model,
            cpu=..., show_progress=...)` yielding `(hf_name, tensor)`).
        specs: the plan, in export order, if known (skips the first push's dry run).
        cpu: ask the bridge for CPU tensors (host transports such as gloo / disk).
        export_kwargs: more keyword arguments for `export_hf_weights`.
        group / sender / timeout_s / start_timeout_s: see `Lockstep` (group default:
            the default group, which every Megatron rank belongs to).
    """

    name = "megatron"

    def __init__(self, model: Any, *, bridge: Any = None, dtype: torch.dtype | None = None,
                 specs: Sequence[TensorSpec] | None = None, cpu: bool = True,
                 export_kwargs: dict[str, Any] | None = None,
                 include: Callable[[str], bool] | None = None,
                 rename: Callable[[str], str] = hf_name, group: Any = None, sender: int = 0,
                 timeout_s: float | None = None, start_timeout_s: float | None = None) -> None:
        if bridge is None:
            raise EngineHooksError(
                "a Megatron model pushes through Megatron-Bridge: pass "
                "MegatronBridgeAdapter(model, bridge=AutoBridge.from_hf_pretrained(...)) to "
                "WeightSync.push (and to follow() on the other ranks)")
        super().__init__(model, dtype=dtype, group=group, sender=sender, timeout_s=timeout_s,
                         start_timeout_s=start_timeout_s)
        self.include, self.rename = include, rename
        self.bridge = bridge
        self.cpu = cpu
        self.export_kwargs = dict(export_kwargs or {})
        self._shapes: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = (
            [(s.name, getattr(torch, s.dtype), tuple(s.shape)) for s in specs]
            if specs is not None else None)
        self.dry_runs = 0

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return _is_megatron(model)

    def _export(self) -> Iterator[tuple[str, torch.Tensor]]:
        kwargs = dict(cpu=self.cpu, show_progress=False, **self.export_kwargs)
        for raw, t in self.bridge.export_hf_weights(self.model, **kwargs):
            name = self.rename(raw)
            if self._keep(name):  # every rank skips the same names: still in step
                yield name, t

    def _keep(self, name: str) -> bool:
        return self.include is None or self.include(name)

    def _plan(self) -> list[TensorSpec]:
        if self._shapes is None:
            # First push, no plan given: one pass of the export on every rank, cached.
            self.dry_runs += 1
            self._shapes = [(n, t.dtype, tuple(t.shape)) for n, t in self._export()]
        return [self.wire_spec(n, dt, shape) for n, dt, shape in self._shapes]

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, t in self._export():
                yield name, self.to_wire(t, name)
                del t

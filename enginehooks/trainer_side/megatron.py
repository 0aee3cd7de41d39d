"""Megatron-Core models through their bridge's HF export stream.

A bridge already knows every supported architecture's layouts: it gathers TP / PP / EP
shards, un-fuses QKV and gate/up, renumbers experts and yields `(hf_name, tensor)` one at
a time, on every rank (its `next()` runs the gathers, so every rank iterates: the
lockstep rule). We consume that stream; there are no per-model converters here. Two
bridges are understood, told apart by their export method:

* mbridge (`mbridge.AutoBridge`): `bridge.export_weights(models)`, tested here with real
  megatron-core 0.14 on CPU (TP, PP, EP, TP+EP; tests/megatron).
* Megatron-Bridge (`megatron.bridge.AutoBridge`): `bridge.export_hf_weights(model,
  cpu=..., show_progress=False)`; not run here (it imports Transformer Engine).

mbridge names experts the way Transformer Engine's grouped MLP does
(`mlp.experts.linear_fc1.weight<E>`); megatron-core's own `SequentialMLP` (the expert
layer without Transformer Engine, or with `moe_grouped_gemm=False`) names them
`mlp.experts.local_experts.<E>.linear_fc1.weight`. `grouped_expert_names()` shows the
model to the bridge under the grouped names (same tensors, no copies); the adapter
applies it where it calls mbridge, and code that loads weights through mbridge
(`bridge.load_weights`) uses the same view.

Neither bridge has a "names and shapes without gathering" call, so the plan comes from,
in order: `specs=` given by the user (e.g. from the HF checkpoint's safetensors headers,
in the export's order); the names and shapes recorded during the previous push; or, on
the first push, a dry run of the export on every rank (one extra gather pass, then
cached: names and shapes do not change while training). Any mismatch between plan and
stream is a clear error, never a silent mix-up.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from enginehooks.core.errors import EngineHooksError, ManifestError
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.contract import hf_name
from enginehooks.trainer_side.lockstep import LockstepAdapter

# megatron-core SequentialMLP: ...mlp.experts.local_experts.<E>.linear_fc1.weight
_SEQUENTIAL = re.compile(r"(?P<pre>(?:^|\.)mlp\.experts)\.local_experts\.(?P<e>\d+)\."
                         r"(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)$")


def grouped_expert_name(name: str) -> str:
    """A SequentialMLP expert parameter's name as Transformer Engine's grouped MLP names it
    (`...mlp.experts.local_experts.3.linear_fc1.weight` -> `...mlp.experts.linear_fc1.weight3`);
    other names unchanged."""
    return _SEQUENTIAL.sub(lambda m: f"{m['pre']}.{m['fc']}.{m['kind']}{m['e']}", name)


class GroupedExpertNames:
    """A megatron-core model chunk seen with grouped expert names: `named_parameters()` and
    `state_dict()` rename SequentialMLP experts (same tensor objects, nothing copied);
    every other attribute is the chunk's."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, key: str) -> Any:
        return getattr(self._module, key)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        for name, p in self._module.named_parameters(*args, **kwargs):
            yield grouped_expert_name(name), p

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {grouped_expert_name(k): v for k, v in self._module.state_dict(*args, **kwargs).items()}


def _chunks(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unwrap(module: Any) -> Any:
    """Megatron's wrappers (DDP, Float16Module, ...) keep the model in `.module`."""
    while type(module).__module__.startswith("megatron.") and hasattr(module, "module") \
            and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def grouped_expert_names(model: Any) -> list[Any]:
    """The model's chunks as mbridge expects them: unwrapped, and seen through
    `GroupedExpertNames` when they hold SequentialMLP experts."""
    out = []
    for chunk in _chunks(model):
        chunk = _unwrap(chunk)
        sequential = any(_SEQUENTIAL.search(n) for n, _ in chunk.named_parameters())
        out.append(GroupedExpertNames(chunk) if sequential else chunk)
    return out


def _is_megatron(model: Any) -> bool:
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    return type(first).__module__.startswith(("megatron.core", "megatron.bridge"))


class MegatronBridgeAdapter(LockstepAdapter):
    """A Megatron-Core model (or its list of virtual-pipeline chunks) and its bridge.

    Args:
        model: the model chunks the bridge exports (a module or a list of them, wrapped
            or not).
        bridge: an mbridge `AutoBridge` (`export_weights(models)`) or a Megatron-Bridge
            `AutoBridge` (`export_hf_weights(model, cpu=..., show_progress=...)`).
        specs: the plan, in export order, if known (skips the first push's dry run).
        cpu: tensors leave the stream on the CPU (host transports such as gloo / disk);
            False keeps them where the model is (nccl, cuda_ipc).
        export_kwargs: more keyword arguments for the bridge's export call.
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
                "a Megatron model pushes through its bridge: pass "
                "MegatronBridgeAdapter(model, bridge=AutoBridge.from_config(hf_config)) (mbridge) "
                "or bridge=AutoBridge.from_hf_pretrained(path) (Megatron-Bridge) to "
                "push()/WeightSync.push and to follow() on the other ranks")
        if not (callable(getattr(bridge, "export_hf_weights", None))
                or callable(getattr(bridge, "export_weights", None))):
            raise EngineHooksError(
                f"{type(bridge).__name__} is not a Megatron bridge: expected mbridge's "
                "export_weights(models) or Megatron-Bridge's export_hf_weights(model, ...)")
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

    def _bridge_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        export_hf = getattr(self.bridge, "export_hf_weights", None)
        if callable(export_hf):  # Megatron-Bridge: it moves tensors to the CPU itself
            kwargs = dict(cpu=self.cpu, show_progress=False, **self.export_kwargs)
            return iter(export_hf(self.model, **kwargs))
        # mbridge: one place for SequentialMLP expert names (see grouped_expert_names)
        return iter(self.bridge.export_weights(grouped_expert_names(self.model),
                                               **self.export_kwargs))

    def _export(self) -> Iterator[tuple[str, torch.Tensor]]:
        for raw, t in self._bridge_stream():
            name = self.rename(raw)
            if self._keep(name):  # every rank skips the same names: still in step
                yield name, t

    def _keep(self, name: str) -> bool:
        return self.include is None or self.include(name)

    def _plan(self) -> list[TensorSpec]:
        if self._shapes is None:
            # First push, no plan given: one pass of the export on every rank, cached.
            self.dry_runs += 1
            with torch.no_grad():
                shapes = [(n, t.dtype, tuple(t.shape)) for n, t in self._export()]
            names = [n for n, _, _ in shapes]
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise ManifestError(f"the bridge exported {twice[:5]} more than once: the "
                                    "model chunks or the bridge's mapping are inconsistent")
            self._shapes = shapes
        return [self.wire_spec(n, dt, shape) for n, dt, shape in self._shapes]

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        plan = self._shapes or []
        with torch.no_grad():
            for index, (name, t) in enumerate(self._export()):
                if index >= len(plan) or plan[index][0] != name or plan[index][2] != tuple(t.shape):
                    want = plan[index][:1] + plan[index][2:] if index < len(plan) else "nothing"
                    raise ManifestError(
                        f"the bridge's export does not match the plan at tensor {index}: it "
                        f"produced {name} {tuple(t.shape)}, the plan has {want}; a plan given "
                        "through specs= must list the export's tensors in its order")
                wire = self.to_wire(t, name)
                del t
                yield name, wire.cpu() if self.cpu else wire

"""A plain torch module as an engine replica, in this process.

Receives through exactly the code the engine plugins use (`EngineSide`, the transport
receivers, the `receive_weights` hook) and copies each tensor into the module's
parameter of the same name. For GPU benchmarks and tests where no inference engine
can run, for evaluation copies of a policy, and for unit tests of the coordinator.

What it accepts is its module's checkpoint format (the names and shapes transformers'
`save_pretrained` would write for it, `trainer_side.CheckpointFormat`), in the
module's own dtypes. It copies by name, so it takes models whose checkpoint format is
their module layout (dense models); for a model transformers converts on save (fused
MoE experts) it says so when built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from enginehooks.control.handles import EngineHandle
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ConfigError
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.contract import EngineBinding, verb_of
from enginehooks.engine.expectations import CheckpointExpectations, Expectations
from enginehooks.engine.side import EngineSide
from enginehooks.engine.targets import ModuleTarget
from enginehooks.transports.base import Target


def _checkpoint_specs(module: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    from enginehooks.core.checkpoint_format import CheckpointFormat, Source

    if not isinstance(module, nn.Module):
        return {n: TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in module.items()}
    state = module.state_dict()
    plan = CheckpointFormat(module).plan([Source(n, t.dtype, tuple(t.shape))
                                          for n, t in state.items()])
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    converted = [g for g in plan.groups
                 if {(o.name, o.shape) for o in g.outputs} != {(n, shapes[n]) for n in g.sources}]
    if converted:
        raise ConfigError(
            f"LocalEngine copies tensors by name, and this {type(module).__name__} is saved "
            f"in another layout than it holds (e.g. {list(converted[0].sources)[:2]} -> "
            f"{[o.name for o in converted[0].outputs][:2]}): use a real engine for it")
    return {o.name: TensorSpec(o.name, dtype_name(o.dtype), o.shape) for o in plan.outputs()}


class _LocalBinding(EngineBinding):
    engine = "local"

    def __init__(self, target: ModuleTarget, specs: dict[str, TensorSpec]) -> None:
        self._target, self._specs = target, specs

    def target(self) -> Target:
        return self._target

    def dtype(self) -> str | None:  # type: ignore[override]
        dtypes = {s.dtype for s in self._specs.values()
                  if s.dtype.startswith(("float", "bfloat"))}
        return dtypes.pop() if len(dtypes) == 1 else None

    def expectations(self) -> Expectations:
        return CheckpointExpectations(self._specs)

    def readable(self) -> Mapping[str, torch.Tensor]:
        return self._target.tensors


class LocalEngine(EngineHandle):
    """An in-process replica around `module` (whose parameters live on `device`)."""

    def __init__(self, module: nn.Module | Mapping[str, torch.Tensor], name: str = "local",
                 device: torch.device | str | None = None) -> None:
        self.name = name
        self.target = ModuleTarget(module, device)
        self.device = self.target.device
        self.side = EngineSide(_LocalBinding(self.target, _checkpoint_specs(module)))

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return [self.side.call(verb_of(method), *args)]

    def flush_pending(self) -> bool:
        return False  # a bare module has no cache: no call to make

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        """A bare module has no cache."""

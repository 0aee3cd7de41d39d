"""A plain torch module as an engine replica, in this process.

Receives through exactly the code the engine plugins use (`EngineSide`, the transport
receivers, the `receive_weights` hook) and copies each tensor into the module's
parameter of the same name. For GPU benchmarks and tests where no inference engine
can run, for evaluation copies of a policy, and for unit tests of the coordinator.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from enginehooks.checkpoint import readable_digests
from enginehooks.dtypes import dtype_name
from enginehooks.engine_side import EngineSide
from enginehooks.handles import EngineHandle
from enginehooks.manifest import TensorSpec
from enginehooks.targets import ModuleTarget


class LocalEngine(EngineHandle):
    """An in-process replica around `module` (whose parameters live on `device`)."""

    def __init__(self, module: nn.Module, name: str = "local",
                 device: torch.device | str | None = None) -> None:
        self.name = name
        first = next(iter(module.state_dict().values()), None)
        self.device = torch.device(device) if device else (
            first.device if first is not None else torch.device("cpu"))
        self.target = ModuleTarget(module, self.device)
        self.side = EngineSide(self.target, self._expected, device=self.device)

    def _expected(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(n, dtype_name(t.dtype), tuple(t.shape))
                for n, t in self.target.tensors.items()}

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        side = self.side
        if method == "enginehooks_info":
            dtypes = {s.dtype for s in self._expected().values()}
            return [dict(side.info(), dtype=dtypes.pop() if len(dtypes) == 1 else None)]
        if method == "enginehooks_join":
            return [side.join(args[0], int(args[1]))]
        if method == "enginehooks_leave":
            side.leave()
            return [{"left": True}]
        if method == "enginehooks_check":
            return [side.check(args[0])]
        if method == "enginehooks_receive":
            return [side.receive(args[0])]
        if method == "enginehooks_digests":
            return [readable_digests(self.target.tensors, self._expected(), json.loads(args[0]))]
        raise AttributeError(f"LocalEngine has no method {method!r}")

    def flush_cache(self, timeout_s: float) -> None:
        """A bare module has no cache."""

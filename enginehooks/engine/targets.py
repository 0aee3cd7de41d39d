"""A `Target` that loads an update into a plain torch module, by parameter name.

Engines bring their own targets (vLLM's reload path, SGLang's loader). This one is for
the places where the receiver is a torch model itself: GPU tests and benchmarks (the
engines cannot run there), a reference policy kept in sync with the trainer, or an
evaluation process. It goes through the same `Receiver.deliver` as the engine
plugins, so what it measures is the code the engines run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from enginehooks.core.errors import ManifestError
from enginehooks.transports.base import Target


class ModuleTarget(Target):
    """Copies each received tensor into the module's parameter or buffer of that name
    (or into a plain name -> tensor mapping of preallocated tensors).

    It also offers `destination(name)`, which receivers use to rejoin a tensor that was
    cut across buckets straight into the parameter (no temporary the size of the
    tensor), so the receiver's extra memory stays at its transport buffers.
    """

    def __init__(
        self,
        module: nn.Module | Mapping[str, torch.Tensor],
        device: torch.device | str | None = None,
    ) -> None:
        self.module = module
        if isinstance(module, nn.Module):
            # state_dict keeps tied aliases (lm_head.weight of a tied model) and only
            # persistent buffers: exactly the names an HF checkpoint holds.
            self.tensors: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=True))
        else:
            self.tensors = dict(module)
        first = next(iter(self.tensors.values()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None else torch.device("cpu")
        )
        self.received: list[str] = []

    def destination(self, name: str) -> torch.Tensor | None:
        t = self.tensors.get(name)
        return t.data if t is not None and t.is_contiguous() else None

    def destinations(self, names: Sequence[str]) -> list[torch.Tensor | None]:
        get = self.tensors.get
        return [t.data if t is not None and t.is_contiguous() else None
                for t in map(get, names)]

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.received = []
        with torch.no_grad():
            for name, t in tensors:
                dest = self.tensors.get(name)
                if dest is None:
                    raise ManifestError(f"the module has no parameter or buffer {name!r}")
                if dest.data_ptr() != t.data_ptr():  # already in place when rejoined into it
                    dest.data.copy_(t)
                self.received.append(name)

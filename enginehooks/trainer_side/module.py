"""Adapter for a plain `nn.Module` or a Hugging Face `PreTrainedModel`.

Hands the engine HF checkpoint names (wrapper prefixes from DDP, torch.compile,
activation checkpointing and FSDP1 stripped) in the engine's dtype, one tensor at a
time: the cast happens as each tensor is pulled, so the peak extra memory is one
tensor, never a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from enginehooks.dtypes import dtype_name
from enginehooks.manifest import TensorSpec

# Segments that wrappers insert into parameter names; HF checkpoints never hold them.
WRAPPER_SEGMENTS: tuple[str, ...] = (
    "_orig_mod.",  # torch.compile
    "_checkpoint_wrapped_module.",  # activation checkpointing
    "_fsdp_wrapped_module.",  # FSDP1
    "_fpw_module.",  # FSDP1 flat-param wrapper
)
LEADING_PREFIXES: tuple[str, ...] = ("module.",)  # DDP / DataParallel


def hf_name(name: str, strip: Sequence[str] = WRAPPER_SEGMENTS,
            leading: Sequence[str] = LEADING_PREFIXES) -> str:
    for seg in strip:
        name = name.replace(seg, "")
    changed = True
    while changed:
        changed = False
        for p in leading:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


class ModuleAdapter:
    """Streams `model.state_dict()` with HF names, cast to `dtype` (floating tensors)."""

    name = "module"

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        include: Callable[[str], bool] | None = None,
        rename: Callable[[str], str] = hf_name,
    ) -> None:
        self.model = model
        self.dtype = dtype
        self.include = include
        self.rename = rename

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return isinstance(model, nn.Module)

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        # state_dict() of a plain module returns references, not copies; tied weights
        # (embed_tokens / lm_head) appear under both names, which engines need.
        for raw, t in self.model.state_dict(keep_vars=False).items():
            name = self.rename(raw)
            if self.include is None or self.include(name):
                yield name, t

    def _out_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, dtype_name(self._out_dtype(t)), tuple(t.shape))
            for name, t in self._items()
        ]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, t in self._items():
                yield name, t.detach().to(self._out_dtype(t)).contiguous()


class StateDictAdapter:
    """Streams a `{name: tensor}` mapping: a state dict loaded from a checkpoint, or
    tensors a custom converter produced. Names are used as given (they must already be
    HF checkpoint names); floating tensors are cast to `dtype`. `produced` counts the
    tensors handed out so far, which tells, after a refused push, that nothing moved."""

    name = "state_dict"

    def __init__(self, tensors: Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype | None = None) -> None:
        self.tensors = tensors
        self.dtype = dtype
        self.produced = 0

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return isinstance(model, Mapping) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())

    def _out_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, dtype_name(self._out_dtype(t)), tuple(t.shape))
                for n, t in self.tensors.items()]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, t in self.tensors.items():
                self.produced += 1
                yield name, t.detach().to(self._out_dtype(t)).contiguous()

"""Adapters for an unsharded model: a plain `nn.Module` / Hugging Face model, and a
`{name: tensor}` mapping that is already in checkpoint format.

The module's tensors are referenced, never copied as a whole: each checkpoint tensor
is produced (converted by transformers, cast to the wire dtype) as the stream is
pulled, one layer at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from enginehooks.core.checkpoint_format import Source
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.contract import CheckpointAdapter, TrainerAdapter


class ModuleAdapter(CheckpointAdapter):
    """Streams an `nn.Module` (a Hugging Face model, or any module) in checkpoint format.

    Wrappers are seen through (DDP, torch.compile, activation checkpointing): their
    name segments are stripped (`rename`) and transformers' conversion runs on the
    Hugging Face model inside.
    """

    name = "module"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return isinstance(model, nn.Module)

    def _module_state(self) -> dict[str, torch.Tensor]:
        # References, not copies; tied weights appear under both names here and the
        # checkpoint format decides which one travels.
        return {self.rename(raw): t for raw, t in self.model.state_dict(keep_vars=False).items()}

    def _sources(self) -> list[Source]:
        return [Source(n, t.dtype, tuple(t.shape))
                for n, t in self._once("state", self._module_state).items()]

    def _produce(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        state = self._once("state", self._module_state)
        return {n: state[n] for n in names}


class StateDictAdapter(TrainerAdapter):
    """Streams a `{name: tensor}` mapping: a state dict loaded from a checkpoint, or
    tensors a custom converter produced. Names are used as given (they must already be
    checkpoint names); floating tensors are cast to the wire dtype. `produced` counts
    the tensors handed out so far, which tells, after a refused push, that nothing moved."""

    name = "state_dict"

    def __init__(self, tensors: Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype | None = None,
                 dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        super().__init__(tensors, dtype=dtype, dtypes=dtypes)
        self.tensors = tensors
        self.produced = 0

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return isinstance(model, Mapping) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())

    def specs(self) -> list[TensorSpec]:
        return [self.wire_spec(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, t in self.tensors.items():
                self.produced += 1
                yield name, self.to_wire(t, name)

    def layout_key(self) -> str | None:
        """Names in order, dtypes, shapes and devices of the mapping, and the wire dtypes:
        `specs()` is a function of these alone, so a push of a mapping with the same key
        (new values, the same layout: a training loop's state dict) reuses the plan."""
        from enginehooks.core.dtypes import dtype_name
        from enginehooks.core.layout import layout_key

        tensors = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in self.tensors.items()]
        devices = sorted({str(t.device) for t in self.tensors.values()})
        dtypes = {n: dtype_name(d) if d is not None else None for n, d in self.dtypes.items()}
        return layout_key([type(self).__name__, tensors, devices,
                           dtype_name(self.dtype) if self.dtype is not None else None,
                           dtypes])

    def reuse_plan(self, other: TrainerAdapter, specs: Sequence[TensorSpec]) -> bool:
        """Nothing to take over: the specs are the key's names, shapes and wire dtypes."""
        return type(other) is type(self)

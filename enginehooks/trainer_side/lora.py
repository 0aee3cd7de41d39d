"""PEFT models (LoRA): push the merged weights, so the engine serves the adapted model.

Engines load checkpoints in the base model's layout, so the stream carries, under HF
names, `W + delta` for every LoRA-wrapped weight (`q_proj.base_layer.weight` ->
`q_proj.weight`), and nothing of the adapter tensors themselves.

Two ways to merge, same values:
- `merge="delta"` (default): each merged weight is computed as it is pulled,
  `base + sum(layer.get_delta_weight(a))` over the active, not-yet-merged adapters
  (PEFT's own delta, which is what `merge()` adds). The trainer's weights are never
  touched, so nothing has to be restored after a failed push, and the extra memory
  is one weight and its delta.
- `merge="inplace"`: PEFT's `merge_adapter()` before streaming and `unmerge_adapter()`
  after (also when the push fails): merge, stream, unmerge. Needed for LoRA variants
  whose merge is not a plain sum (DoRA) and other tuners; note that unmerge subtracts
  the delta again, so the base weights come back equal only up to rounding.

`modules_to_save` copies (e.g. a fully trained `lm_head`) travel under the wrapped
module's name when active; the original copy otherwise.

An FSDP-sharded PEFT model is not handled here yet (its LoRA factors are DTensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from enginehooks.dtypes import dtype_name
from enginehooks.errors import EngineHooksError
from enginehooks.manifest import TensorSpec
from enginehooks.trainer_side.module import hf_name

_ADAPTER_SEGMENTS = frozenset({
    "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
    "lora_dropout",
})


class PeftAdapter:
    """A `peft.PeftModel` streamed as its merged base model, with HF names."""

    name = "peft"

    def __init__(self, model: Any, *, dtype: torch.dtype | None = None,
                 include: Callable[[str], bool] | None = None,
                 rename: Callable[[str], str] = hf_name, merge: str = "delta") -> None:
        if merge not in ("delta", "inplace"):
            raise ValueError(f"merge must be 'delta' or 'inplace', got {merge!r}")
        self.model = model
        self.base = model.get_base_model()
        self.dtype = dtype
        self.include = include
        self.rename = rename
        self.merge = merge
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.base.parameters()):
            raise EngineHooksError("a sharded (DTensor) PEFT model is not supported yet: "
                                   "push from an unsharded copy, or merge_and_unload first")

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model")

    def _out_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype

    def _map(self, raw: str) -> tuple[str, Any] | None:
        """HF name of a base-model state_dict key and the LoRA layer owning it (or None);
        None for adapter tensors and inactive copies."""
        segs = raw.split(".")
        if _ADAPTER_SEGMENTS.intersection(segs):
            return None
        for marker in ("original_module", "modules_to_save"):
            if marker in segs:
                i = segs.index(marker)
                wrapper = self.base.get_submodule(".".join(segs[:i]))
                active = [a for a in getattr(wrapper, "active_adapters", [])
                          if a in wrapper.modules_to_save]
                use_copy = bool(active) and not getattr(wrapper, "disable_adapters", False)
                if marker == "original_module":
                    if use_copy:
                        return None
                    segs = segs[:i] + segs[i + 1:]
                else:
                    if not use_copy or segs[i + 1] != active[0]:
                        return None
                    segs = segs[:i] + segs[i + 2:]
                break
        layer = None
        if "base_layer" in segs:
            i = segs.index("base_layer")
            layer = self.base.get_submodule(".".join(segs[:i]))
            segs = segs[:i] + segs[i + 1:]
            if segs[-1] != "weight":
                layer = None  # biases are not adapted by LoRA
        name = self.rename(".".join(segs))
        if self.include is not None and not self.include(name):
            return None
        return name, layer

    def _raw(self) -> Iterator[tuple[str, torch.Tensor, Any]]:
        for raw, t in self.base.state_dict().items():
            mapped = self._map(raw)
            if mapped is not None:
                yield mapped[0], t, mapped[1]

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, dtype_name(self._out_dtype(t)), tuple(t.shape))
                for name, t, _ in self._raw()]

    def _delta(self, layer: Any, base: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "disable_adapters", False):
            return base
        merged = set(getattr(layer, "merged_adapters", []))
        variants = getattr(layer, "lora_variants", {}) or {}
        out = base
        for a in layer.active_adapters:
            if a in merged or not (a in getattr(layer, "lora_A", {})
                                   or a in getattr(layer, "lora_embedding_A", {})):
                continue
            if a in variants or getattr(layer, "use_dora", {}).get(a, False):
                raise EngineHooksError(
                    f"adapter {a!r} is a LoRA variant ({type(variants.get(a)).__name__}) whose "
                    "merge is not a sum: use PeftAdapter(model, merge='inplace')")
            out = out + layer.get_delta_weight(a).to(base.dtype)
        return out

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        inplace = self.merge == "inplace"
        with torch.no_grad():
            if inplace:
                self.model.base_model.merge_adapter()
            try:
                for name, t, layer in self._raw():
                    full = self._delta(layer, t) if (layer is not None and not inplace) else t
                    yield name, full.detach().to(self._out_dtype(full)).contiguous()
                    del full
            finally:
                if inplace:
                    self.model.base_model.unmerge_adapter()

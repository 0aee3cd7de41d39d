"""PEFT models (LoRA): push the merged weights, so the engine serves the adapted model.

Engines load checkpoints in the base model's layout, so the stream carries `W + delta`
for every LoRA-wrapped weight under the base model's name (`q_proj.base_layer.weight`
-> `q_proj.weight`), then in the checkpoint format (transformers' own conversion, as
for any module), and nothing of the adapter tensors themselves.

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

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from enginehooks.core.checkpoint_format import CheckpointFormat, Source
from enginehooks.core.errors import ConfigError, EngineHooksError
from enginehooks.trainer_side.contract import CheckpointAdapter, hf_name

_ADAPTER_SEGMENTS = frozenset({
    "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
    "lora_dropout",
})


class PeftAdapter(CheckpointAdapter):
    """A `peft.PeftModel` streamed as its merged base model, in checkpoint format."""

    name = "peft"

    def __init__(self, model: Any, *, dtype: torch.dtype | None = None,
                 dtypes: Mapping[str, torch.dtype] | None = None,
                 include: Callable[[str], bool] | None = None,
                 rename: Callable[[str], str] = hf_name, merge: str = "delta") -> None:
        if merge not in ("delta", "inplace"):
            raise ConfigError(f"merge must be 'delta' or 'inplace', got {merge!r}")
        super().__init__(model, dtype=dtype, dtypes=dtypes, include=include, rename=rename)
        self.base = model.get_base_model()
        self.merge = merge
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.base.parameters()):
            raise EngineHooksError("a sharded (DTensor) PEFT model is not supported yet: "
                                   "push from an unsharded copy, or merge_and_unload first")

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model")

    def _checkpoint_format(self) -> CheckpointFormat:
        # transformers looks tensors up by name to find tied ones, but PEFT's wrappers
        # hide a parameter they target (a ParamWrapper on MoE experts): say which base
        # names are one tensor instead.
        tensors = {}
        for raw, t in self.base.state_dict(keep_vars=True).items():
            mapped = self._map(raw)
            if mapped is not None:
                tensors[mapped[0]] = t
        return CheckpointFormat(self.base, identity=tensors.__getitem__)

    def _map(self, raw: str) -> tuple[str, Any] | None:
        """Module-layout name of a base-model state_dict key and the LoRA layer owning
        it (or None); None for adapter tensors and inactive copies."""
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
        # LoRA layers wrap their base module (`base_layer`); LoRA on parameters (PEFT's
        # ParamWrapper, e.g. the fused experts of an MoE layer) nests one wrapper per
        # targeted parameter. The layer whose delta applies is the wrapper that targets
        # this tensor: its `parameter_name`, or a module's `weight` (never a bias).
        wrappers = [self.base.get_submodule(".".join(segs[:i]))
                    for i, s in enumerate(segs) if s == "base_layer"]
        segs = [s for s in segs if s != "base_layer"]
        layer = next((w for w in wrappers
                      if getattr(w, "parameter_name", None) == segs[-1]
                      or (getattr(w, "parameter_name", None) is None and segs[-1] == "weight")),
                     None)
        return self.rename(".".join(segs)), layer

    def _raw(self) -> dict[str, tuple[torch.Tensor, Any]]:
        out = {}
        for raw, t in self.base.state_dict().items():
            mapped = self._map(raw)
            if mapped is not None:
                out[mapped[0]] = (t, mapped[1])
        return out

    def _sources(self) -> list[Source]:
        return [Source(n, t.dtype, tuple(t.shape))
                for n, (t, _layer) in self._once("raw", self._raw).items()]

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

    def _produce(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        raw = self._once("raw", self._raw)
        inplace = self.merge == "inplace"
        out = {}
        for name in names:
            t, layer = raw[name]
            out[name] = self._delta(layer, t) if (layer is not None and not inplace) else t
        return out

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.merge != "inplace":
            return self._items()
        return self._merged_in_place()

    def _merged_in_place(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            self.model.base_model.merge_adapter()
        # A merge may give a weight new storage (PEFT's safe merge): read the state
        # dict again after it, not the plan's references.
        self._planned_now = False
        try:
            yield from self._items()
        finally:
            with torch.no_grad():
                self.model.base_model.unmerge_adapter()

"""FSDP2 (`fully_shard`, DTensor) and FSDP1 (`FullyShardedDataParallel`) adapters.

Both plan from metadata (no gather) and gather lazily, in lockstep on every rank
(see `lockstep.py`), so the trainer never holds the whole model unsharded:

- FSDP2: one parameter at a time. The local shard is cast to the engine dtype first
  (a local op; a cast is elementwise, so gathering the cast shards is bit-identical to
  casting the gathered tensor), then `full_tensor()` all-gathers it: half the bytes on
  the trainer's wire and in memory for bf16 engines fed from fp32 master weights.
  Peak extra memory: the largest parameter in the engine dtype (plus the transport's
  two buckets on the sender).
- FSDP1 shards a flat concatenation of each wrapped unit's parameters, so a single
  parameter may straddle ranks: the smallest gather is one unit. We unshard one unit
  at a time (`summon_full_params(unit, recurse=False, writeback=False)`) and copy its
  parameters out one by one. Peak: the largest unit's flat parameter plus one
  parameter. `state_dict` with `FULL_STATE_DICT` (even `rank0_only` with CPU offload)
  is not bounded: it materialises the whole model on rank 0 before returning.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from enginehooks.dtypes import dtype_name
from enginehooks.manifest import TensorSpec
from enginehooks.trainer_side.lockstep import LockstepAdapter


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


class FSDP2Adapter(LockstepAdapter):
    """Any module with DTensor parameters: FSDP2 `fully_shard`, HSDP, DTensor TP.

    Options (besides `dtype`, `include`, `rename`): `group` (the process group of
    every rank that iterates; default: the parameters' mesh group for a 1-D mesh, the
    default group otherwise), `sender` (rank of the sender within it), `timeout_s`,
    `start_timeout_s` (see `Lockstep`).
    """

    name = "fsdp2"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        dt = _dtensor_type()
        return (dt is not None and isinstance(model, nn.Module)
                and any(isinstance(p, dt) for p in model.parameters()))

    def default_group(self) -> Any:
        dt = _dtensor_type()
        for p in self.model.parameters():
            if dt is not None and isinstance(p, dt):
                mesh = p.device_mesh
                return mesh.get_group() if mesh.ndim == 1 else None
        return None

    def _raw(self) -> Iterator[tuple[str, torch.Tensor]]:
        # FSDP2's state_dict holds the sharded DTensors (global shapes), no collective;
        # tied weights appear under both names, as engines expect.
        for raw, t in self.model.state_dict().items():
            name = self.rename(raw)
            if self._keep(name):
                yield name, t

    def _entries(self) -> list[TensorSpec]:
        return [TensorSpec(name, dtype_name(self._out_dtype(t)), tuple(t.shape))
                for name, t in self._raw()]

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        dt = _dtensor_type()
        with torch.no_grad():
            for name, t in self._raw():
                out = self._out_dtype(t)
                if dt is not None and isinstance(t, dt):
                    local = t if t.dtype == out else t.to(out)  # local cast, then gather
                    full = local.full_tensor()
                    del local
                else:
                    full = t.detach().to(out)
                yield name, full.contiguous()
                del full


class FSDP1Adapter(LockstepAdapter):
    """A root `FullyShardedDataParallel` module (FSDP1), gathered one unit at a time.

    Wrap each decoder layer as its own unit (the usual `auto_wrap_policy`): the peak is
    then one layer, not the model. Parameters shared between units (tied embeddings)
    travel under each of their names.
    """

    name = "fsdp1"

    @classmethod
    def accepts(cls, model: Any) -> bool:
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        except ImportError:
            return False
        return isinstance(model, FSDP)

    def default_group(self) -> Any:
        return getattr(self.model, "process_group", None)

    def _units(self) -> list[tuple[str, Any, list[tuple[str, tuple[int, ...], torch.dtype]]]]:
        """(prefix, unit, [(fqn in unit, shape, dtype)]) for every unit owning parameters."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        out = []
        for prefix, m in self.model.named_modules():
            if not isinstance(m, FSDP) or m._handle is None:
                continue
            flat = m._handle.flat_param
            params = [(fqn, tuple(shape), flat.dtype) for fqn, shape in zip(flat._fqns, flat._shapes)]
            for info in getattr(flat, "_shared_param_infos", ()):
                prim = f"{info.prim_module_name}.{info.prim_param_name}".lstrip(".")
                shape = next(s for f, s, _ in params if f == prim)
                params.append((f"{info.module_name}.{info.param_name}".lstrip("."), shape, flat.dtype))
            out.append((prefix, m, params))
        return out

    def _buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Persistent buffers: FSDP1 does not shard them."""
        for mod_name, mod in self.model.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for b_name, b in mod.named_buffers(recurse=False):
                if b_name not in skip:
                    yield f"{mod_name}.{b_name}".lstrip("."), b

    def _entries(self) -> list[TensorSpec]:
        specs = []
        for prefix, _unit, params in self._units():
            for fqn, shape, dt in params:
                name = self.rename(f"{prefix}.{fqn}".lstrip("."))
                if self._keep(name):
                    out = self.wire_dtype if (self.wire_dtype is not None and dt.is_floating_point) else dt
                    specs.append(TensorSpec(name, dtype_name(out), shape))
        for raw, b in self._buffers():
            name = self.rename(raw)
            if self._keep(name):
                specs.append(TensorSpec(name, dtype_name(self._out_dtype(b)), tuple(b.shape)))
        return specs

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with torch.no_grad():
            for prefix, unit, params in self._units():
                wanted = [(fqn, self.rename(f"{prefix}.{fqn}".lstrip("."))) for fqn, _, _ in params]
                wanted = [(fqn, name) for fqn, name in wanted if self._keep(name)]
                if not wanted:
                    continue
                # Collective: every rank unshards this unit (and only this unit).
                with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                    for fqn, name in wanted:
                        p = unit.module.get_parameter(fqn)
                        # A copy: the unsharded storage is freed when the context exits.
                        yield name, p.detach().to(self._out_dtype(p), copy=True).contiguous()
            for raw, b in self._buffers():
                name = self.rename(raw)
                if self._keep(name):
                    yield name, b.detach().to(self._out_dtype(b)).contiguous()

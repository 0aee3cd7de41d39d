"""FSDP2 (`fully_shard`, DTensor) and FSDP1 (`FullyShardedDataParallel`) adapters.

Both plan from metadata (no gather) and gather lazily, in lockstep on every rank (see
`lockstep.py`), one checkpoint group (a layer) at a time, which transformers' own
conversion then turns into the checkpoint format (`core/checkpoint_format.py`), so the
trainer never holds the whole model unsharded:

- FSDP2: each parameter's local shard is cast to the wire dtype first (a local op;
  a cast is elementwise, so gathering the cast shards is bit-identical to casting the
  gathered tensor), then `full_tensor()` all-gathers it: half the bytes on the
  trainer's wire and in memory for bf16 engines fed from fp32 master weights. Peak
  extra memory: one layer in the wire dtype (plus the transport's two buckets on the
  sender).
- FSDP1 shards a flat concatenation of each wrapped unit's parameters, so a single
  parameter may straddle ranks: the smallest gather is one unit. The units holding a
  group's parameters are unsharded one at a time (`summon_full_params(unit,
  recurse=False, writeback=False)`) and their parameters copied out. Peak: the
  largest unit's flat parameter plus one layer. `state_dict` with `FULL_STATE_DICT`
  is not bounded: it materialises the whole model on rank 0 before returning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from enginehooks.core.checkpoint_format import CheckpointFormat, Source
from enginehooks.trainer_side.contract import CheckpointAdapter, hf_name
from enginehooks.trainer_side.lockstep import LockstepAdapter
from enginehooks.trainer_side.state_refs import StateRefs, StreamRecord, local_tensor, state_of

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from enginehooks.core.schedule import Slice, Transfer


def _dtensor_type() -> type[DTensor] | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


class FSDP2Adapter(LockstepAdapter, CheckpointAdapter):
    """Any module with DTensor parameters: FSDP2 `fully_shard`, HSDP, DTensor TP.

    Options (besides `dtype`, `include`, `rename`): `group` (the process group of
    every rank that iterates; default: the parameters' mesh group for a 1-D mesh, the
    default group otherwise), `sender` (rank of the sender within it), `timeout_s`,
    `start_timeout_s` (see `Lockstep`), `flag_elements` (elements between two lockstep
    flags, `lockstep.flag_points`).

    Per push it reads the model's `state_dict()` once (references to the DTensors, no
    collective), or not at all where the tensors registered on the model are the ones
    the last read found (`state_refs.py`); a tensor whose mesh has one rank is taken as
    its local tensor (no gather and no DTensor dispatch).
    """

    name = "fsdp2"
    _refs: StateRefs | None = None  # the model's state map of this push's read
    # The lockstep flags wrap the checkpoint-format plan and stream (the lockstep base
    # declares both abstract and comes first in the bases, so name them here).
    _plan = CheckpointAdapter._plan

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint-format stream; replayed where the last push's proves to be
        this one's (`state_refs.StreamRecord`), recorded where it may be replayed."""
        if not self._planned_now:  # a stream without a plan of its own: read anew
            self._per_push.clear()
        state = self._once("state", self._module_state)
        self._planned_now = True  # the stream below shares this read
        refs, layout = self._refs, self._layout
        # One rank alone only: ranks that stream in lockstep run collectives, and every
        # rank must make the same choice (their tensors are gathered, never views, so
        # nothing would be recorded there anyway)
        key = (("stream", id(layout)) if refs is not None and layout is not None
               and self.owners is None and self.lockstep.alone else None)
        rec = refs.memos.get(key) if refs is not None and key is not None else None
        if (isinstance(rec, StreamRecord) and rec.layout is layout and rec.refs is refs
                and rec.holds(state)):
            self._planned_now = self._fresh = False
            self._per_push.clear()
            yield from rec.items
            return
        record = None
        if refs is not None and key is not None:
            refs.memos.pop(key, None)  # a stale record never outlives a new stream
            record = StreamRecord.start(refs, layout, key, state)
        if record is not None and layout is not None:  # kept once its last tensor is
            # out: a consumer need not ask for the end of the stream
            record.expected = len([o for g in layout.groups for o in g.outputs
                                   if self._keep(o.name)])
        for name, t in CheckpointAdapter._items(self):
            if record is not None:
                record = record.add(name, t)
            yield name, t

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

    def _module_state(self) -> dict[str, torch.Tensor]:
        # FSDP2's state_dict holds the sharded DTensors (global shapes), no collective.
        state, self._refs = state_of(self.model)
        return {self.rename(raw): t for raw, t in state.items()}

    def layout_key(self) -> str | None:
        """As `CheckpointAdapter.layout_key`, remembered with the model's state map: while
        the map holds, names, dtypes and shapes are those it was built from, so the key
        of the same options is the same."""
        self._refs = None
        self._per_push.clear()  # this push reads the model anew, once
        self._once("state", self._module_state)
        refs = self._refs
        # Remembered only for the default `include` and `rename`: the map outlives
        # adapters, and a function's id may be reused by another function later.
        memo = (("layout_key", self.dtype, tuple(sorted(self.dtypes.items(), key=str)))
                if refs is not None and self.include is None and self.rename is hf_name
                else None)
        if refs is not None and memo in refs.memos:
            self._planned_now = self._fresh = True  # as the full method leaves them
            return cast(str, refs.memos[memo])
        key = self._key_of_read()  # from the read above: the model is walked once
        if refs is not None and memo is not None:
            refs.memos[memo] = key
        return key

    def _sources(self) -> list[Source]:
        return [Source(n, t.dtype, tuple(t.shape))
                for n, t in self._once("state", self._module_state).items()]

    def _produce_for(self, names: Sequence[str], dests: Mapping[str, set[int]]
                     ) -> Mapping[str, torch.Tensor]:
        """A tensor one rank sends is gathered to that rank alone (`dist.gather`: the
        others send their shard, receive nothing, convert nothing); one that several
        ranks need, or another layout than FSDP2's, is all-gathered as before."""
        dt = _dtensor_type()
        state = self._once("state", self._module_state)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            t, dst = state[name], dests.get(name, set())
            if dt is None or not isinstance(t, dt) or len(dst) != 1 or _whole_here(t):
                out.update(self._produce([name]))
                continue
            wire = self.precast_dtype(t.dtype)
            local = t.to_local()
            local = local if local.dtype == wire else local.to(wire)
            handled, got = _gather_to(local, t, next(iter(dst)))
            del local
            if not handled:  # not FSDP2's layout: every rank gathers
                out.update(self._produce([name]))
            elif got is not None:
                out[name] = got
        return out

    def _produce(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        dt = _dtensor_type()
        state = self._once("state", self._module_state)  # one state_dict() per push
        out: dict[str, torch.Tensor] = {}
        for name in names:
            t = state[name]
            wire = self.precast_dtype(t.dtype)
            if dt is not None and isinstance(t, dt):
                if _whole_here(t):
                    # one rank holds the whole tensor: no gather (and no DTensor
                    # dispatch); every rank decides alike, from the mesh alone
                    local = local_tensor(t)
                    if local.requires_grad:
                        local = local.detach()
                    out[name] = local if local.dtype == wire else local.to(wire)
                    continue
                # local cast, then gather (torch's stubs type a DTensor's `.to` as Tensor)
                local = t if t.dtype == wire else cast("DTensor", t.to(wire))
                out[name] = local.full_tensor()
                del local
            else:
                out[name] = t.detach().to(wire)
        return out


def _gather_to(local: torch.Tensor, t: DTensor, dst: int
               ) -> tuple[bool, torch.Tensor | None]:
    """`t` (its `local` shard, already cast) gathered on global rank `dst` only: (True,
    the tensor) there, (True, None) on the other ranks, which send their shard and get
    nothing. For a 1-D mesh sharded on dim 0 (FSDP2's layout; uneven shards are padded
    to the largest, as `torch.chunk` cuts them); any other layout answers (False, None)
    on every rank, which then gathers everywhere."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    if mesh.ndim != 1 or len(t.placements) != 1:
        return False, None
    p = t.placements[0]
    if not (isinstance(p, Shard) and p.dim == 0) or t.dim() == 0:
        return False, None
    group, world = mesh.get_group(), mesh.size()
    rows = t.shape[0]
    chunk = -(-rows // world)
    if local.shape[0] == chunk and local.is_contiguous():
        padded = local  # a full shard travels as it is
    else:
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]].copy_(local)
    if dist.get_rank() != dst:
        dist.gather(padded, None, dst=dst, group=group)
        return True, None
    # every shard lands in its place of one buffer: the tensor is a view of it, no cat
    whole = padded.new_empty((chunk * world, *padded.shape[1:]))
    dist.gather(padded, list(whole.split(chunk)), dst=dst, group=group)
    return True, whole[:rows]


def _whole_here(t: DTensor) -> bool:
    """Whether `t`'s local tensor is the whole tensor: a mesh of one rank whose
    placements hold no pending reduction (`Partial`), so `full_tensor()` would only
    copy it."""
    return t.device_mesh.size() == 1 and not any(p.is_partial() for p in t.placements)


class FSDP1Adapter(LockstepAdapter, CheckpointAdapter):
    """A root `FullyShardedDataParallel` module (FSDP1), gathered one unit at a time.

    Wrap each decoder layer as its own unit (the usual `auto_wrap_policy`): the peak is
    then one layer, not the model. Parameters shared between units (tied embeddings)
    are one tensor to the checkpoint format, which keeps the name transformers keeps.
    """

    name = "fsdp1"
    _plan = CheckpointAdapter._plan
    _items = CheckpointAdapter._items

    @classmethod
    def accepts(cls, model: Any) -> bool:
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        except ImportError:
            return False
        return isinstance(model, FSDP)

    def default_group(self) -> Any:
        return getattr(self.model, "process_group", None)

    def _units(self) -> list[tuple[str, Any, list[tuple[str, str, tuple[int, ...], torch.dtype]]]]:
        """(prefix, unit, [(fqn in unit, full name, shape, dtype)]) for every unit that
        owns parameters; shared parameters are listed under each of their names."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        out = []
        for prefix, m in self.model.named_modules():
            if not isinstance(m, FSDP) or m._handle is None:
                continue
            flat = m._handle.flat_param
            params = [(fqn, tuple(shape)) for fqn, shape in zip(flat._fqns, flat._shapes)]
            for info in getattr(flat, "_shared_param_infos", ()):
                prim = f"{info.prim_module_name}.{info.prim_param_name}".lstrip(".")
                shape = next(s for f, s in params if f == prim)
                params.append((f"{info.module_name}.{info.param_name}".lstrip("."), shape))
            out.append((prefix, m, [(fqn, self.rename(f"{prefix}.{fqn}".lstrip(".")), shape,
                                     flat.dtype) for fqn, shape in params]))
        return out

    def _aliases(self) -> dict[str, str]:
        """Full name -> the name of the parameter it shares storage with (FSDP1 keeps
        the record; the module no longer holds the original parameters)."""
        aliases: dict[str, str] = {}
        for prefix, unit, _params in self._units():
            for info in getattr(unit._handle.flat_param, "_shared_param_infos", ()):
                alias = self.rename(f"{prefix}.{info.module_name}.{info.param_name}".lstrip("."))
                aliases[alias] = self.rename(
                    f"{prefix}.{info.prim_module_name}.{info.prim_param_name}".lstrip("."))
        return aliases

    def _checkpoint_format(self) -> CheckpointFormat:
        aliases = self._aliases()
        tokens: dict[str, object] = {}
        return CheckpointFormat(self.model, identity=lambda n: tokens.setdefault(
            aliases.get(n, n), object()))

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers: FSDP1 does not shard them."""
        out = {}
        for mod_name, mod in self.model.named_modules():
            skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
            for b_name, b in mod.named_buffers(recurse=False):
                if b_name not in skip:
                    out[self.rename(f"{mod_name}.{b_name}".lstrip("."))] = b
        return out

    def _sources(self) -> list[Source]:
        srcs = [Source(name, dt, shape) for _p, _u, params in self._units()
                for _fqn, name, shape, dt in params]
        srcs += [Source(n, b.dtype, tuple(b.shape)) for n, b in self._buffers().items()]
        return srcs

    def _produce(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wanted = set(names)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for _prefix, unit, params in self._units():
                mine = [(fqn, name) for fqn, name, _s, _d in params if name in wanted]
                if not mine:
                    continue
                # Collective: every rank unshards this unit (and only this unit).
                with FSDP.summon_full_params(unit, recurse=False, writeback=False):
                    for fqn, name in mine:
                        p = unit.module.get_parameter(fqn)
                        # A copy: the unsharded storage is freed when the context exits.
                        out[name] = p.detach().to(self.precast_dtype(p.dtype), copy=True)
            buffers = self._buffers()
            out.update({n: buffers[n] for n in names if n in buffers})
        return out


class FSDP2Shards:
    """What each rank of an FSDP2 model holds, for shard-direct (issue 40): no gather.

    `holds()` is every rank's dim-0 shard of every tensor as byte ranges of the tensor in
    its wire dtype (`core/schedule.dim0_shards`), read from the DTensors' placements
    alone, so every rank computes the same answer without a collective; `source(t)` is
    this rank's bytes of a transfer, from its local shard cast to the wire dtype (a cast is
    elementwise: the cast shard's bytes are the cast tensor's). Ranks are the mesh's
    (`sender` index = mesh rank).

    Only models whose checkpoint format is their module layout (dense models), on a 1-D
    mesh with `Shard(0)` or `Replicate()` placements: anything else is refused by name
    (`ConfigError`) rather than guessed at; transformers' conversions on save (fused MoE
    experts) and Megatron's partitions are not derived yet.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        from enginehooks.core.errors import ConfigError

        dt = _dtensor_type()
        # the model's state map (`state_refs.py`): a push of the same model walks no
        # module and runs no DTensor dispatch per tensor (`state_dict()`'s detach and
        # `to_local()` cost ~40 us a tensor: 4.4 ms of a 7B-wide push's send)
        state, _ = state_of(model)
        self.dtype = dtype
        self.local: dict[str, torch.Tensor] = {}
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._placement: dict[str, str] = {}
        self.world, self.rank = 1, 0
        for name, t in state.items():
            wire = self.wire_dtype(t.dtype)
            self.specs[name] = (wire, tuple(t.shape))
            if dt is None or not isinstance(t, dt):
                raise ConfigError(f"{name}: not a DTensor; shard-direct reads FSDP2 placements")
            mesh = t.device_mesh
            if mesh.ndim != 1 or len(t.placements) != 1:
                raise ConfigError(f"{name}: a {mesh.ndim}-D mesh; shard-direct takes 1-D ones")
            p = t.placements[0]
            kind = "shard" if p.is_shard(0) else "replicate" if p.is_replicate() else ""
            if not kind:
                raise ConfigError(f"{name}: placement {p}; shard-direct takes Shard(0) and "
                                  "Replicate()")
            self.world, self.rank = mesh.size(), mesh.get_local_rank()
            self._placement[name] = kind
            local = local_tensor(t)
            self.local[name] = local.detach() if local.requires_grad else local

    def rename(self, fn: Callable[[str], str]) -> None:
        """Name every tensor `fn(module name)` (the adapter's checkpoint names)."""
        self.specs = {fn(n): v for n, v in self.specs.items()}
        self.local = {fn(n): v for n, v in self.local.items()}
        self._placement = {fn(n): v for n, v in self._placement.items()}
        self.__dict__.pop("_mine", None)
        self.__dict__.pop("_by_name", None)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def holds(self) -> dict[int, list[Slice]]:
        """Every rank's bytes, by mesh rank."""
        from enginehooks.core.schedule import Slice, dim0_shards

        out: dict[int, list[Slice]] = {r: [] for r in range(self.world)}
        for name, (wire, shape) in self.specs.items():
            if self._placement[name] == "shard" and len(shape) > 0:
                for r, s in dim0_shards(name, shape, wire.itemsize, self.world).items():
                    out[r].append(s)
            else:
                n = wire.itemsize
                for size in shape:
                    n *= size
                for r in range(self.world):
                    out[r].append(Slice(name, 0, n))
        return out

    def source(self, t: Transfer) -> torch.Tensor:
        """This rank's bytes [t.start, t.stop) of tensor t.name (1-D uint8)."""
        from enginehooks.core.errors import ConfigError

        for a, b, raw in self.segments(t.name):
            if a <= t.start and t.stop <= b:
                return raw[t.start - a: t.stop - a]
        raise ConfigError(f"trainer rank {self.rank} holds no bytes [{t.start}, {t.stop})"
                          f" of {t.name!r}")

    def segments(self, name: str) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's bytes of tensor `name` as one segment (start, stop, 1-D uint8):
        its local shard in the wire dtype (`shard_runs.Places`: the sender finds every
        range's address from it without a call per range). A cast is made anew on every
        call, never kept: an optimizer step may write the shard in place by routes no
        version counter sees (`.data`), and a kept cast would send the bytes of before
        it. One send asks once per tensor (`shard_direct`'s per-call memo)."""
        from enginehooks.core.errors import ConfigError

        if not hasattr(self, "_by_name"):
            self._by_name = {s.name: s for s in self._held()}
        held = self._by_name.get(name)
        local = self.local.get(name)
        if held is None or local is None:
            return []
        wire = self.specs[name][0]
        local = (local if local.dtype == wire else local.to(wire)).contiguous()
        raw = local.reshape(-1).view(torch.uint8)
        if raw.numel() != held.stop - held.start:
            raise ConfigError(f"{name}: this rank's shard has {raw.numel()} bytes, not the "
                              f"{held.stop - held.start} that Shard(0) gives it")
        return [(held.start, held.stop, raw)]

    def _held(self) -> list[Slice]:
        if not hasattr(self, "_mine"):
            self._mine = self.holds()[self.rank]
        return self._mine

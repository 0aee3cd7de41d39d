"""The trainer-side contract: what every adapter provides, and the one wire cast.

An adapter turns a training model into the update an engine loads: a plan
(`specs()`: names, dtypes, shapes, known without gathering anything) and a lazy
stream (`stream()`: `(name, tensor)` pairs, exactly as planned, one at a time). The
names and layouts are the checkpoint format, what `save_pretrained` would write; for
Hugging Face models they come from transformers' own conversion
(`core/checkpoint_format.py`), never from a table of ours.

`WeightSync.push(model)` picks the adapter with `adapter_for`: the first registered
adapter class (plugins' before the built-ins) whose `accepts(model)` is true.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from enginehooks.core.checkpoint_format import CheckpointFormat, LayoutPlan, Source
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import TensorSpec

# Segments that wrappers insert into parameter names; checkpoints never hold them.
WRAPPER_SEGMENTS: tuple[str, ...] = (
    "_orig_mod.",  # torch.compile
    "_checkpoint_wrapped_module.",  # activation checkpointing
    "_fsdp_wrapped_module.",  # FSDP1
    "_fpw_module.",  # FSDP1 flat-param wrapper
)
LEADING_PREFIXES: tuple[str, ...] = ("module.",)  # DDP / DataParallel


def hf_name(name: str, strip: Sequence[str] = WRAPPER_SEGMENTS,
            leading: Sequence[str] = LEADING_PREFIXES) -> str:
    """`name` without the segments training wrappers add (torch.compile, activation
    checkpointing, FSDP1, DDP): the model's own module-layout name."""
    for seg in strip:
        name = name.replace(seg, "")
    changed = True
    while changed:
        changed = False
        for p in leading:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


class TrainerAdapter(ABC):
    """A training model seen as an update stream.

    Subclasses set `name`, implement `accepts`, `specs` and `stream`, and build tensors
    through `to_wire` so the dtype rule exists once. Adapters whose stream is a
    collective across trainer ranks (`LockstepAdapter`) also implement `cancel`.

    Args of every built-in adapter: `model`; `dtype`: the dtype floating tensors travel
    in (the engine's; `WeightSync` passes it); `dtypes`: per checkpoint name, the
    exceptions the engine reports (a parameter it keeps in float32 while it runs
    bfloat16; None: the tensor's own dtype, for a loader that computes on it before it
    lands). Integer and bool tensors travel as they are.
    """

    name: ClassVar[str] = "adapter"

    def __init__(self, model: Any, *, dtype: torch.dtype | None = None,
                 dtypes: Mapping[str, torch.dtype | None] | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.dtypes: dict[str, torch.dtype | None] = dict(dtypes or {})
        #: where several trainer ranks iterate one stream (a sharded trainer): checkpoint
        #: name -> the global rank that sends it. Each rank then produces (gathers,
        #: converts, casts) only the tensors it sends, and yields `(name, None)` for the
        #: others, whose collectives it still enters. None: every tensor, on every rank.
        self.owners: dict[str, int] | None = None

    @classmethod
    @abstractmethod
    def accepts(cls, model: Any) -> bool:
        """Whether this adapter handles `model` (checked most recently registered first)."""

    @abstractmethod
    def specs(self) -> list[TensorSpec]:
        """Plan one push: names, wire dtypes and shapes in stream order. Never gathers."""

    @abstractmethod
    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The planned tensors, in order, contiguous, in their wire dtype."""

    def layout_key(self) -> str | None:
        """A digest of everything `specs()` depends on (names, dtypes, shapes, the wire
        dtypes, the adapter's options), cheap to compute: a push whose key equals the
        last push's reuses its plan (`core/layout.py`). None: unknown, plan every push."""
        return None

    def reuse_plan(self, other: TrainerAdapter, specs: Sequence[TensorSpec]) -> bool:
        """Take `other`'s plan (an adapter of the same model whose `layout_key()` was
        this one's, `specs` its plan) instead of planning; False if it cannot."""
        return False

    def cancel(self, reason: str) -> None:  # noqa: B027 - optional: single-process adapters
        """The push failed on the sender before or while streaming: release whatever
        waits on this stream (other trainer ranks). Idempotent."""

    # -- the wire cast, the only place it is decided -----------------------------------
    def wire_dtype(self, dtype: torch.dtype, name: str | None = None) -> torch.dtype:
        """The dtype a floating tensor travels in: the engine's exception for `name`
        (None: its own), else `self.dtype`; other tensors keep `dtype`."""
        if not dtype.is_floating_point:
            return dtype
        if name is not None and name in self.dtypes:
            return self.dtypes[name] or dtype
        return self.dtype if self.dtype is not None else dtype

    def wire_spec(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(name, dtype_name(self.wire_dtype(dtype, name)), tuple(shape))

    def to_wire(self, t: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """`t` detached, cast to its wire dtype and contiguous (a copy only if needed).
        The cast is called only where the dtype differs: `.to` of the same dtype returns
        the tensor, but its argument parsing costs ~1 us, paid per tensor per push."""
        t = t.detach()
        wire = self.wire_dtype(t.dtype, name)
        if t.dtype is not wire:
            t = t.to(wire)
        return t.contiguous()


class CheckpointAdapter(TrainerAdapter):
    """Base of the adapters whose model holds its tensors in module layout (plain and
    HF modules, FSDP2, FSDP1, PEFT): they say what they hold (`_sources`) and produce
    one group's tensors on demand (`_produce`, which may be a collective); this class
    turns them into the checkpoint format with `CheckpointFormat`, one group (layer) at
    a time, and casts them with the contract's `to_wire`.

    Extra memory while streaming: one group's module-layout tensors (gathered, for a
    sharded trainer) plus the tensor being cast.

    Args (besides `model`, `dtype`): `include(name) -> bool` filters checkpoint names;
    `rename(name) -> name` maps state-dict keys to the model's own names before the
    conversion (default: strip wrapper segments, `hf_name`).
    """

    def __init__(self, model: Any, *, dtype: torch.dtype | None = None,
                 dtypes: Mapping[str, torch.dtype] | None = None,
                 include: Callable[[str], bool] | None = None,
                 rename: Callable[[str], str] = hf_name) -> None:
        super().__init__(model, dtype=dtype, dtypes=dtypes)
        self.include = include
        self.rename = rename
        self._format: CheckpointFormat | None = None
        self._layout: LayoutPlan | None = None
        #: what one push reads of the model once (its state dict's references), shared
        #: by the plan and every group of the stream (`_once`); emptied when the stream
        #: ends, and by a new plan
        self._per_push: dict[str, Any] = {}
        self._planned_now = False  # the next stream shares the plan's reads
        self._fresh = False  # `layout_key` just read the model: the plan shares it

    # -- what subclasses provide ------------------------------------------------------
    @abstractmethod
    def _sources(self) -> list[Source]:
        """Module-layout tensors (renamed), dtypes and global shapes, in state-dict
        order; nothing is gathered."""

    @abstractmethod
    def _produce(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        """The full tensors of `names` (one group). May run collectives: every trainer
        rank calls it with the same names. May return them already in their wire dtype."""

    def _produce_for(self, names: Sequence[str], dests: Mapping[str, set[int]]
                     ) -> Mapping[str, torch.Tensor]:
        """The full tensors of `names` on the ranks that need them (`dests[name]`: the
        global ranks that send a tensor made from it); other ranks may get nothing for a
        name (they still enter its collectives). Default: every tensor on every rank."""
        return self._produce(names)

    def _checkpoint_format(self) -> CheckpointFormat:
        return CheckpointFormat(self.model)

    def _once(self, key: str, build: Callable[[], Any]) -> Any:
        """`build()` once per push (a `state_dict()` walks every module: ~1-2 ms per call
        on a real model, once per conversion group before). The result holds references
        to the model's tensors, not copies, so it stays current while the push runs."""
        if key not in self._per_push:
            self._per_push[key] = build()
        return self._per_push[key]

    # -- plan and stream ----------------------------------------------------------------
    def _keep(self, name: str) -> bool:
        return self.include is None or self.include(name)

    def _replan(self) -> tuple[CheckpointFormat, LayoutPlan]:
        if not self._fresh:
            self._per_push.clear()  # a new plan reads the model anew
        self._fresh, self._planned_now = False, True
        fmt = self._format = self._format or self._checkpoint_format()
        layout = self._layout = fmt.plan(self._sources())
        return fmt, layout

    def _plan(self) -> list[TensorSpec]:
        _fmt, layout = self._replan()
        return [self.wire_spec(o.name, o.dtype, o.shape) for o in layout.outputs()
                if self._keep(o.name)]

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        fmt, layout = self._format, self._layout
        if fmt is None or layout is None:
            fmt, layout = self._replan()
        if not self._planned_now:  # a stream without a plan of its own (a kept layout)
            self._per_push.clear()
        self._planned_now = self._fresh = False
        owners = self._stream_owners()
        me = _global_rank() if owners is not None else None
        try:
            with torch.no_grad():
                for group in layout.groups:
                    wanted = [o.name for o in group.outputs if self._keep(o.name)]
                    if not wanted:
                        continue
                    if owners is None:
                        converted = dict(fmt.convert(group, self._produce(group.sources)))
                        for name in wanted:
                            yield name, self.to_wire(converted.pop(name), name)
                        del converted
                        continue
                    # several ranks, each producing only what it sends
                    own = [n for n in wanted if owners.get(n) == me]
                    direct = group.identity or fmt.hf is None  # output n is source n
                    every = {owners.get(n, -1) for n in wanted}
                    dests = {n: ({owners.get(n, -1)} if direct else every)
                             for n in group.sources}
                    got = self._produce_for(group.sources, dests)
                    if direct:
                        converted = {n: got[n] for n in own}
                    else:
                        converted = dict(fmt.convert(group, got)) if own else {}
                    del got
                    for name in wanted:
                        t = converted.pop(name, None)
                        # None only on a rank that sends no part of this tensor: its
                        # stream is walked in step with the others, never packed
                        yield name, (self.to_wire(t, name) if t is not None  # type: ignore[misc]
                                     else None)
                    del converted
        finally:
            self._per_push.clear()  # no reference to the model outlives the push

    def specs(self) -> list[TensorSpec]:
        return self._plan()

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._items()

    def _stream_owners(self) -> dict[str, int] | None:
        """Who sends each tensor of this stream (`owners`), None: this rank, all."""
        return self.owners

    def layout_key(self) -> str | None:
        """Names, dtypes and global shapes of the module-layout tensors (one
        `state_dict()`, which the stream then shares), the wire dtypes and the options.
        The conversion is a function of these and of the model's class."""
        self._per_push.clear()  # this push reads the model anew, once
        return self._key_of_read()

    def _key_of_read(self) -> str:
        """`layout_key` of this push's read of the model (`_sources()`)."""
        from enginehooks.core.layout import layout_key

        sources = [(s.name, dtype_name(s.dtype), list(s.shape)) for s in self._sources()]
        self._planned_now = self._fresh = True  # the plan and the stream share that read
        dtypes = {n: dtype_name(d) if d is not None else None for n, d in self.dtypes.items()}
        return layout_key([type(self).__name__, type(self.model).__name__, sources,
                           dtype_name(self.dtype) if self.dtype is not None else None,
                           dtypes, id(self.include) if self.include is not None else None,
                           id(self.rename)])

    def reuse_plan(self, other: TrainerAdapter, specs: Sequence[TensorSpec]) -> bool:
        # `other` is alive (the layout holds it), so equal ids in the key are the same
        # `include` / `rename` objects, never a new function at a recycled address
        if (type(other) is not type(self) or not isinstance(other, CheckpointAdapter)
                or other.model is not self.model or other._layout is None):
            return False
        self._format, self._layout = other._format, other._layout
        return True


def _global_rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

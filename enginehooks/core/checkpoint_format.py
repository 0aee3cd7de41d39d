"""Module layout -> checkpoint format, by transformers' own save path, one layer at a time.

Engines load checkpoints, and a checkpoint is what `save_pretrained` writes, which is
not always the module's `state_dict()`: transformers 5 keeps MoE experts fused in the
module (`mlp.experts.gate_up_proj`, one 3-D tensor per layer) and writes one tensor per
expert; it renames some keys; and it drops tied duplicates (`lm_head.weight` of a tied
model). `save_pretrained` does this with two functions, and so do we:

1. `transformers.modeling_utils.remove_tied_weights_from_state_dict`: which aliases to
   drop (from the model's own `_tied_weights_keys` and the tensors it really shares);
2. `transformers.core_model_loading.revert_weight_conversion`: the reverse of the
   conversion mapping `from_pretrained` applied (or the default one for the class).

Both run first on META tensors of the module-layout names and shapes, to plan the
update without producing a tensor; then on real tensors, one group at a time. A group
is one layer (keys up to their first numeric segment, `model.layers.3`) or one
top-level key; the plan checks that converting groups separately gives exactly what
converting everything at once gives, and otherwise uses one group (correct, but the
whole model is then produced at once: the plan says so in `LayoutPlan.grouped`).

There is no per-architecture table here: what transformers cannot map raises a clear
`ManifestError` while planning, before any data moves.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from enginehooks.core.errors import ManifestError
from enginehooks.core.view_trace import ViewBatch, ViewOf, trace_views

log = logging.getLogger("enginehooks.checkpoint_format")

#: per model, per group (its sources and the shapes traced): the views proved equal to
#: transformers' conversion, or None where they differed (`CheckpointFormat.convert`)
_PROOFS: weakref.WeakKeyDictionary[Any, dict[Any, tuple[ViewOf, ...] | None]] = (
    weakref.WeakKeyDictionary())

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


@dataclass(frozen=True)
class Source:
    """A tensor in module layout: its name (wrapper prefixes already removed), dtype
    and global shape (a sharded tensor's full shape)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Group:
    """Module-layout tensors converted together, and the checkpoint tensors they make
    (name, dtype, shape, in the order the conversion yields them)."""

    sources: tuple[str, ...]
    outputs: tuple[Source, ...]
    #: the plan saw transformers' conversion hand back the group's own tensors (same
    #: objects, same names): converting it is skipped on every push
    identity: bool = False
    #: per output, the view of one source it is (`core/view_trace.py`), where the plan
    #: traced every output to one; with `traced`, the source shapes those views assume
    views: tuple[ViewOf, ...] | None = None
    traced: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class LayoutPlan:
    groups: tuple[Group, ...]
    #: False when the model's conversion spans layers and one group holds everything.
    grouped: bool = True

    def outputs(self) -> list[Source]:
        return [o for g in self.groups for o in g.outputs]


def pretrained_model(model: Any) -> PreTrainedModel | None:
    """The `transformers.PreTrainedModel` inside `model` (through DDP's `.module`,
    torch.compile's `._orig_mod`, FSDP1's `.module`), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, PreTrainedModel):
            return model
        model = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        seen += 1
    return None


def _group_key(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else name


def _meta(sources: Iterable[Source]) -> dict[str, torch.Tensor]:
    return {s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in sources}


def _described(converted: Mapping[str, torch.Tensor]) -> tuple[Source, ...]:
    return tuple(Source(n, t.dtype, tuple(t.shape)) for n, t in converted.items())


class _SharedBy:
    """The model as `remove_tied_weights_from_state_dict` sees it, with `identity`
    telling which names are one tensor: for trainers whose module no longer holds its
    original parameters (FSDP1 without `use_orig_params`)."""

    def __init__(self, hf: Any, identity: Callable[[str], object]) -> None:
        self._hf, self._identity = hf, identity

    def get_parameter_or_buffer(self, name: str) -> object:
        return self._identity(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._hf, attr)


class CheckpointFormat:
    """transformers' save-path conversion for one model (identity for a model that is
    not a `PreTrainedModel`: its state-dict names are its checkpoint names).

    `identity(name)`: optional; an object that is the same for names that share one
    tensor, where the model cannot tell (see `_SharedBy`).
    """

    def __init__(self, model: Any, identity: Callable[[str], object] | None = None) -> None:
        self.hf = pretrained_model(model)
        self.identity = identity
        #: groups whose traced views matched the conversion's real output once (by the
        #: group's id, with the group, so that a reused id cannot pass), and those
        #: whose did not (converted as they are from then on)
        self._proved: dict[int, Group] = {}
        self._refused: dict[int, Group] = {}
        #: per group with views, how they are made (`view_trace.ViewBatch`)
        self._batches: dict[int, tuple[Group, ViewBatch]] = {}

    def plan(self, sources: Sequence[Source]) -> LayoutPlan:
        """Group `sources` (module layout, in state-dict order) and describe the
        checkpoint tensors each group becomes. Produces no tensor."""
        if self.hf is None:
            return LayoutPlan(tuple(Group((s.name,), (s,)) for s in sources))
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        meta = _meta(sources)
        for key in getattr(self.hf, "_keys_to_ignore_on_save", None) or ():
            meta.pop(key, None)
        # the model, or a stand-in that answers for it where the model cannot (`_SharedBy`)
        owner: Any = self.hf if self.identity is None else _SharedBy(self.hf, self.identity)
        try:
            kept = remove_tied_weights_from_state_dict(meta, owner)
        except Exception as e:
            raise ManifestError(
                f"transformers cannot tell the tied weights of this "
                f"{type(self.hf).__name__} ({type(e).__name__}: {e}); nothing was sent") from e
        order: dict[str, list[str]] = {}
        for name in kept:  # state-dict order, so layers stream in module order
            order.setdefault(_group_key(name), []).append(name)
        groups = tuple(self._group(names, kept) for names in order.values())
        whole = _described(self._revert(dict(kept)))
        if _same(groups, whole):
            return LayoutPlan(groups)
        return LayoutPlan((Group(tuple(kept), whole),), grouped=False)

    def _group(self, names: Sequence[str], kept: Mapping[str, torch.Tensor]) -> Group:
        """One group, planned on meta tensors; `identity` when the conversion returned
        exactly the tensors it was given (nothing renamed, split, fused or viewed);
        else `views` where every tensor it returns is a view of one it was given."""
        given = {n: kept[n] for n in names}
        out = self._revert(dict(given))
        same = set(out) == set(given) and all(out[n] is given[n] for n in out)
        if same:
            return Group(tuple(names), _described(out), identity=True)
        fresh = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in given.items()}
        try:
            found = trace_views(self._revert, fresh)
        except Exception:  # the conversion is run as it is, every push
            found = {}
        views = tuple(v for n in out if (v := found.get(n)) is not None
                      and v.sizes == tuple(out[n].shape) and fresh[v.source].dtype == out[n].dtype)
        if len(views) != len(out) or list(found) != list(out):
            return Group(tuple(names), _described(out))
        return Group(tuple(names), _described(out), views=views,
                     traced=tuple((n, tuple(t.shape)) for n, t in fresh.items()))

    def convert(self, group: Group, tensors: Mapping[str, torch.Tensor]
                ) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors of `group` from its module-layout `tensors`, in the
        planned order. Views where the conversion allows it (no copy is forced here)."""
        if self.hf is None:
            return [(n, tensors[n]) for n in group.sources]
        missing = [n for n in group.sources if n not in tensors]
        if missing:
            raise ManifestError(f"the trainer produced no tensor for {missing[:4]}")
        if group.identity:  # proved by the plan: no conversion call per push
            return [(o.name, tensors[o.name]) for o in group.outputs]
        viewed = self._viewed(group, tensors)
        if viewed is not None and self._proved.get(id(group)) is group:
            return viewed
        # a plan made again for the same model (a new adapter, the full path) traces the
        # same views: proved once per model, not once per plan
        key = (group.sources, group.traced)
        kept = _PROOFS.get(self.hf)
        if viewed is not None and kept is not None and key in kept:
            if kept[key] == group.views:
                self._proved[id(group)] = group
                return viewed
            if kept[key] is None:  # refused before: converted as it is
                self._refused[id(group)] = group
                viewed = None
        out = self._revert({n: tensors[n] for n in group.sources})
        real = [(o.name, out[o.name]) for o in group.outputs]
        if viewed is not None:
            # the first time: the traced views must be what the conversion gave
            same = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                       for (_, a), (_, b) in zip(viewed, real, strict=True))
            _PROOFS.setdefault(self.hf, {})[key] = group.views if same else None
            if same:
                self._proved[id(group)] = group
                return viewed
            self._refused[id(group)] = group
            log.warning("the traced views of %s differ from transformers' conversion; it "
                        "is run on every push", group.sources[:2])
        return real

    def _viewed(self, group: Group, tensors: Mapping[str, torch.Tensor]
                ) -> list[tuple[str, torch.Tensor]] | None:
        """The group's checkpoint tensors as the traced views of `tensors` (no copy, no
        conversion call), where every source is contiguous in the traced shape."""
        if group.views is None or self._refused.get(id(group)) is group:
            return None
        for name, shape in group.traced:
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or not t.is_contiguous():
                return None
        hit = self._batches.get(id(group))
        if hit is None or hit[0] is not group:
            hit = self._batches[id(group)] = (group, ViewBatch(group.views))
        return [(o.name, v) for o, v in zip(group.outputs, hit[1].of(tensors), strict=True)]

    def _revert(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        assert self.hf is not None  # a model that is not a PreTrainedModel converts nothing
        try:
            return dict(revert_weight_conversion(self.hf, state))
        except Exception as e:
            raise ManifestError(
                f"transformers cannot convert this {type(self.hf).__name__} to its "
                f"checkpoint format ({type(e).__name__}: {e}); nothing was sent") from e


def _same(groups: Sequence[Group], whole: Sequence[Source]) -> bool:
    parts = {o.name: o for g in groups for o in g.outputs}
    return len(parts) == sum(len(g.outputs) for g in groups) and parts == {o.name: o for o in whole}

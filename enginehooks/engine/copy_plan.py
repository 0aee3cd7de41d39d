"""A recorded copy plan: where every byte of an update lands, learned from the engine's loader.

Engines apply an update by running their loader tensor by tensor in Python (vLLM's
`reload_weights`, SGLang's `load_weights`), and most of what a loader does with a tensor
is bookkeeping around one copy: it narrows the fused destination (qkv, gate_up, one
expert of a stacked MoE weight), maybe narrows or transposes the source (tensor
parallelism), and `copy_`s. This module learns that copy once, from the loader itself,
and replays it afterwards without the loader:

- `PlanRecorder` runs under the engine's loader (a `ByteTracer`, normally on the meta
  skeleton of the loader dry run) and records, per fed tensor, the aten ops it goes
  through. A tensor whose path is views of itself plus `copy_`s into parameters or
  buffers (usually one; a fused checkpoint tensor split into shards takes one per
  shard; constant `fill_` / `zero_` of parameters while it loads, such as a
  vocabulary's padding, are kept as steps too) gets a `Route` of `Step`s, each a
  destination view given as (storage offset, sizes, strides) and, for a copy, the
  source view likewise. Anything else (scaling, `exp`, a concatenation into a new
  tensor, a dtype conversion before the copy, quantisation, `.item()`, a copy into a
  temporary) keeps the tensor on the loader, with the op named.
- `check_plan` proves a plan on real tensors: the loader's result (a fresh-load shadow
  before post-load processing) must equal, bit for bit, what the plan writes into
  scratch copies of the destinations; a difference disables the plan, naming it.
- `replay` writes planned tensors straight into destination tensors.
- `PlanState` is one engine worker's plan: recorded, verified, on or off, with the
  counts and the reason the engine reports in its `info`.

Nothing here knows a model or an engine: the loader decides, the tracer records, the
verification judges. `ENGINEHOOKS_COPY_PLAN=on|off` (default on).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ConfigError
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.trace import ByteTracer, _storage_key
from enginehooks.engine.verify import DigestCheck, Verifier, WeightsMismatch

log = logging.getLogger("enginehooks.copy_plan")

PLAN_ENV = "ENGINEHOOKS_COPY_PLAN"
#: The reason of a tensor the loader copied into nothing (shard-direct: with nothing
#: written at all, a tensor this rank's loader skips, such as another rank's expert)
NO_DESTINATION = "the loader copies it into no parameter or buffer"

_COPY = torch.ops.aten.copy_.default
_CLONE = torch.ops.aten.clone.default
_FILLS = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}
#: ops that read only a tensor's metadata (shape, dtype, device), never its values
_METADATA_ONLY = {getattr(torch.ops.aten, n).default for n in (
    "empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros",
    "new_ones", "new_full", "new_empty_strided")}


def plan_enabled() -> bool:
    """`ENGINEHOOKS_COPY_PLAN`: "on" (default) or "off"."""
    value = os.environ.get(PLAN_ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"{PLAN_ENV}={value!r}: one of 'on', 'off'")
    return value == "on"


@dataclass(frozen=True)
class View:
    """A strided view relative to a tensor's own start: `t.as_strided(sizes, strides,
    t.storage_offset() + offset)`."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.sizes, self.strides, t.storage_offset() + self.offset)

    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def flat_range(self) -> tuple[int, int] | None:
        """[start, end) in elements when the view is one contiguous run, else None
        (memoised: verification asks it of every step of every update)."""
        return _flat_range(self)


@functools.lru_cache(maxsize=1 << 16)
def _flat_range(v: View) -> tuple[int, int] | None:
    expected = 1
    for size, stride in reversed(list(zip(v.sizes, v.strides))):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return (v.offset, v.offset + v.numel())


@dataclass(frozen=True)
class Layout:
    """A destination tensor as the loader sees it."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> Layout:
        return Layout(tuple(t.shape), tuple(t.stride()), t.dtype)


@dataclass(frozen=True)
class Step:
    """One write the loader made while loading a tensor: a copy of a view of the source
    (`src`) into a view of the destination tensor `dest`, or a constant fill (`value`)."""

    dest: str
    view: View
    src: View | None = None
    value: float | int | bool | None = None
    #: clones the loader made of views of the source before the copy (view, memory
    #: format), replayed in order: `x = view.of(x).clone(memory_format=...)`
    pre: tuple[tuple[View, Any], ...] = ()

    def source(self, t: torch.Tensor) -> torch.Tensor:
        """The view of the received tensor `t` this step copies."""
        for view, fmt in self.pre:
            x = view.of(t)
            t = x.clone(memory_format=fmt) if fmt is not None else x.clone()
        return self.src.of(t)  # type: ignore[union-attr]


@dataclass
class Route:
    """What the plan does with one update tensor: its `steps` when it is planned, or the
    `reason` it stays on the loader."""

    spec: TensorSpec
    steps: list[Step] = field(default_factory=list)
    reason: str | None = None
    #: every model tensor the loader wrote it into (planned or not), from the tracer
    lands: set[str] = field(default_factory=set)

    @property
    def planned(self) -> bool:
        return self.reason is None


@dataclass
class CopyPlan:
    """Routes per update tensor, plus the layout each destination had when recorded."""

    routes: dict[str, Route] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    #: a write the plan cannot reproduce that is not any one tensor's (the loader
    #: touched the model after the last tensor): the whole plan stays off.
    global_reason: str | None = None
    #: `full_copy`'s answers: name -> (the route it was derived from, the step or None);
    #: a receiver asks for every tensor of every update
    _full: dict[str, tuple[Route | None, Step | None]] = field(
        default_factory=dict, repr=False, compare=False)

    def planned(self) -> list[str]:
        return [n for n, r in self.routes.items() if r.planned]

    def loader(self) -> dict[str, str]:
        return {n: r.reason or "" for n, r in self.routes.items() if not r.planned}

    def route_for(self, name: str, t: torch.Tensor) -> Route | None:
        """The planned route of `name` if `t` is what was recorded (dtype, shape,
        contiguous), else None (the loader takes it)."""
        if not t.is_contiguous():
            return None
        return self.route_for_spec(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)))

    def route_for_spec(self, spec: TensorSpec) -> Route | None:
        """The planned route of `spec.name` if its dtype and shape are the recorded ones."""
        r = self.routes.get(spec.name)
        if r is None or not r.planned or self.global_reason:
            return None
        if spec.dtype != r.spec.dtype or tuple(spec.shape) != tuple(r.spec.shape):
            return None
        return r

    def destinations(self, names: Iterable[str]) -> set[str]:
        return {s.dest for n in names for s in self.routes[n].steps}

    def full_copy(self, name: str) -> Step | None:
        """The one step of `name` when it is a plain full copy (the whole source, in
        order, into a contiguous whole destination tensor of the same dtype): a
        receiver can then receive the bytes straight into the destination."""
        r = self.routes.get(name)
        hit = self._full.get(name)
        if hit is not None and hit[0] is r:
            return hit[1]
        step = self._full_copy(r)
        self._full[name] = (r, step)
        return step

    def _full_copy(self, r: Route | None) -> Step | None:
        if r is None or not r.planned:
            return None
        # a write of no element (vLLM's embedding fills its vocabulary padding, which
        # is often empty) changes nothing: it does not stand in the way
        steps = [st for st in r.steps if st.view.numel() > 0]
        if len(steps) != 1:
            return None
        step = steps[0]
        layout = self.layouts.get(step.dest)
        if step.src is None or layout is None or step.pre:
            return None
        n = step.view.numel()
        full = (0, n)
        contiguous_layout = View(0, layout.sizes, layout.strides).flat_range() == full
        if (step.view.flat_range() == full and step.src.flat_range() == full
                and step.view.sizes == layout.sizes and contiguous_layout
                and tuple(step.src.sizes) == tuple(r.spec.shape)
                and dtype_name(layout.dtype) == r.spec.dtype):
            return step
        return None


class PlanRecorder(ByteTracer):
    """A `ByteTracer` that also records, per fed tensor, the writes a plan can replay
    (see the module docstring). Use as the tracer: `with PlanRecorder(model) as rec:
    loader(rec.feed(...))`, then `rec.plan(specs)`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        # storage -> (name, its start offset, the clones that made it from the fed tensor)
        self.fed: dict[int, tuple[str, int, tuple[tuple[View, Any], ...]]] = {}
        self.steps: dict[str, list[Step]] = {}
        self.reasons: dict[str, str] = {}
        self.global_reason: str | None = None
        self.layouts: dict[str, Layout] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            key = _storage_key(t)
            if key is not None and self.owner.get(key) == name:
                self._tensors[name] = t

    def mark(self, name: str, t: torch.Tensor) -> None:
        super().mark(name, t)
        key = _storage_key(t)
        if key is not None:
            self.fed[key] = (name, int(t.storage_offset()), ())
            if not t.is_contiguous():
                self._spoil(name, "the tensor fed to the loader is not contiguous")

    def _spoil(self, name: str, reason: str) -> None:
        self.reasons.setdefault(name, reason)

    def _relative(self, dest: torch.Tensor, owner: str) -> View:
        base = self._tensors.get(owner)
        start = int(base.storage_offset()) if base is not None else 0
        if base is not None:
            self.layouts.setdefault(owner, Layout.of(base))
        return View(int(dest.storage_offset()) - start, tuple(dest.shape), tuple(dest.stride()))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        fed_in = {self.fed[k][0] for t in flat_in
                  if (k := _storage_key(t)) is not None and k in self.fed}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        owner = self.owner.get(_storage_key(first) or -1) if first is not None else None
        recorded = False
        src = args[1] if func is _COPY and len(args) >= 2 and isinstance(args[1], torch.Tensor) \
            else None
        key = _storage_key(src) if src is not None else None
        for t in self._destinations(func, args, kwargs):
            k = _storage_key(t)
            if k is not None and k in self.fed:  # an in-place op on the tensor itself
                self._spoil(self.fed[k][0], f"the loader modifies it in place ({func})")
        # (an owner means a first tensor, a key a source tensor)
        if owner is not None and first is not None and src is not None and key is not None \
                and key in self.fed:
            name, start, pre = self.fed[key]
            # several copies of views of one tensor (a fused checkpoint tensor split into
            # the shards of a fused parameter) replay as they ran
            self.steps.setdefault(name, []).append(Step(
                owner, self._relative(first, owner),
                View(int(src.storage_offset()) - start, tuple(src.shape), tuple(src.stride())),
                pre=pre))
            recorded = True
        elif func is _CLONE and len(fed_in) == 1 and first is not None \
                and _storage_key(first) in self.fed:
            # a copy of a view of the tensor (`.contiguous()`, `.clone()`) before the
            # copy into the parameter: replayed as a clone of the same view
            name, start, pre = self.fed[_storage_key(first)]  # type: ignore[index]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            k = _storage_key(out)
            if k is not None:
                view = View(int(first.storage_offset()) - start, tuple(first.shape),
                            tuple(first.stride()))
                self.fed[k] = (name, out.storage_offset(),
                               (*pre, (view, kwargs.get("memory_format"))))
                self._keep.append(out)
            return out
        elif func in _FILLS and owner is not None and first is not None and not fed_in:
            value = 0 if func is torch.ops.aten.zero_.default else args[1]
            if self.current is not None and isinstance(value, (int, float, bool)):
                self.steps.setdefault(self.current, []).append(
                    Step(owner, self._relative(first, owner), None, value))
                recorded = True
        elif owner is not None and self._writes(func, args, kwargs) and not fed_in:
            # a write into the model that comes from no fed tensor (a value computed
            # from the parameter itself, `param.copy_(-exp(param))`, another
            # parameter): not replayable
            what = f"the loader writes {owner} with {func}"
            if self.current is not None:
                self._spoil(self.current, what)
            else:
                self.global_reason = self.global_reason or what
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if fed_in and not recorded and func not in _METADATA_ONLY:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            views = bool(outs) and all(_storage_key(t) in self.fed for t in outs)
            if not views:
                for name in fed_in:
                    self._spoil(name, f"the loader computes with it ({func})")
        return out

    def _writes(self, func: Any, args: Any, kwargs: Any) -> bool:
        return bool(self._destinations(func, args, kwargs))

    def plan(self, specs: Sequence[TensorSpec]) -> CopyPlan:
        """The plan for the update of `specs` that was fed (call after the loader)."""
        out = CopyPlan(layouts=dict(self.layouts), global_reason=self.global_reason)
        for s in specs:
            steps = self.steps.get(s.name, [])
            reason = self.reasons.get(s.name)
            if reason is None and not any(st.src is not None for st in steps):
                reason = NO_DESTINATION
            w = self.written.get(s.name)
            if reason is None and w is not None:
                # everything the tracer saw it land in must be a destination of the plan
                extra = set(w.into) - {st.dest for st in steps}
                if extra:
                    reason = f"it also lands in {sorted(extra)[:3]} by other means"
            lands = set(w.into) if w is not None else set()
            out.routes[s.name] = Route(s, steps if reason is None else [], reason,
                                       lands | {st.dest for st in steps})
        return out


def record_plan(model: torch.nn.Module, specs: Sequence[TensorSpec],
                load: Any, *, device: str = "meta") -> CopyPlan:
    """Run `load(model, weights)` (the engine's loader) on empty tensors of `specs` on
    `device` under a `PlanRecorder`; return the plan it recorded."""
    from enginehooks.core.dtypes import torch_dtype

    rec = PlanRecorder(model)
    feed = ((s.name, torch.empty(tuple(s.shape), dtype=torch_dtype(s.dtype), device=device))
            for s in specs)
    with torch.no_grad(), rec:
        load(model, rec.feed(feed))
    return rec.plan(specs)


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every name (aliases included), as the tracer names
    destinations (`walk.live_tensors`: torch's walk, read from the modules' dicts)."""
    from enginehooks.engine.walk import live_tensors

    yield from live_tensors(model).items()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _sentinel(t: torch.Tensor) -> None:
    """Fill every byte of `t`'s storage with 0xA5 (a pattern no write of the plan makes
    by accident over a whole destination)."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(t.untyped_storage())
    raw.fill_(0xA5)


def replay(route: Route, src: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write `src` (the received tensor of `route`) into `tensors` (destination name ->
    the tensor in the recorded layout) as the loader did. A view that is the whole
    tensor as it is (offset 0, its own sizes and strides) is the tensor itself: no
    `as_strided` is made for it (~1.2 us each, twice per tensor per push)."""
    for step in route.steps:
        t, v = tensors[step.dest], step.view
        d = t if v.offset == 0 and v.sizes == t.shape and v.strides == t.stride() else v.of(t)
        if step.src is None:
            d.fill_(step.value)  # type: ignore[arg-type]
        else:
            w = step.src
            s = (src if not step.pre and w.offset == 0 and w.sizes == src.shape
                 and w.strides == src.stride() else step.source(src))
            if d.data_ptr() != s.data_ptr() or d.dtype != s.dtype:  # received in place
                d.copy_(s)


def check_plan(plan: CopyPlan, loaded: Mapping[str, torch.Tensor],
               weights: Mapping[str, torch.Tensor]) -> str | None:
    """Whether replaying `plan` reproduces what the loader wrote, bit for bit.

    `loaded`: destination name -> the tensor the loader left (a fresh-load shadow before
    post-load processing); `weights`: the update's tensors. Each destination of a
    planned tensor is rebuilt in a scratch tensor filled with a sentinel from the
    planned writes alone, and compared with the loader's: a difference anywhere (a
    value, an element the plan does not write) is the reason returned; None: it agrees.
    """
    if plan.global_reason:
        return plan.global_reason
    by_dest: dict[str, list[str]] = {}
    for name in plan.planned():
        if name not in weights:
            continue
        for step in plan.routes[name].steps:
            by_dest.setdefault(step.dest, [])
            if name not in by_dest[step.dest]:
                by_dest[step.dest].append(name)
    with torch.no_grad():
        for dest, names in by_dest.items():
            live = loaded.get(dest)
            if live is None:
                return f"{dest}: not in the loaded model"
            layout = plan.layouts.get(dest)
            if layout is not None and Layout.of(live) != layout:
                return f"{dest}: its layout {Layout.of(live)} differs from the recorded {layout}"
            scratch = torch.empty_strided(live.shape, live.stride(), dtype=live.dtype,
                                          device=live.device)
            _sentinel(scratch)
            for name in names:
                route = plan.routes[name]
                one = Route(route.spec, [s for s in route.steps if s.dest == dest])
                replay(one, weights[name].to(live.device), {dest: scratch})
            if not torch.equal(_bits(scratch), _bits(live)):
                return (f"replaying {names[:3]} into {dest} does not give what the loader "
                        "wrote (bits differ)")
    return None


def coverage(plan: CopyPlan, names: Iterable[str]) -> dict[str, bool]:
    """Destination -> whether the planned writes of `names` cover every element of it
    exactly once (contiguous, disjoint runs): only then may a replay start from an
    uninitialised destination."""
    runs: dict[str, list[tuple[int, int]]] = {}
    odd: set[str] = set()
    for name in names:
        for step in plan.routes[name].steps:
            r = step.view.flat_range()
            if r is None:
                odd.add(step.dest)
            else:
                runs.setdefault(step.dest, []).append(r)
    out: dict[str, bool] = {}
    for dest in set(runs) | odd:
        layout = plan.layouts.get(dest)
        if dest in odd or layout is None:
            out[dest] = False
            continue
        total = View(0, layout.sizes, layout.strides).numel()
        at, ok = 0, True
        for start, end in sorted(runs[dest]):
            if start != at:
                ok = False
                break
            at = end
        out[dest] = ok and at == total
    return out


class PlanState:
    """One engine worker's copy plan through its life: "pending" (not yet recorded),
    "verifying" (recorded and checked against the loader on a shadow; the next planned
    update is verified against a fresh load too), "on", or "off" with a reason."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        try:
            enabled = plan_enabled()
        except ConfigError as e:
            log.error("%s; the copy plan stays off", e)
            enabled = False
        self.plan: CopyPlan | None = None
        self.state = "pending" if enabled else "off"
        self.reason: str | None = None if enabled else f"{PLAN_ENV}=off"
        self.last: dict[str, Any] = {}  # counts and seconds of the last update
        self.applied = 0                # updates applied through the plan

    @property
    def usable(self) -> bool:
        return self.plan is not None and self.state in ("verifying", "on")

    def adopt(self, plan: CopyPlan, problem: str | None) -> None:
        """A recorded plan and the verdict of `check_plan` on the first update."""
        self.plan = plan
        reason = problem or plan.global_reason
        if reason:
            self.disable(reason)
        elif not plan.planned():
            self.disable("the loader copies no tensor of the update as a plain copy")
        else:
            self.state = "verifying"
            log.info("%s: copy plan recorded and checked against the loader: %d tensors "
                     "planned, %d on the loader", self.engine, len(plan.planned()),
                     len(plan.loader()))

    def disable(self, reason: str) -> None:
        if self.state != "off":
            log.warning("%s: the copy plan is off for this model: %s", self.engine, reason)
        self.state, self.reason = "off", reason

    def verified(self) -> None:
        """The first planned update equalled a fresh load."""
        if self.state == "verifying":
            self.state = "on"

    def judge(self, mismatched: Sequence[str], planned: Collection[str]) -> None:
        """The verdict of the first update through the plan: `mismatched` (module.key
        names that differed from a fresh load, already repaired) against `planned` (the
        tensors the plan wrote). A difference in a module the plan wrote turns it off; a
        difference only where the loader wrote is the engine's reload path, which
        verification repairs and keeps watching, and says nothing against the plan."""
        mine = {n.rpartition(".")[0] for n in planned}
        blamed = [m for m in mismatched if m.rpartition(".")[0] in mine]
        if blamed:
            self.disable("the first update through the plan differed from a fresh load "
                         f"(repaired from it) in tensors the plan wrote: {blamed[:5]}")
        else:
            if mismatched:
                log.info("%s: the first update through the plan equalled a fresh load where "
                         "the plan wrote; %d tensors the loader wrote were repaired",
                         self.engine, len(mismatched))
            self.verified()

    def check_on_shadow(self, plan: CopyPlan, verifier: Verifier, model: torch.nn.Module,
                        load_shadow: Callable[[Callable[[torch.nn.Module], None]],
                                              torch.nn.Module],
                        weights: Mapping[str, torch.Tensor], landed: Collection[str],
                        verify: bool,
                        stream_shadow: Callable[..., Iterator[Any]] | None = None) -> None:
        """Adopt `plan` (just recorded) after checking it on the engine's fresh-load shadow
        before its post-load processing: what the loader wrote there must be what the plan
        writes. `load_shadow(hook)` is the engine's fresh load of the update, calling
        `hook(shadow)` before processing; with `verify`, the same shadow also verifies
        the live `model` (one fresh load for both). `stream_shadow(needed, hook)`, where
        the engine gives one, is the shadow streamed unit by unit (`engine.shadow`),
        calling `hook(shadow, unit_weights)` before each unit's processing: the plan is
        checked unit by unit there, on that unit's tensors, and adopted once every unit
        agreed."""
        def hook(shadow: torch.nn.Module) -> None:
            try:
                problem = check_plan(plan, dict(named_tensors(shadow)), weights)
            except Exception as e:
                problem = f"the check failed: {type(e).__name__}: {e}"
            self.adopt(plan, problem)

        problems: list[str | None] = []

        def unit_hook(shadow: torch.nn.Module, unit: list[tuple[str, torch.Tensor]]) -> None:
            try:
                problems.append(check_plan(plan, dict(named_tensors(shadow)), dict(unit)))
            except Exception as e:
                problems.append(f"the check failed: {type(e).__name__}: {e}")

        def build() -> torch.nn.Module:
            return load_shadow(hook)

        streamer = ((lambda needed: stream_shadow(needed, unit_hook))
                    if stream_shadow is not None else None)
        if verify:
            verifier.run(model, build, landed, stream_fresh=streamer)
            if (verifier.last or {}).get("shadow_kind") == "streamed":
                self.adopt(plan, next((p for p in problems if p), None))
        else:
            streamed = False
            if streamer is not None:
                try:
                    with torch.no_grad():
                        for _ in streamer({n for n, _ in model.named_modules()}):
                            pass
                    self.adopt(plan, next((p for p in problems if p), None))
                    streamed = True
                except Exception:  # the whole shadow below checks it
                    pass
            if not streamed:
                try:
                    build()
                except Exception as e:
                    self.disable(f"no shadow to check it on: {type(e).__name__}: {e}")
        if self.state == "pending":
            self.disable("no shadow could be built to check it on "
                         f"({(verifier.last or {}).get('error')})")

    def verify_update(self, verifier: Verifier, model: torch.nn.Module,
                      build_fresh: Callable[[], torch.nn.Module], landed: Collection[str],
                      checking: bool, planned: Collection[str],
                      digests: DigestCheck | None = None,
                      stream_fresh: Callable[[Collection[str]], Iterator[Any]] | None = None
                      ) -> None:
        """Verify after apply (`verify.Verifier.run`, with `digests` of the planned plain
        copies); when `checking` (the first update through the plan), any difference
        from a fresh load, or no verdict at all, is judged against the plan. Raises
        `WeightsMismatch` as the verifier does. `stream_fresh`: the shadow streamed
        unit by unit (`engine.shadow`), where the engine gives one."""
        try:
            verdict = verifier.run(model, build_fresh, landed, digests, stream_fresh)
        except WeightsMismatch as e:
            if checking:
                self.disable(f"the first update through the plan differed from a fresh "
                             f"load: {e}")
            raise
        if not checking:
            return
        if verdict is None:
            self.disable("the first update through the plan could not be verified "
                         f"({(verifier.last or {}).get('error')})")
        else:
            self.judge(verdict.mismatched, planned)

    def split(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[
            tuple[str, torch.Tensor, Route | None]]:
        """Each tensor with its planned route, or None when the loader takes it."""
        plan = self.plan if self.usable else None
        for name, t in tensors:
            yield name, t, plan.route_for(name, t) if plan is not None else None

    def info(self) -> dict[str, Any]:
        plan = self.plan
        out: dict[str, Any] = {"state": self.state, "reason": self.reason,
                               "applied": self.applied, **self.last}
        if plan is not None:
            out.setdefault("planned", len(plan.planned()))
            out.setdefault("loader", len(plan.loader()))
            out["loader_examples"] = dict(list(plan.loader().items())[:5])
        return out

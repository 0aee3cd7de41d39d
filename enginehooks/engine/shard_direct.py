"""One engine rank's side of a shard-direct update (issue 40): which bytes of each
checkpoint tensor it needs, learned from its copy plan, and where the bytes the static
schedule sends it land.

- `needs_of`: the byte runs of each update tensor this rank's loader reads. A planned
  tensor (`engine/copy_plan.py`) needs the runs of its steps' source views (a
  tensor-parallel rank's rows or columns, a fused q/k/v or gate/up part, an expert's
  range: whatever the loader narrowed, never a table per architecture); a tensor the
  plan leaves on the loader, or whose steps clone it first, is needed whole; one the
  loader neither wrote anywhere nor computed with (another rank's expert, skipped by an
  expert-parallel loader) is not needed at all.
- `ShardLanding`: the destination of every transfer, and what happens after. Where the
  plan is a pure copy (contiguous source run into a contiguous destination run of the
  same dtype, no fills), the bytes are received straight into the parameter. Otherwise
  they are assembled in a staging tensor of the checkpoint tensor's shape (only the
  runs this rank needs are filled) and, in `finish`, the plan is replayed from it, or
  the engine's loader is called with it. Before a byte moves it refuses a schedule that
  leaves a needed byte unsent (the rank would load garbage from an unfilled staging
  tensor) and a destination whose layout is not the recorded one.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from enginehooks.core.dtypes import torch_dtype
from enginehooks.core.errors import ConfigError, ManifestError
from enginehooks.core.manifest import TensorSpec
from enginehooks.core.schedule import Slice, Transfer, view_slices
from enginehooks.engine.copy_plan import NO_DESTINATION, CopyPlan, Layout, Route, replay

Loader = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


def _union(slices: Iterable[Slice]) -> list[Slice]:
    out: list[Slice] = []
    for s in sorted(slices):
        if out and s.start <= out[-1].stop:
            if s.stop > out[-1].stop:
                out[-1] = Slice(s.name, out[-1].start, s.stop)
        else:
            out.append(s)
    return out


def _route(plan: CopyPlan | None, spec: TensorSpec) -> Route | None:
    return plan.route_for_spec(spec) if plan is not None else None


def _ignored(plan: CopyPlan | None, spec: TensorSpec) -> bool:
    """Whether this rank's loader, when the plan was recorded, wrote `spec` (same dtype
    and shape) into nothing at all and read it for nothing: another rank's expert,
    which an expert-parallel loader skips."""
    r = plan.routes.get(spec.name) if plan is not None and not plan.global_reason else None
    return (r is not None and not r.lands and not r.steps
            and r.reason == NO_DESTINATION and r.spec.dtype == spec.dtype
            and tuple(r.spec.shape) == tuple(spec.shape))


def needs_of(plan: CopyPlan | None, specs: Sequence[TensorSpec]) -> list[Slice]:
    """The byte runs of `specs` (in their wire dtypes) this engine rank needs (module
    docstring), merged and sorted per tensor."""
    out: list[Slice] = []
    for spec in specs:
        if _ignored(plan, spec):
            continue
        route = _route(plan, spec)
        if route is None or any(st.pre for st in route.steps):
            out.append(Slice(spec.name, 0, spec.nbytes))
            continue
        item = torch_dtype(spec.dtype).itemsize
        runs = [r for st in route.steps if st.src is not None
                for r in view_slices(spec.name, st.src.offset, st.src.sizes, st.src.strides,
                                     item)]
        out += _union(runs)
    return out


def unsent(plan: CopyPlan | None, specs: Sequence[TensorSpec],
           transfers: Iterable[Transfer], me: int) -> list[Slice]:
    """The runs engine rank `me`'s loader reads (`needs_of`) that `transfers` do not
    give it in full: a rank following such a schedule would load bytes nobody sent."""
    mine: dict[str, list[Slice]] = {}
    for t in transfers:
        if t.dst == me:
            mine.setdefault(t.name, []).append(Slice(t.name, t.start, t.stop))
    got = {n: _union(v) for n, v in mine.items()}  # sorted, merged: disjoint
    starts = {n: [g.start for g in v] for n, v in got.items()}

    def covered(need: Slice) -> bool:
        # the one merged run that can hold need.start: the last starting at or before it
        k = bisect.bisect_right(starts.get(need.name, []), need.start) - 1
        return k >= 0 and need.stop <= got[need.name][k].stop

    # a binary search per need: a row-parallel tensor at 7B widths is thousands of runs
    # per rank, and a scan of them per need was quadratic (seconds per push)
    return [need for need in needs_of(plan, specs) if not covered(need)]


def _direct_map(route: Route, spec: TensorSpec, tensors: Mapping[str, torch.Tensor]
                ) -> list[tuple[int, int, torch.Tensor]] | None:
    """(source byte start, source byte stop, the destination's bytes) per step when the
    route is a pure copy into contiguous destination runs of the tensor's dtype."""
    item = torch_dtype(spec.dtype).itemsize
    out = []
    for st in route.steps:
        if st.src is None:
            if st.view.numel() == 0:
                continue  # a fill of nothing (an empty vocabulary padding)
            return None
        src, dst = st.src.flat_range(), st.view.flat_range()
        d = tensors.get(st.dest)
        if st.pre or src is None or dst is None or d is None or not d.is_contiguous() \
                or d.dtype != torch_dtype(spec.dtype):
            return None
        raw = d.detach().reshape(-1).view(torch.uint8)
        out.append((src[0] * item, src[1] * item, raw[dst[0] * item: dst[1] * item]))
    runs = sorted((a, b) for a, b, _ in out)
    if any(b > c for (_, b), (c, _) in itertools.pairwise(runs)):
        return None  # one source byte into two places (a tensor copied twice): replayed
    return out


class ShardLanding:
    """Where one engine rank's transfers land (module docstring). `tensors`: every
    destination of the plan by the name it recorded (`copy_plan.named_tensors`), in the
    recorded layout; `loader(items)`: the engine's loader for what the plan does not
    cover."""

    def __init__(self, plan: CopyPlan | None, specs: Sequence[TensorSpec],
                 transfers: Sequence[Transfer], me: int,
                 tensors: Mapping[str, torch.Tensor], loader: Loader,
                 device: torch.device | None = None) -> None:
        self.plan, self.tensors, self.loader = plan, tensors, loader
        # staging on the destinations' device: over NCCL a receive buffer must be on the
        # GPU (a host staging tensor was refused there before anything was posted, and the
        # trainer ranks' sends then waited out their timeout)
        if device is None:
            device = next((t.device for t in tensors.values()), torch.device("cpu"))
        self.device = device
        self.specs = {s.name: s for s in specs}
        mine: dict[str, list[Transfer]] = {}
        for t in transfers:
            if t.dst == me:
                mine.setdefault(t.name, []).append(t)
        for need in unsent(plan, specs, transfers, me)[:1]:
            raise ManifestError(
                f"the schedule leaves bytes [{need.start}, {need.stop}) of {need.name!r},"
                f" which engine rank {me}'s loader reads, unsent")
        self._direct: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        self._staged: dict[str, torch.Tensor] = {}
        #: bytes of this rank's transfers that land straight in the parameters
        self.received_direct = 0
        for name, ts in mine.items():
            spec = self.specs[name]
            route = _route(plan, spec)
            if route is not None and plan is not None:
                for st in route.steps:
                    layout, live = plan.layouts.get(st.dest), tensors.get(st.dest)
                    if live is None or (layout is not None and Layout.of(live) != layout):
                        raise ConfigError(f"{st.dest}: not in the recorded layout {layout}")
            runs = _direct_map(route, spec, tensors) if route is not None else None
            if runs is not None and all(any(a <= t.start and t.stop <= b for a, b, _ in runs)
                                        for t in ts):
                self._direct[name] = runs
                self.received_direct += sum(t.nbytes for t in ts)
            else:
                self._staged[name] = torch.empty(spec.nbytes, dtype=torch.uint8,
                                                device=self.device)

    def dest(self, t: Transfer) -> torch.Tensor:
        """The 1-D uint8 tensor transfer `t`'s bytes are received into."""
        runs = self._direct.get(t.name)
        if runs is not None:
            for a, b, raw in runs:
                if a <= t.start and t.stop <= b:
                    return raw[t.start - a: t.stop - a]
        return self._staged[t.name][t.start: t.stop]

    def segments(self, name: str) -> list[tuple[int, int, torch.Tensor]]:
        """Where tensor `name`'s bytes land, as (start, stop, 1-D uint8) segments: the
        parameter runs of a pure copy, or the whole staging tensor
        (`transports/shard_runs.Places`, what `dest` answers per transfer)."""
        runs = self._direct.get(name)
        if runs is not None:
            return list(runs)
        staged = self._staged.get(name)
        return [] if staged is None else [(0, staged.numel(), staged)]

    def finish(self) -> dict[str, str]:
        """Replay the plan from the staged tensors, feed the rest to the loader; returns
        how each tensor landed ("direct", "replayed", "loader")."""
        how = {n: "direct" for n in self._direct}
        fed: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name, raw in self._staged.items():
                spec = self.specs[name]
                t = raw.view(torch_dtype(spec.dtype)).view(tuple(spec.shape))
                route = _route(self.plan, spec)
                if route is not None:
                    replay(route, t, self.tensors)
                    how[name] = "replayed"
                else:
                    fed.append((name, t))
                    how[name] = "loader"
        if fed:
            self.loader(fed)
        self._staged.clear()
        return how

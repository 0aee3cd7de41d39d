"""How an update is applied inside an engine worker, written once for every engine.

Applying an update is the same routine whatever the engine: route the tensors a
recorded copy plan can write (`engine.copy_plan`), stream the rest through the
engine's own loader, keep what the fed tensors were (and host copies of them when a
shadow will be built), record the plan on the first update, verify against the
engine's fresh-load path (`engine.verify`), and count what went which way. vLLM and
SGLang each carried a copy of it; a copy drifts, and a third engine would have made a
third. `ApplyTarget` owns the routine; an engine subclasses it and supplies a handful
of small methods that only it can write:

- required: `model` (the live model), `load` (its loader on the live model),
  `fresh_load` (a model of its own built from given tensors, the oracle's path),
  `skeleton` (its model class on the meta device, for the loader dry run) and
  `checkpoint_dir` (the folder it started from);
- optional: `begin` / `end` (a weight-update session around the load), `dry_load`
  (its loader on another model, default `model.load_weights`), `plan_routes`,
  `writable`, `write_planned` and `destination` (how planned tensors land, default:
  replayed into the live tensors when their layout is the recorded one),
  `loader_copy` (what the loader is handed), `after_load` (repairs the engine's load
  path needs) and `session_stats`.

`ApplyBinding` is the matching `EngineBinding`: its expectations are the target's loader
dry run, and its `info` reports the verification and copy plan. docs/engines.md walks
through adding an engine with both.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.landing import WireLanding
from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.engine.beacon import Beacon
from enginehooks.engine.contract import EngineBinding
from enginehooks.engine.copy_plan import CopyPlan, Layout, PlanState, Route, replay
from enginehooks.engine.expectations import (
    Expectations,
    LoaderExpectations,
    checkpoint_specs,
    resolve_model_dir,
)
from enginehooks.engine.shadow import Pass, ShadowParts, mark_loaded, stream
from enginehooks.engine.transplant import transplant
from enginehooks.engine.verify import DigestCheck, Verifier, readable_tensors
from enginehooks.engine.walk import live_tensors, tensor_keys
from enginehooks.transports.base import Target

__all__ = ["ApplyBinding", "ApplyTarget", "Update"]


class Update:
    """One update's bookkeeping while it streams: which tensors were fed (their specs:
    what the loader dry run says they land in), host copies of them when a shadow will
    be built from them (the transport reuses its buffers, and the shadow must never cost
    the engine's device memory), and how many went through the plan.

    `routes` are the planned tensors writable in this update (`ApplyTarget.writable`)."""

    def __init__(self, routes: Mapping[str, Route], keeping: bool,
                 digests: DigestCheck | None = None,
                 specs: dict[str, tuple[torch.dtype, torch.Size, TensorSpec]] | None = None
                 ) -> None:
        self.routes = routes
        #: name -> (dtype, shape, its spec), kept by the target across updates (`feed`)
        self.specs = specs if specs is not None else {}
        self.keeping = keeping
        #: digests of what planned plain copies received (verification by digest), and
        #: the dtype of each planned destination
        self.digests = digests
        self.dtypes: dict[str, torch.dtype] = {}
        self.fed: list[TensorSpec] = []
        self.kept: list[tuple[str, torch.Tensor]] = []
        self.planned = 0
        #: seconds this update spent, while it streamed, on verification's behalf: host
        #: copies kept for the shadow, digests of what planned copies received
        self.seconds = {"keep": 0.0, "digest_received": 0.0}
        #: live destinations empty when the update began (`ApplyTarget.apply`)
        self.emptied: set[str] = set()

    def feed(self, name: str, t: torch.Tensor) -> None:
        # the spec of the last update's tensor of this name where its dtype and shape are
        # the same (a training loop): one `TensorSpec` per name, not per push
        hit = self.specs.get(name)
        if hit is None or hit[0] is not t.dtype or hit[1] != t.shape:
            hit = self.specs[name] = (t.dtype, t.shape,
                                      TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)))
        self.fed.append(hit[2])

    def keep(self, name: str, t: torch.Tensor, copy: torch.Tensor | None = None) -> None:
        """Keep a host copy of `t` if a shadow will be built; `copy` is one the engine
        made already (reused when it is on the host, instead of copying twice)."""
        if self.keeping:
            t0 = time.perf_counter()
            self.kept.append((name, copy if copy is not None and copy is not t
                              and copy.device.type == "cpu" else t.to("cpu", copy=True)))
            self.seconds["keep"] += time.perf_counter() - t0


class _Writable:
    """`ApplyTarget.writable`'s answer for one update, kept for the next: that answer
    depends only on the routes offered (the same names, the same `Route` objects), the
    plan, and each destination's live tensor and its layout. While every destination is
    the same tensor object at the same address, shape, strides and dtype, the answer is
    the same, and the next update needs no `Layout` per destination (a MoE has
    thousands: ~2.6 us each, every push)."""

    __slots__ = ("dests", "keys", "names", "plan", "routes", "steps", "tensors")

    def __init__(self, names: tuple[str, ...], steps: tuple[Route, ...], plan: Any,
                 routes: dict[str, Route], dests: list[str],
                 tensors: list[torch.Tensor]) -> None:
        self.names, self.steps, self.plan, self.routes = names, steps, plan, routes
        self.dests, self.tensors = dests, tensors
        self.keys = tensor_keys(tensors)

    @staticmethod
    def of(offered: dict[str, Route], out: dict[str, Route], live: Mapping[str, torch.Tensor],
           plan: Any) -> _Writable | None:
        dests = list(dict.fromkeys(st.dest for r in offered.values() for st in r.steps))
        if plan is None or any(d not in live for d in dests):
            return None  # (an answer that depends on a missing tensor is not kept)
        return _Writable(tuple(offered), tuple(offered.values()), plan, out, dests,
                         [live[d] for d in dests])

    def holds(self, offered: dict[str, Route], live: Mapping[str, torch.Tensor],
              plan: Any) -> bool:
        import operator

        if plan is not self.plan or tuple(offered) != self.names:
            return False
        if not all(map(operator.is_, offered.values(), self.steps)):
            return False
        now = [live.get(d) for d in self.dests]
        if not all(map(operator.is_, now, self.tensors)):
            return False
        return tensor_keys(self.tensors) == self.keys


class ApplyTarget(Target, ABC):
    """Applies an update with the engine's own loader, or, once a copy plan is recorded
    and verified, writes the planned tensors straight into the engine's tensors and
    hands only the rest to the loader. See the module docstring for what a subclass
    supplies; everything else (routes, bookkeeping, recording, verification, statistics,
    the fresh-load fallback) lives here, once."""

    #: the engine's name in messages and logs ("vLLM", "SGLang")
    engine: ClassVar[str] = "engine"
    #: whether the engine's loader may remove parameters from the live model after its
    #: first load (SGLang's MiniCPM3): an update that needs one is then applied by a
    #: fresh load copied into the live model (`engine.transplant`)
    loader_may_remove: ClassVar[bool] = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.verifier = Verifier(self.engine)
        self.plan = PlanState(self.engine)
        self.requested = False  # the trainer asked this update to be verified
        self.routes: dict[str, Route] = {}  # this update's planned tensors
        self.live: dict[str, torch.Tensor] | None = None  # during `apply`: name -> tensor
        self.by_fresh_load: list[str] = []  # this update: parameters only a fresh load fills
        self._digests: DigestCheck | None = None  # during `apply`: the update's digests
        #: the spec of each tensor fed, by name (`Update.feed`)
        self._fed_specs: dict[str, tuple[torch.dtype, torch.Size, TensorSpec]] = {}
        self._expectations: LoaderExpectations | None = None
        #: `destination`'s answers of the last update, per destination: (the live tensor,
        #: its `tensor_keys` then, the plan it was checked against, the alias handed
        #: out); reused while all hold
        self._dests: dict[str, tuple[torch.Tensor, tuple[list[object], ...], Any,
                                     torch.Tensor]] = {}
        #: `writable`'s answer of the last update, while it holds (`_Writable`)
        self._writable: _Writable | None = None

    # -- what an engine supplies ---------------------------------------------------------
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The live model the engine serves from."""

    @abstractmethod
    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load `weights` into the live model with the engine's own loader (inside the
        session `begin` opened). The tensors may be views into the transport's reused
        buffers: a loader that keeps them past the next one must copy (`loader_copy`)."""

    @abstractmethod
    def fresh_load(self, weights: list[tuple[str, torch.Tensor]],
                   before_processing: Callable[[torch.nn.Module], None] | None = None
                   ) -> torch.nn.Module:
        """A model of its own built by the engine's fresh-load path from `weights` (what
        a fresh start from a checkpoint of them holds). `before_processing(model)`, when
        given, is called after the loader and before any post-load processing: the copy
        plan is checked there against what the loader alone wrote."""

    def shadow_parts(self) -> ShadowParts | None:
        """The engine's fresh-load path in its three steps (construct, load, process:
        `engine.shadow.ShadowParts`), so the verification shadow is streamed unit by
        unit, its memory bounded by one layer; None (the default): the shadow is built
        whole by `fresh_load`."""
        return None

    def lands(self, weights: Sequence[tuple[str, torch.Tensor]]
              ) -> dict[str, Collection[str] | None]:
        """Where each of `weights` lands in the live model (its parameter names), by the
        loader dry run (`expectations`); None where unknown (the loader failed on it)."""
        specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in weights]
        out: dict[str, Collection[str] | None] = {}
        for name, landing in self.expectations().landings(specs).items():
            out[name] = None if landing.error else set(landing.params)
        return out

    def _streamer(self, kept: list[tuple[str, torch.Tensor]]
                  ) -> Callable[..., Iterator[Pass]] | None:
        """`streamer(needed, before_processing=None)`: the shadow of `kept` streamed
        unit by unit (`engine.shadow.stream`), or None where the engine gives none."""
        parts = self.shadow_parts()
        if parts is None:
            return None
        model = self.model()

        def streamer(needed: Collection[str], before_processing: Any = None) -> Iterator[Pass]:
            return stream(parts, kept, model, needed, readable_tensors, before_processing)

        return streamer

    @abstractmethod
    def skeleton(self) -> torch.nn.Module:
        """The engine's model class built on the meta device, exactly as the engine
        builds it (`expectations.skeleton_on_meta`): the loader dry run's model."""

    @abstractmethod
    def checkpoint_dir(self) -> str | os.PathLike[str]:
        """The checkpoint (folder or hub name) the engine started from: what a complete
        update covers."""

    def dry_load(self, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> Any:
        """The engine's loader on `model` (the meta skeleton), as its update path runs it.
        Default: `model.load_weights(weights)`, the vLLM / SGLang model convention."""
        return model.load_weights(weights)  # type: ignore[operator]

    def begin(self) -> None:
        """Open the engine's weight-update session (SGLang's `begin_weight_update`)."""

    def end(self) -> None:
        """Close it; called even when the load failed, so the model is put back in its
        serving layout."""

    def plan_routes(self, plan: CopyPlan, specs: list[TensorSpec]) -> dict[str, Route]:
        """The tensors of an update the plan may write. Default: every planned tensor
        whose spec is the recorded one."""
        routes: dict[str, Route] = {}
        for spec in specs:
            r = plan.route_for_spec(spec)
            if r is not None:
                routes[spec.name] = r
        return routes

    def writable(self, routes: dict[str, Route]) -> dict[str, Route]:
        """Inside the session: the routes that can be written now. Default: those whose
        every destination is a live tensor in the layout the plan was recorded for
        (inside a session the tensors are in the loader's layout; one that is not
        goes to the loader)."""
        live = live_tensors(self.model())
        plan = self.plan.plan
        layouts = plan.layouts if plan is not None else {}
        self.live = live
        kept = self._writable
        if kept is not None and kept.holds(routes, live, plan):
            return kept.routes  # the same routes into the same tensors, held in place
        out = {n: r for n, r in routes.items()
               if all(st.dest in live and Layout.of(live[st.dest]) == layouts.get(st.dest)
                      for st in r.steps)}
        self._writable = _Writable.of(routes, out, live, plan)
        return out

    def write_planned(self, name: str, t: torch.Tensor, route: Route) -> None:
        """Write planned `name` through its route. Default: replayed into the live tensors."""
        replay(route, t, self.live or {})

    def destination(self, name: str) -> torch.Tensor | None:
        """The live tensor a planned plain full copy lands in, while `apply` holds the
        session: the transport receives straight into it (the replay's copy is then
        skipped). None otherwise."""
        plan, live = self.plan.plan, self.live
        if live is None or plan is None or name not in self.routes:
            return None
        step = plan.full_copy(name)
        if step is None:
            return None
        t = live.get(step.dest)
        if t is None:
            return None
        hit = self._dests.get(step.dest)
        if hit is not None and hit[0] is t and hit[2] is plan and tensor_keys((t,)) == hit[1]:
            return hit[3]  # the same tensor where it was, checked against this plan then
        if Layout.of(t) != plan.layouts.get(step.dest) or not t.is_contiguous():
            return None
        if hit is not None and hit[2] is not plan:
            self._dests.clear()  # a new plan: nothing of the old one's is kept
        alias = t.data
        self._dests[step.dest] = (t, tensor_keys((t,)), plan, alias)
        return alias

    def landing_wanted(self) -> bool:
        return self._digests is not None

    def arrived_piece(self, name: str, start: int, nbytes: int, checksum: str,
                      digest: int) -> None:
        """The receive loop checked these bytes of `name` against the sender's digest
        as they arrived: verification takes that digest instead of reading them again
        (`DigestCheck.arrived`)."""
        if self._digests is not None:
            self._digests.arrived(name, start, nbytes, checksum, digest)

    def wire_landed(self, landing: WireLanding) -> None:
        """A receiver landed these tensors in `destination`s itself and digested them as
        it did: verification proves them by one re-read after apply (`DigestCheck.wire`)
        instead of a digest per tensor as they stream."""
        if self._digests is not None:
            self._digests.wire(landing)

    def loader_copy(self, t: torch.Tensor) -> torch.Tensor:
        """What the loader is handed for `t`. Default: `t` itself (a loader that copies
        each tensor into its parameter as it goes)."""
        return t

    def after_load(self, model: torch.nn.Module, landed: set[str]) -> None:
        """Repairs the engine's load path needs after an update that loaded parameters
        `landed` (vLLM's tied heads and CPU experts). Default: none."""

    def session_stats(self) -> tuple[float, dict[str, Any]]:
        """CPU seconds spent on other threads for this update, and extra counts for the
        copy plan's `info`. Default: none."""
        return 0.0, {}

    # -- the loader dry run --------------------------------------------------------------
    def expectations(self) -> LoaderExpectations:
        """What the engine's loader accepts and where each tensor lands: its `dry_load`
        on the `skeleton`, against the checkpoint it started from (built once)."""
        if self._expectations is None:
            self._expectations = LoaderExpectations(
                self.skeleton, self.dry_load,
                checkpoint_specs(resolve_model_dir(str(self.checkpoint_dir()))),
                engine=self.engine, live=self.model if self.loader_may_remove else None)
        return self._expectations

    def landed(self, fed: list[TensorSpec]) -> set[str]:
        """Parameter names the update's tensors land in (from the loader dry run)."""
        return {p for landing in self.expectations().landings(fed).values()
                for p in landing.params}

    # -- the routine ---------------------------------------------------------------------
    def prepare(self, manifest: Manifest) -> None:
        self.requested = bool(manifest.meta.get("verify"))
        self.routes, self.live = {}, None
        specs = manifest.specs()
        self.by_fresh_load = self.expectations().fresh_load_needed(specs)
        if self.by_fresh_load:
            self.plan.disable(f"the loader removed {self.by_fresh_load[:3]} from the live "
                              "model after its first load; updates go through a fresh load")
            return
        plan = self.plan.plan
        if self.plan.usable and plan is not None:
            try:
                self.routes = self.plan_routes(plan, specs)
            except Exception as e:  # an enginehooks limitation: the loader takes it all
                self.plan.disable(f"routing failed: {type(e).__name__}: {e}")

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.by_fresh_load:
            self._apply_by_fresh_load(tensors)
            return
        clock = time.perf_counter
        t0, c0 = clock(), time.thread_time()
        model = self.model()
        routes, self.routes = self.routes, {}
        checking = self.plan.state == "verifying" and bool(routes)
        verify = self.verifier.wanted(self.requested) or checking
        recording = self.plan.state == "pending"
        # planned plain copies are proved by digests, except on the first update through
        # the plan (judged against a fresh load in full)
        digests = DigestCheck() if verify and routes and not checking else None
        update = Update({}, keeping=verify or recording, digests=digests, specs=self._fed_specs)
        if digests is not None and self.verifier.settled is None:
            # destinations the engine's processing empties (vLLM CPU keeps a linear's
            # weight only in its prepacked handle): after apply they hold nothing a
            # digest could check, so none is computed for them (the shadow compares them).
            # Not walked where the last verdict settled (`verify.Settled`): every
            # destination then held what landed in it; one emptied since changes the
            # structure, and that update takes the full path (torn if no copy was kept)
            update.emptied = {n for n, t in live_tensors(model).items() if t.numel() == 0}
        if self.plan.plan is not None:
            update.dtypes = {n: lay.dtype for n, lay in self.plan.plan.layouts.items()}

        self.begin()
        self._digests = digests
        try:
            if routes:
                update.routes = self.routes = self.writable(routes)
            t1 = clock()
            self.load(self._stream(tensors, update))
            t2 = clock()
            other_cpu, extra = self.session_stats()
        finally:
            self.live, self.routes, self._digests = None, {}, None
            self.end()
        if update.routes:
            self.plan.applied += 1
        t3 = clock()
        landed = self.landed(update.fed)
        t4 = clock()
        self.after_load(model, landed)
        t5 = clock()
        # wall and this thread's CPU seconds (the latter is what the apply costs when
        # other processes share the cores); where the wall went (ms): before the load
        # (the emptied walk, `begin`, `writable`), the load (the transport's stream
        # included), the landed names, the post-load step, the verification
        self.plan.last = {"seconds": round(t5 - t0, 4),
                          "cpu_seconds": round(time.thread_time() - c0 + other_cpu, 4),
                          "planned_last": update.planned,
                          "loader_last": len(update.fed) - update.planned, **extra}
        self._record_and_verify(model, update, landed, checking, verify, recording)
        self.plan.last["phases_ms"] = {
            k: round(v * 1e3, 3) for k, v in (("before", t1 - t0), ("load", t2 - t1),
                                              ("landed", t4 - t3), ("after_load", t5 - t4),
                                              ("verify", clock() - t5))}
        last = self.verifier.last
        if verify and last is not None and isinstance(last.get("seconds"), dict):
            # what verification cost while the update streamed (in the apply's time)
            last["seconds"].update({k: round(v, 4) for k, v in update.seconds.items()})

    def _stream(self, tensors: Iterator[tuple[str, torch.Tensor]],
                update: Update) -> Iterator[tuple[str, torch.Tensor]]:
        """The update as the loader sees it: planned tensors are written on the way (as
        the engine's `load` pulls them, so inside whatever context it holds), the rest
        yielded to the loader; every tensor is counted and, if wanted, kept."""
        for name, t in tensors:
            update.feed(name, t)
            route = update.routes.get(name)
            if route is not None:
                if self._skip_copy(update, route, t):
                    update.digests.uncopied.add(name)  # type: ignore[union-attr]
                else:
                    update.keep(name, t)
                self.write_planned(name, t, route)
                if update.digests is not None:
                    t0 = time.perf_counter()
                    # (on a GPU nothing is emptied: no set built per tensor there)
                    dests = {st.dest for st in route.steps} if update.emptied else None
                    if dests and dests <= update.emptied:
                        update.digests.unproved.update(dests)
                    else:
                        update.digests.add(route.steps, t, update.dtypes, name)
                    update.seconds["digest_received"] += time.perf_counter() - t0
                update.planned += 1
                continue
            c = self.loader_copy(t)
            update.keep(name, t, c)
            yield name, c

    def _skip_copy(self, update: Update, route: Route, t: torch.Tensor) -> bool:
        """Whether a planned tensor needs no copy for a shadow: the last update needed
        no shadow at all (digests proved everything it landed), no module ever differed,
        and the digests will prove this tensor too. The copy would cost more than the
        check (on the host a memory copy of the update, on an accelerator a transfer);
        the price is that a digest failure cannot be repaired in the same update (it is
        torn, naming the tensors, and the next update keeps copies and repairs them on
        a shadow)."""
        if update.digests is None or not self.verifier.digest_only_last or self.verifier.suspect:
            return False
        return DigestCheck.provable(route.steps, t, update.dtypes)

    def _record_and_verify(self, model: torch.nn.Module, update: Update, landed: set[str],
                           checking: bool, verify: bool, recording: bool) -> None:
        """Record the plan on the first update (and check it on the fresh-load shadow,
        which then verifies the update too), or verify as the policy asks; the first
        update through the plan is always verified, and a difference from a fresh load
        in what the plan wrote turns the plan off."""
        kept = update.kept
        plan: CopyPlan | None = None
        if recording and update.fed:
            try:
                plan = self.expectations().record_plan(update.fed)
            except Exception as e:
                self.plan.disable(f"recording failed: {type(e).__name__}: {e}")
        if plan is not None:
            self.plan.check_on_shadow(plan, self.verifier, model,
                                      lambda hook: self.fresh_load(kept, before_processing=hook),
                                      dict(kept), landed, verify, self._streamer(kept))
            if not verify:
                self.verifier.skipped()
        elif verify:
            # (what the plan wrote: needed only to judge the plan's first use)
            planned = ({st.dest for r in update.routes.values() for st in r.steps}
                       if checking else set())
            self.plan.verify_update(self.verifier, model,
                                    lambda: self.fresh_load(kept, before_processing=mark_loaded),
                                    landed, checking and update.planned > 0, planned,
                                    update.digests, self._streamer(kept))
        elif update.fed:
            self.verifier.skipped()

    def _apply_by_fresh_load(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The update through the engine's fresh-load path, copied into the live model's
        storage (`engine.transplant`): for a model whose loader removed parameters it
        needs from the live model. Nothing is written until the fresh model is built and
        matches the live one tensor for tensor."""
        model = self.model()
        t0, c0 = time.perf_counter(), time.thread_time()
        kept = [(name, t.to("cpu", copy=True)) for name, t in tensors]
        fresh = self.fresh_load(kept)
        nbytes = transplant(fresh, model)
        del fresh
        self.plan.last = {"seconds": round(time.perf_counter() - t0, 4),
                          "cpu_seconds": round(time.thread_time() - c0, 4),
                          "planned_last": 0, "loader_last": len(kept),
                          "fresh_load": {"removed": self.by_fresh_load[:8], "bytes": nbytes}}
        fed = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in kept]
        if self.verifier.wanted(self.requested):
            self.plan.verify_update(self.verifier, model, lambda: self.fresh_load(kept),
                                    self.landed(fed) - set(self.by_fresh_load), False, set(),
                                    None, self._streamer(kept))
        else:
            self.verifier.skipped()


class ApplyBinding(EngineBinding):
    """The `EngineBinding` of an engine that applies with an `ApplyTarget`: its
    expectations are the target's loader dry run, its `info` reports the verification
    and the copy plan, and every state change is published in a `Beacon` (readable on
    the host without an RPC, which would queue behind an update). An engine adds its
    dtype and, where it has them, readable weights, a flush and `after_update`."""

    def __init__(self, target: ApplyTarget, worker_rank: int = 0,
                 beacon: str | None = None) -> None:
        """`worker_rank`: this worker's index in its replica; `beacon`: the name of its
        state file (default `<engine>-<worker_rank>`)."""
        self._target = target
        self.worker_rank = worker_rank
        self.beacon = Beacon.create(beacon or f"{self.engine}-{worker_rank}")

    def target(self) -> ApplyTarget:
        return self._target

    def expectations(self) -> Expectations:
        return self._target.expectations()

    def state_changed(self, state: dict[str, Any]) -> None:
        self.beacon.publish(state)

    def info(self) -> dict[str, Any]:
        return {"beacon": str(self.beacon.path), "verification": self._target.verifier.state(),
                "copy_plan": self._target.plan.info()}

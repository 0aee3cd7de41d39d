"""What an engine accepts in an update, derived from the engine itself.

`EngineSide.check` refuses, before any byte moves, every update the engine's loader
would refuse later for a name, shape or dtype reason. The engine plugins supply an
`Expectations` object; `LoaderExpectations` is the one real engines use: it runs the
engine's OWN `load_weights` on a copy of its model whose parameters live on the meta
device (no memory, no data), feeding it meta tensors of the update's names and shapes,
and records which parameter every tensor lands in. Nothing here knows a model family:
the engine's loader decides, and the checkpoint the engine started from is the
baseline of what a complete update covers.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from enginehooks.core.dtypes import dtype_name, torch_dtype
from enginehooks.core.errors import ManifestError
from enginehooks.core.keep import under
from enginehooks.core.manifest import DTYPE_SIZES, TensorSpec
from enginehooks.engine.copy_plan import CopyPlan, record_plan
from enginehooks.engine.trace import ByteTracer, MetaScalars
from enginehooks.engine.transplant import needs_fresh_load, removed_parameters

log = logging.getLogger("enginehooks.expectations")


class Expectations(ABC):
    """The engine's answer to "would you load these tensors?"."""

    @abstractmethod
    def problems(self, specs: Sequence[TensorSpec], keep: Sequence[str] = ()) -> list[str]:
        """Every reason the engine would refuse an update of `specs` (names, wire
        dtypes, shapes), each naming its tensor; empty when it takes it.

        `keep`: the modules the update declares it leaves out (checkpoint name
        prefixes, the manifest's `meta["keep"]`: `core.keep`): their tensors may be
        absent, and the engine keeps what it holds for them, where the engine can keep
        them whole (see `LoaderExpectations`)."""

    @abstractmethod
    def checkpoint_spec(self, name: str) -> TensorSpec | None:
        """The checkpoint-layout spec of `name` where the engine knows it (digests)."""

    def wire_dtypes(self) -> dict[str, str]:
        """Checkpoint name -> the dtype the engine wants it in, where known."""
        return {}

    def uncast(self) -> list[str]:
        """Checkpoint tensors the trainer must send in its own dtype, where known: the
        engine's loader computes on them before they land (in the dtype it receives),
        so only the dtype a fresh load reads gives what a fresh load gives."""
        return []

    def unloaded(self) -> list[str]:
        """Engine parameters no tensor of its checkpoint loads, where known: they hold
        what the model's constructor left (uninitialised memory, in most engines), in a
        fresh load as after any update, so no update can make them what the trainer
        holds."""
        return []



def sent_but_kept(specs: Sequence[TensorSpec], keep: Sequence[str]) -> list[str]:
    """An update that sends tensors of a module it says it keeps contradicts itself."""
    both = sorted(s.name for s in specs if under(s.name, keep))
    if not both:
        return []
    return [f"{len(both)} tensors of the update belong to modules it declares kept "
            f"{sorted(k for k in keep if any(under(n, (k,)) for n in both))[:5]}, first: "
            f"{both[:5]}: a kept module is left out whole"]


class CheckpointExpectations(Expectations):
    """Expectations read from the checkpoint the engine was loaded from: names and
    shapes exactly; a floating tensor may come in another floating dtype (the module
    target's copy casts it, as a loader does), any other dtype exactly."""

    def __init__(self, specs: Mapping[str, TensorSpec], *, require_all: bool = True) -> None:
        self.specs = dict(specs)
        self.require_all = require_all

    def checkpoint_spec(self, name: str) -> TensorSpec | None:
        return self.specs.get(name)

    def problems(self, specs: Sequence[TensorSpec], keep: Sequence[str] = ()) -> list[str]:
        problems = sent_but_kept(specs, keep)
        for t in specs:
            want = self.specs.get(t.name)
            if want is None:
                problems.append(f"unknown tensor {t.name!r}: the model has no such weight")
            elif tuple(want.shape) != tuple(t.shape):
                problems.append(f"tensor {t.name!r}: shape {list(t.shape)} but the model "
                                f"expects {list(want.shape)}")
            elif want.dtype != t.dtype and not (torch_dtype(want.dtype).is_floating_point
                                                and torch_dtype(t.dtype).is_floating_point):
                problems.append(f"tensor {t.name!r}: dtype {t.dtype} but the engine runs "
                                f"{want.dtype}")
        if self.require_all:
            sent = {t.name for t in specs}
            missing = sorted(n for n in self.specs if n not in sent and not under(n, keep))
            if missing:
                problems.append(f"{len(missing)} tensors of the model are missing from the "
                                f"update (engines reload whole layers), first: {missing[:5]}")
        return problems


def resolve_model_dir(model: str) -> Path:
    """A local folder for `model`: the path itself, or its snapshot in the HF cache."""
    p = Path(model)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as e:
        raise ManifestError(f"cannot find the checkpoint of {model!r} locally: {e}") from e


_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def checkpoint_specs(model_dir: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """Name -> spec (stored dtype, shape) of every tensor in the folder's safetensors
    files; reading the headers touches no tensor data."""
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ManifestError(f"no *.safetensors in {folder}: cannot validate updates against it")
    specs: dict[str, TensorSpec] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = st.get_slice(name)
                stored = _ST_DTYPES.get(sl.get_dtype(), "")
                if stored in DTYPE_SIZES:
                    specs[name] = TensorSpec(name, stored, tuple(sl.get_shape()))
    return specs


def to_meta(skeleton: torch.nn.Module, keep: Collection[int] = ()) -> torch.nn.Module:
    """Every parameter of an engine's model skeleton on the meta device, for the loader
    dry run. Engines' Transformers backends build some (or all) modules on the CPU even
    under a meta device context; a parameter cannot change device type in place
    (`p.data = ...` raises), so each is replaced by a meta twin that keeps its
    attributes (`weight_loader`, ...), once per parameter so tied ones stay tied.
    `keep`: ids of parameters shared with the live model, left alone."""
    twins: dict[int, torch.nn.Parameter] = {}
    for module in skeleton.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta or id(p) in keep:
                continue
            if id(p) not in twins:
                twin = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                          requires_grad=p.requires_grad)
                twin.__dict__.update(p.__dict__)
                twins[id(p)] = twin
            setattr(module, name, twins[id(p)])
    return skeleton


def skeleton_on_meta(build: Callable[[torch.device], torch.nn.Module], *,
                     keep: Collection[int] = (), engine: str) -> torch.nn.Module:
    """The engine's model class built for the loader dry run, on the meta device.

    `build(device)` constructs it exactly as the engine does, under `device`. Model
    constructors that read a parameter's value (`float(self.beta.item())`) get 0 from
    meta tensors (`MetaScalars`). A model that still cannot be built on the meta device
    is built on the CPU for real, then moved to meta parameter by parameter: it costs
    memory once, and an enginehooks limitation never turns into an engine that refuses
    updates (or generation)."""
    try:
        with MetaScalars():
            return to_meta(build(torch.device("meta")), keep=keep)
    except Exception as e:
        log.warning("%s: the model cannot be built on the meta device for the loader dry run "
                    "(%s: %s); building it on the CPU instead", engine, type(e).__name__, e)
    return to_meta(build(torch.device("cpu")), keep=keep)


@dataclass
class Landing:
    """Where the engine's loader put one tensor: the parameters it loaded into (with
    their dtypes and the elements it handed each), or the loader's error."""

    params: dict[str, str] = field(default_factory=dict)  # parameter -> its dtype
    numel: dict[str, int] = field(default_factory=dict)   # parameter -> elements handed over
    error: str | None = None


_NAMED = {getattr(torch, n) for n in DTYPE_SIZES}


class LoaderExpectations(Expectations):
    """Expectations derived from the engine's own loader, dry-run on meta tensors.

    Args:
        skeleton: builds the engine's model class on the meta device, exactly as the
            engine builds it (once; cached).
        load: `load(model, weights)` runs the engine's `load_weights` as the engine's
            update path would (inside its config context).
        checkpoint: name -> spec of the checkpoint the engine started from (the
            baseline: what a complete update covers, and the shapes it had).
        engine: the engine's name, for messages.
        live: the live model, where the engine lets it be read: a loader that removed
            parameters from it after the first load (`engine.transplant`) cannot take
            updates of them in place: `fresh_load_needed` says when an update must be
            applied by a fresh load instead (updates are whole: see `_missing`).

    Problems it reports, each naming the tensor: the loader raises on it (unknown
    name, wrong shape); the loader writes it into no parameter or buffer (it would be
    silently ignored) unless a fresh load ignores the engine's own checkpoint tensor of
    that name too; its shape differs from the engine's checkpoint; an integer tensor
    whose dtype differs from the checkpoint's; and an engine parameter the update would
    leave (partly) on old values, with the checkpoint tensors that would have covered it.
    Floating dtypes the loader casts (an fp32 trainer, a bf16 engine) are accepted.
    """

    def __init__(self, skeleton: Callable[[], torch.nn.Module],
                 load: Callable[[torch.nn.Module, Iterator[tuple[str, torch.Tensor]]], Any],
                 checkpoint: Mapping[str, TensorSpec], *, engine: str,
                 live: Callable[[], torch.nn.Module] | None = None) -> None:
        self._skeleton_fn, self._load = skeleton, load
        self._live = live
        self.checkpoint = dict(checkpoint)
        self.engine = engine
        self._model: torch.nn.Module | None = None
        self._built: list[str] = []  # the skeleton's parameters as built
        self._built_ids: dict[str, int] = {}  # ... and which are one (tied)
        self._copies: set[str] | None = None  # checkpoint tensors the loader only copies
        self._cache: dict[tuple[str, str, tuple[int, ...]], Landing] = {}
        self._baseline: dict[str, Landing] | None = None

    def checkpoint_spec(self, name: str) -> TensorSpec | None:
        return self.checkpoint.get(name)

    # -- the dry run ----------------------------------------------------------------------
    def _ready(self) -> torch.nn.Module:
        if self._model is None or self._changed():
            # A loader that removes parameters (engine.transplant) removed them from the
            # skeleton in an earlier dry run too: the next one needs it whole again.
            self._model = self._skeleton_fn()
            # as built: a dry run of a loader that removes parameters removes them here too
            built = dict(self._model.named_parameters(remove_duplicate=False))
            self._built = list(built)
            self._built_ids = {n: id(p) for n, p in built.items()}
        return self._model

    def _changed(self) -> bool:
        assert self._model is not None
        now = [n for n, _ in self._model.named_parameters(remove_duplicate=False)]
        return now != self._built

    def landings(self, specs: Sequence[TensorSpec]) -> dict[str, Landing]:
        """Where each tensor of `specs` lands (cached per name, dtype and shape): the
        engine's loader runs on meta tensors under a `ByteTracer`, which follows every
        tensor op by op into the parameter and buffer storage it is written to, whether
        through a `weight_loader` or a direct copy."""
        cache = self._cache
        keys = [(s.name, s.dtype, tuple(s.shape)) for s in specs]
        todo = [s for s, k in zip(specs, keys, strict=True) if k not in cache]
        if not todo:  # every push of a training loop: no skeleton needed (nor walked)
            return {s.name: cache[k] for s, k in zip(specs, keys, strict=True)}
        model = self._ready()
        while todo:
            tracer = ByteTracer(model)
            feed = ((s.name, torch.empty(s.shape, dtype=torch_dtype(s.dtype), device="meta"))
                    for s in todo)
            errors: dict[str, str] = {}
            try:
                with torch.no_grad(), tracer:
                    self._load(model, tracer.feed(feed))
                tracer.settle(model)
                done, todo = todo, []
            except Exception as e:
                culprit = tracer.current
                index = next((i for i, s in enumerate(todo) if s.name == culprit), None)
                if index is None:  # failed outside any tensor (e.g. after the last one)
                    errors = {s.name: _first_line(e) for s in todo}
                    done, todo = todo, []
                else:
                    errors[culprit] = _first_line(e)  # type: ignore[index]
                    done, todo = todo[: index + 1], todo[index + 1:]
            for s in done:
                w = tracer.written.get(s.name)
                landing = Landing(error=errors.get(s.name))
                if w is not None:
                    for dest, n in w.into.items():
                        dt = w.dtypes.get(dest)
                        landing.params[dest] = dtype_name(dt) if dt is not None and dt in _NAMED else ""
                        landing.numel[dest] = n
                self._cache[(s.name, s.dtype, tuple(s.shape))] = landing
        return {s.name: self._cache[(s.name, s.dtype, tuple(s.shape))] for s in specs}

    def record_plan(self, specs: Sequence[TensorSpec]) -> CopyPlan:
        """The copy plan of an update of `specs`: the engine's loader run once more on the
        meta skeleton under a `PlanRecorder` (see `engine.copy_plan`)."""
        return record_plan(self._ready(), specs, self._load)

    def baseline(self) -> dict[str, Landing]:
        """Where the engine's own checkpoint lands: the coverage a complete update needs."""
        if self._baseline is None:
            self._baseline = self.landings(list(self.checkpoint.values()))
        return self._baseline

    def unloaded(self) -> list[str]:
        try:
            base = self.baseline()
        except Exception:  # `info` must answer: the refusal comes with `check`
            return []
        ids = self._built_ids
        landed = {ids[p] for landing in base.values() for p in landing.params if p in ids}
        return sorted(n for n, i in ids.items() if i not in landed)

    def wire_dtypes(self) -> dict[str, str]:
        """Checkpoint name -> the dtype of the parameter it lands in, for floating
        tensors the loader only copies (what the trainer should send each one as).

        Only pure copies (views plus one `copy_`, as the copy plan records them): a
        copy casts exactly as the trainer's `.to(dtype)` does, but a loader that computes
        on the tensor before it lands (SGLang's Gemma adds 1.0 to its norms in place)
        computes in the dtype it receives, and a fresh load receives the checkpoint's.
        Those tensors travel in the trainer's own dtype."""
        out: dict[str, str] = {}
        try:
            base = self.baseline()
        except Exception as e:  # `info` must answer: the refusal comes with `check`
            log.warning("%s: no loader dry run here (%s); wire dtypes unknown", self.engine,
                        _first_line(e))
            return out
        copies = self._pure_copies()
        for name, landing in base.items():
            dts = {d for d in landing.params.values() if d}
            spec = self.checkpoint[name]
            if (len(dts) == 1 and torch_dtype(spec.dtype).is_floating_point
                    and name in copies):
                out[name] = dts.pop()
        return out

    def uncast(self) -> list[str]:
        try:
            base = self.baseline()
        except Exception:  # `info` must answer: the refusal comes with `check`
            return []
        copies = self._pure_copies()
        return sorted(n for n, landing in base.items()
                      if landing.params and n not in copies
                      and torch_dtype(self.checkpoint[n].dtype).is_floating_point)

    def _pure_copies(self) -> set[str]:
        """Checkpoint tensors whose path through the loader is views plus one copy."""
        if self._copies is None:
            try:
                plan = self.record_plan(list(self.checkpoint.values()))
                self._copies = {n for n, r in plan.routes.items() if r.planned}
            except Exception as e:  # no casts announced: the loader gets the trainer's dtype
                log.warning("%s: could not record the loader's copies (%s); the trainer "
                            "sends its own dtypes", self.engine, _first_line(e))
                self._copies = set()
        return self._copies

    # -- the verdict ------------------------------------------------------------------------
    def problems(self, specs: Sequence[TensorSpec], keep: Sequence[str] = ()) -> list[str]:
        try:
            base = self.baseline()
        except Exception as e:
            # Our own limitation, not the update's fault and not the engine's: refuse the
            # update (nothing moves) and leave the engine serving the weights it holds.
            return [f"the {self.engine} loader dry run cannot build this model here "
                    f"({_first_line(e)}); the update is refused before any byte moves and "
                    "the engine keeps serving its current weights (report it to enginehooks)"]
        problems: list[str] = sent_but_kept(specs, keep)
        for s in specs:
            ck = self.checkpoint.get(s.name)
            if ck is not None and tuple(ck.shape) != tuple(s.shape):
                problems.append(f"tensor {s.name!r}: shape {list(s.shape)} but the {self.engine} "
                                f"engine's checkpoint has {list(ck.shape)}")
        if problems:
            return problems + self._missing(specs, base, keep=keep)
        landed = self.landings(specs)
        for s in specs:
            landing = landed[s.name]
            if landing.error is not None:
                problems.append(f"tensor {s.name!r}: the {self.engine} loader refuses it "
                                f"({landing.error})")
            elif not landing.params:
                if s.name not in self.checkpoint:
                    problems.append(f"unknown tensor {s.name!r}: the {self.engine} loader loads it "
                                    "into no parameter (it would be ignored)")
                elif base[s.name].params:
                    problems.append(f"tensor {s.name!r}: the {self.engine} loader writes it into "
                                    f"no parameter as {s.dtype}, though it loads the engine's "
                                    f"checkpoint tensor ({self.checkpoint[s.name].dtype}) into "
                                    f"{sorted(base[s.name].params)[:3]}")
            else:
                # A floating tensor in another dtype than its parameter is the loader's
                # to cast (fp32 -> bf16, bf16 -> a quantised format): it ran on the
                # wire dtype above and landed, so the engine takes it as a fresh load
                # of that checkpoint would.
                floating = torch_dtype(s.dtype).is_floating_point
                ck = self.checkpoint.get(s.name)
                if not floating and ck is not None and ck.dtype != s.dtype:
                    problems.append(f"tensor {s.name!r}: dtype {s.dtype} but the engine's "
                                    f"checkpoint has {ck.dtype}")
        return problems + self._missing(specs, base, landed, keep)

    def fresh_load_needed(self, specs: Sequence[TensorSpec]) -> list[str]:
        """The parameters this update's tensors land in (by the dry run) that the live
        model no longer has: non-empty when only a fresh load can apply it."""
        if self._live is None:
            return []
        landed = {p for landing in self.landings(specs).values() for p in landing.params}
        self._ready()
        return needs_fresh_load(landed, removed_parameters(self._live(), self._built))

    def kept(self, specs: Sequence[TensorSpec], keep: Sequence[str]) -> list[str]:
        """The engine modules an update of `specs` leaves out whole under `keep` (they
        keep the values they hold): the receive reply reports them."""
        if not keep:
            return []
        base = self.baseline()
        got: dict[str, int] = {}
        for landing in self.landings(specs).values():
            for p, n in landing.numel.items():
                got[p] = got.get(p, 0) + n
        return sorted({_module(p) for p in self._kept(specs, base, got, keep)})

    @staticmethod
    def _kept(specs: Sequence[TensorSpec], base: Mapping[str, Landing], got: Mapping[str, int],
              keep: Sequence[str]) -> set[str]:
        """Engine parameters an update may leave on the values they hold: every
        checkpoint tensor the engine loads into them belongs to a module the update
        declares kept and is absent, and no tensor of the update lands anywhere in their
        engine module. The engines reload by module (vLLM's layerwise reload rebuilds a
        layer from what it receives; a layer that receives nothing keeps its tensors), so
        an engine module is sent whole or not at all."""
        if not keep:
            return set()
        sent = {s.name for s in specs}
        feeders: dict[str, set[str]] = {}
        for name, landing in base.items():
            for p in landing.params:
                feeders.setdefault(p, set()).add(name)
        touched = {_module(p) for p, n in got.items() if n > 0}
        return {p for p, names in feeders.items()
                if _module(p) not in touched
                and all(n not in sent and under(n, keep) for n in names)}

    def _missing(self, specs: Sequence[TensorSpec], base: Mapping[str, Landing],
                 landed: Mapping[str, Landing] | None = None,
                 keep: Sequence[str] = ()) -> list[str]:
        """Engine parameters the update would cover less than the engine's checkpoint
        did (vLLM and SGLang reload whole layers: a partial layer keeps old values),
        except those of engine modules the update leaves out whole (`_kept`)."""
        want: dict[str, int] = {}
        for landing in base.values():
            for p, n in landing.numel.items():
                want[p] = want.get(p, 0) + n
        got: dict[str, int] = {}
        for landing in (landed or {}).values():
            for p, n in landing.numel.items():
                got[p] = got.get(p, 0) + n
        if landed is None:  # shapes already refused: name what is absent by name
            sent = {s.name for s in specs}
            absent = sorted(n for n in self.checkpoint
                            if n not in sent and base[n].params and not under(n, keep))
        else:
            kept = self._kept(specs, base, got, keep)
            short = {p for p, n in want.items() if got.get(p, 0) < n and p not in kept}
            sent = {s.name for s in specs}
            absent = sorted(n for n, landing in base.items()
                            if n not in sent and short.intersection(landing.params))
            excess = sorted(p for p, n in got.items() if n > want.get(p, n))
            if excess:
                # Loaders trim what does not fit: more elements than the engine's own
                # checkpoint gave a parameter means a tensor of the wrong shape.
                senders = sorted(n for n, landing in landed.items()
                                 if set(landing.params).intersection(excess))
                return [f"tensors {senders[:5]} give engine parameters {excess[:5]} more elements "
                        f"than the {self.engine} engine's checkpoint does (wrong shapes)"]
            if short and not absent:
                return [f"the update leaves engine parameters {sorted(short)[:5]} partly on old "
                        "values (an update must carry whole layers)"]
        if not absent:
            return []
        return [f"{len(absent)} tensors the {self.engine} engine loads are missing from the update "
                f"(engines reload whole layers), first: {absent[:5]}"]


def _module(param: str) -> str:
    """The engine module that owns parameter `param` (its name minus the last part)."""
    return param.rpartition(".")[0]


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text[:300]

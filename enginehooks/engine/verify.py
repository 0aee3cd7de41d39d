"""Verify after apply: what the engine's forward reads equals what a fresh load gives.

An engine's reload path can be wrong: vLLM's layerwise reload drops writes a model's
`load_weights` makes with a direct `param.data.copy_` (they land on meta tensors and the
old tensors are put back), and leaves a buffer that aliases a repacked parameter stale.
Every parameter can then compare equal to a fresh load while greedy output differs. So
after an update, each engine binding builds a **shadow**: the engine's own model class,
loaded from the same update tensors through the engine's fresh-load path (its
`load_weights` plus its post-load processing), and compares it with the live model
module by module. What is compared is everything the forward can read:

- parameters and buffers, aliases included (`remove_duplicate=False`);
- tensors held as plain module attributes (`_cpu_unpacked_conv_weight`, ...);
- tensors captured by callables a module holds (vLLM CPU's `cpu_linear` closures carry
  the prepacked weight the forward multiplies with).

Bits are compared exactly. A mismatch is repaired in place (the shadow's bits copied
into the live tensor, so every reference the engine holds, CUDA graphs included, sees
them) and verified again; what cannot be repaired (another shape, an opaque handle) ends
the update `torn` naming the tensors. Workarounds are chosen by what verification
observes, never by model name: an engine binding that once needed a repair verifies
every later update in that process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from enginehooks.core.errors import ConfigError, EngineHooksError

log = logging.getLogger("enginehooks.verify")

VERIFY_ENV = "ENGINEHOOKS_VERIFY"
POLICIES = ("first", "always", "never")


class WeightsMismatch(EngineHooksError):
    """After an update, tensors the engine's forward reads differ from a fresh load of
    the same weights, and could not be repaired: the engine is torn, never current."""


def verify_policy() -> str:
    """`ENGINEHOOKS_VERIFY`: "first" (default: the first update in a process, and every
    update after one that needed a repair), "always", or "never"."""
    policy = os.environ.get(VERIFY_ENV, "first").strip().lower()
    if policy not in POLICIES:
        raise ConfigError(f"{VERIFY_ENV}={policy!r}: one of {POLICIES}")
    return policy


def ensure_room(device: torch.device, nbytes: int) -> None:
    """Raise `MemoryError` unless `device` has room for a shadow of `nbytes` (plus a
    margin): an accelerator that cannot hold a second model leaves the update
    unverified (and says so) rather than failing the engine with an out-of-memory."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if free < int(nbytes * 1.25):
        raise MemoryError(f"{free / 2**30:.1f} GiB free on {device}, a shadow needs about "
                          f"{nbytes * 1.25 / 2**30:.1f} GiB")


def _closure_tensors(fn: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors a function captured (closure cells, default arguments)."""
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    for name, cell in zip(names, cells):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor):
            yield name, value
    for i, value in enumerate(getattr(fn, "__defaults__", None) or ()):
        if isinstance(value, torch.Tensor):
            yield f"default{i}", value


def readable_tensors(module: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Key -> (kind, tensor) of everything `module` itself (not its children) holds that a
    forward can read. Kinds: param, buffer, attr, closure."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
        out[name] = ("param", p)
    for name, b in module.named_buffers(recurse=False, remove_duplicate=False):
        if b is not None:
            out[name] = ("buffer", b)
    for name, value in vars(module).items():
        if name.startswith("_") and name in ("_parameters", "_buffers", "_modules"):
            continue
        if isinstance(value, torch.Tensor) and name not in out:
            out[name] = ("attr", value)
        elif callable(value) and not isinstance(value, torch.nn.Module):
            for cname, t in _closure_tensors(value):
                out[f"{name}<{cname}>"] = ("closure", t)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's bytes as a flat uint8 tensor, or None when they cannot be read
    (meta, opaque layouts)."""
    try:
        if t.is_meta or t.layout != torch.strided:
            return None
        flat = t.detach().contiguous().reshape(-1)
        return flat.view(torch.uint8)
    except Exception:
        return None


@dataclass
class Mismatch:
    name: str          # module.key
    kind: str          # param | buffer | attr | closure
    why: str           # "values", "shape", "dtype"
    live: torch.Tensor
    fresh: torch.Tensor


@dataclass
class Verdict:
    """What one verification found."""

    compared: int = 0
    mismatched: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"compared": self.compared, "mismatched": self.mismatched[:50],
                "repaired": self.repaired[:50], "unreadable": self.unreadable[:50]}


def touched_modules(model: torch.nn.Module, landed: Collection[str]) -> set[str]:
    """Names of the modules that own a landed tensor, and their ancestors (a parent may
    hold a buffer or a packed copy derived from a child's parameter)."""
    names = {n for n, _ in model.named_modules()}
    out: set[str] = set()
    for tensor_name in landed:
        prefix = tensor_name.rsplit(".", 1)[0] if "." in tensor_name else ""
        while True:
            if prefix in names:
                out.add(prefix)
            if not prefix:
                break
            prefix = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    return out


def _with_aliases(model: torch.nn.Module, landed: Collection[str]) -> set[str]:
    """`landed` plus every other name of the same storage (a tied output head is the
    embedding under a second name)."""
    by_storage: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        try:
            key = int(t.untyped_storage()._cdata)
        except Exception:
            continue
        by_storage.setdefault(key, []).append(name)
    out = set(landed)
    for names in by_storage.values():
        if out.intersection(names):
            out.update(names)
    return out


def compare(live: torch.nn.Module, fresh: torch.nn.Module, landed: Collection[str],
            verdict: Verdict) -> list[Mismatch]:
    """Every readable tensor of the touched modules of `live` that differs from
    `fresh`. Parameters are compared where this update landed something in them (others
    hold whatever they were initialised with, in both models); buffers, attributes and
    captured tensors of touched modules always (they are derived from the weights)."""
    landed = _with_aliases(live, landed)
    touched = touched_modules(live, landed)
    fresh_modules = dict(fresh.named_modules())
    out: list[Mismatch] = []
    for mname, module in live.named_modules():
        if mname not in touched or mname not in fresh_modules:
            continue
        mine, theirs = readable_tensors(module), readable_tensors(fresh_modules[mname])
        for key, (kind, t) in mine.items():
            full = f"{mname}.{key}".lstrip(".")
            if kind == "param" and full not in landed:
                continue
            other = theirs.get(key)
            if other is None:
                continue
            f = other[1]
            if kind in ("attr", "closure") and (f.shape != t.shape or f.dtype != t.dtype):
                continue  # runtime state (caches), not weights: both hold their own
            verdict.compared += 1
            if f.dtype != t.dtype:
                out.append(Mismatch(full, kind, "dtype", t, f))
                continue
            if f.shape != t.shape:
                out.append(Mismatch(full, kind, "shape", t, f))
                continue
            a, b = _bits(t), _bits(f.to(t.device))
            if a is None or b is None:
                verdict.unreadable.append(full)
                continue
            if not torch.equal(a, b):
                out.append(Mismatch(full, kind, "values", t, f))
    return out


def verify_and_repair(live: torch.nn.Module, build_fresh: Callable[[], torch.nn.Module],
                      landed: Collection[str], *, engine: str) -> Verdict:
    """Build the fresh-load shadow, compare, repair in place what differs in values,
    compare again. Raises `WeightsMismatch` naming what still differs."""
    verdict = Verdict()
    fresh = build_fresh()
    with torch.no_grad():
        first = compare(live, fresh, landed, verdict)
        for m in first:
            if m.why == "values":
                m.live.copy_(m.fresh.to(m.live.device))
                verdict.repaired.append(m.name)
        verdict.mismatched = [m.name for m in first]
        if first:
            log.warning("%s: after the update %d tensors differed from a fresh load of the same "
                        "weights (%s); repaired in place from the fresh load: %s", engine,
                        len(first), ", ".join(f"{m.name} [{m.why}]" for m in first[:8]),
                        len(verdict.repaired))
            again = compare(live, fresh, landed, Verdict())
            if again:
                raise WeightsMismatch(
                    f"after the update, {len(again)} tensors the {engine} engine's forward reads "
                    f"differ from a fresh load of the same weights and could not be repaired: "
                    + ", ".join(f"{m.name} ({m.why})" for m in again[:8])
                    + "; the engine is torn and refuses generation until an update succeeds "
                    "(report it upstream: the engine's reload path)")
    del fresh
    return verdict


class Verifier:
    """When to verify, and what the last verification found, for one engine worker.

    Policy (`ENGINEHOOKS_VERIFY`): "first" verifies the first update in the process and,
    once any verification needed a repair, every later one (the engine's reload path is
    then known to be wrong for this model); "always"; "never". A shadow that cannot be
    built (the engine cannot construct a second model here) leaves the update
    unverified, logged and reported by `state()`, rather than failing weights that the
    engine's own reload path applied.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        try:
            self.policy = verify_policy()
        except ConfigError as e:
            log.error("%s; verifying the first update only", e)
            self.policy = "first"
        self.verified = 0
        self.sticky = False
        self.last: dict[str, Any] | None = None

    def wanted(self, requested: bool = False) -> bool:
        """Whether this update is verified; `requested`: the trainer asked
        (`WeightSync(verify=True)`), which even policy "never" honours."""
        if requested:
            return True
        if self.policy == "never":
            return False
        return self.policy == "always" or self.verified == 0 or self.sticky

    def run(self, live: torch.nn.Module, build_fresh: Callable[[], torch.nn.Module],
            landed: Collection[str]) -> Verdict | None:
        try:
            verdict = verify_and_repair(live, build_fresh, landed, engine=self.engine)
        except WeightsMismatch as e:
            self.sticky = True
            self.last = {"ok": False, "error": str(e)}
            raise
        except Exception as e:  # the shadow could not be built: our own limitation
            log.warning("%s: could not verify this update (%s: %s); the weights were applied "
                        "by the engine's own reload path", self.engine, type(e).__name__, e)
            self.last = {"ok": None, "error": f"not verified: {type(e).__name__}: {e}"}
            return None
        self.verified += 1
        self.sticky = self.sticky or bool(verdict.mismatched)
        self.last = {"ok": True, **verdict.to_dict()}
        return verdict

    def state(self) -> dict[str, Any]:
        return {"policy": self.policy, "verified": self.verified,
                "every_update": self.sticky or self.policy == "always", "last": self.last}

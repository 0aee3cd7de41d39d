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

Bits are compared exactly. Where a tensor's bits cannot be read (an opaque oneDNN handle,
another layout), the two modules' forwards are compared on a fixed probe input
(`probe`) instead; what neither can compare is listed as not verified, never skipped
silently. A mismatch is repaired in place (the shadow's bits copied
into the live tensor, so every reference the engine holds, CUDA graphs included, sees
them) and verified again; what cannot be repaired (another shape, an opaque handle) ends
the update `torn` naming the tensors. Workarounds are chosen by what verification
observes, never by model name: a module that once needed a repair is always compared
on a shadow afterwards.

Not everything needs a shadow: a tensor the copy plan writes as a plain full copy holds
exactly the bytes sent, so a digest of the destination after apply, compared with the
digest of what was received, proves it (`DigestCheck`); a module whose every readable
tensor is such a destination is verified that way alone, and the shadow (built only
when some touched module needs it) is compared only where the loader computed.

Every update is verified by default (`ENGINEHOOKS_VERIFY=always`): the failure class
this guards against (post-load processing that is not safe to run again, repacking,
dropped writes of a layerwise reload) shows on the second and later updates, not only
the first. `first` and `never` remain opt-outs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
import time
import types
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from enginehooks.core.errors import ConfigError, EngineHooksError
from enginehooks.engine.shadow import (
    LOADED_ATTR,
    SHADOW_ENV,
    Pass,
    PeakMemory,
    Unstreamable,
    held_bytes,
    shadow_mode,
)
from enginehooks.engine.walk import (
    Structure,
    live_tensors,
    modules_by_name,
    tensors_by_name,
    unique_modules,
)

log = logging.getLogger("enginehooks.verify")

VERIFY_ENV = "ENGINEHOOKS_VERIFY"
POLICIES = ("always", "first", "never")
DEFAULT_POLICY = "always"
#: the digest that proves a plain copy (core/checksums.py: computed where the tensor
#: lives, position-weighted, order-independent)
DIGEST = "sum64"
#: the digest of bytes on the host (`digest_algorithm`)
HOST_DIGEST = "xxh3"


class WeightsMismatch(EngineHooksError):
    """After an update, tensors the engine's forward reads differ from a fresh load of
    the same weights, and could not be repaired: the engine is torn, never current."""


def verify_policy() -> str:
    """`ENGINEHOOKS_VERIFY`: "always" (default: every update), "first" (the first update
    in a process, and every update after one that needed a repair), or "never"."""
    policy = os.environ.get(VERIFY_ENV, DEFAULT_POLICY).strip().lower()
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


#: what a callable may capture that is no storage of weights
_PLAIN = (torch.Tensor, torch.nn.Module, int, float, bool, str, bytes, type(None), torch.dtype,
          torch.device, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
          functools.partial)


#: what every `nn.Module` holds in its `__dict__` (its parameter, buffer and child dicts,
#: hook tables, `training`): never a tensor or callable a forward reads, so the walks
#: below skip them by name (per touched module of every update: most of what they read)
_MODULE_STATE = frozenset(vars(torch.nn.Module()))


def opaque_captures(module: torch.nn.Module) -> dict[str, str]:
    """Callables `module` holds (not its children) that captured an object of an
    engine's own type, attribute -> the captured name: storage that is no tensor, such
    as vLLM CPU's oneDNN handler (`cpu_linear` captures a `CPUDNNLGEMMHandler` holding
    the prepacked weight, while `weight` is left empty). Its bits cannot be read: it is
    compared through the callable itself on a probe input (`probe_callable`)."""
    out: dict[str, str] = {}
    for name, value in vars(module).items():
        if (name in _MODULE_STATE or name.startswith("_") or isinstance(value, torch.nn.Module)
                or not callable(value)):
            continue
        code = getattr(value, "__code__", None)
        cells = getattr(value, "__closure__", None) or ()
        names = code.co_freevars if code is not None else ()
        for cname, cell in zip(names, cells):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if not isinstance(v, _PLAIN) and type(v).__module__ != "builtins":
                out[name] = cname
                break
    return out


def readable_tensors(module: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Key -> (kind, tensor) of everything `module` itself (not its children) holds that a
    forward can read. Kinds: param, buffer, attr, closure."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    # the module's own dicts, as `named_parameters(recurse=False)` reads them (without
    # its generator machinery: this runs for every touched module of every update)
    for name, p in module._parameters.items():
        if p is not None:
            out[name] = ("param", p)
    for name, b in module._buffers.items():
        if b is not None:
            out[name] = ("buffer", b)
    for name, value in vars(module).items():
        if name in _MODULE_STATE:
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


#: the probe input's rows, and its seed (fixed: both forwards must see the same input)
PROBE_ROWS, PROBE_SEED = 4, 0x5EED


def _in_features(module: torch.nn.Module) -> int | None:
    """How wide the input of a linear-like module's forward is (vLLM's linear layers,
    `nn.Linear`), or None when it is not one."""
    for attr in ("input_size_per_partition", "in_features", "input_size"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _dtype_of(module: torch.nn.Module) -> torch.dtype:
    d = getattr(module, "params_dtype", None)
    if isinstance(d, torch.dtype):
        return d
    for _, (_, t) in readable_tensors(module).items():
        if t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


def _outputs(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _outputs(item)]
    return []


def probe(live: torch.nn.Module, fresh: torch.nn.Module, device: torch.device) -> bool | None:
    """Compare two modules through their forwards on a fixed probe input, for tensors
    whose bits cannot be read (opaque prepacked storage): True when the outputs are
    bit-identical, False when they differ, None when the module's forward cannot be
    probed (not a linear-like module, or it fails on the probe)."""
    width = _in_features(live)
    if width is None:
        return None
    g = torch.Generator().manual_seed(PROBE_SEED)
    x = torch.randn(PROBE_ROWS, width, generator=g).to(device=device, dtype=_dtype_of(live))
    try:
        with torch.no_grad():
            a, b = _outputs(live(x)), _outputs(fresh(x.clone()))
    except Exception as e:
        log.info("probe of %s failed: %s: %s", type(live).__name__, type(e).__name__, e)
        return None
    if not a or len(a) != len(b):
        return None
    return _same_outputs(a, b)


def _probe_input(module: torch.nn.Module, device: torch.device) -> torch.Tensor | None:
    width = _in_features(module) or getattr(module, "embedding_dim", None)
    if not isinstance(width, int) or width <= 0:
        return None
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randn(PROBE_ROWS, width, generator=g).to(device=device, dtype=_dtype_of(module))


def probe_callable(live: torch.nn.Module, fresh: torch.nn.Module, attr: str,
                   device: torch.device) -> bool | None:
    """Compare the callables `attr` of two modules (a prepacked GEMM and the like) on a
    fixed probe input: called as the engine calls them, `(x, weight, bias)`, else `(x)`.
    True: bit-identical outputs; False: they differ; None: not callable that way."""
    x = _probe_input(live, device)
    if x is None:
        return None
    f_live, f_fresh = getattr(live, attr), getattr(fresh, attr, None)
    if f_fresh is None:
        return None
    if f_live is f_fresh:  # the fresh load's own callable, moved into the live module
        return True
    for args in ((getattr(live, "weight", None), getattr(live, "bias", None)), ()):
        fargs = (getattr(fresh, "weight", None), getattr(fresh, "bias", None)) if args else ()
        try:
            with torch.no_grad():
                a, b = _outputs(f_live(x, *args)), _outputs(f_fresh(x.clone(), *fargs))
        except Exception:
            continue
        if a and len(a) == len(b):
            return _same_outputs(a, b)
    return None


def _same_outputs(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    for p, q in zip(a, b):
        if p.shape != q.shape or p.dtype != q.dtype:
            return False
        bp, bq = _bits(p), _bits(q.to(p.device))
        if bp is None or bq is None or not torch.equal(bp, bq):
            return False
    return True


@dataclass
class Mismatch:
    name: str          # module.key
    kind: str          # param | buffer | attr | closure
    why: str           # "values", "shape", "dtype", "forward" (the probe's outputs)
    live: torch.Tensor | None
    fresh: torch.Tensor | None
    #: for an opaque callable: the modules holding it and its attribute (repaired by
    #: taking the shadow's callable, which holds the freshly packed storage)
    module: torch.nn.Module | None = None
    fresh_module: torch.nn.Module | None = None
    attr: str | None = None


@dataclass
class Verdict:
    """What one verification found, and how each part of the update was verified:
    `digest` (planned plain copies, by a digest of the destination against the bytes
    received), `compared` on the shadow (of them `probed` through the forward, for
    storage whose bits cannot be read), and what neither could (`unverified`)."""

    compared: int = 0
    mismatched: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    digest: int = 0
    digest_bytes: int = 0
    #: of `digest_bytes`, those a receiver landed itself and proved by one re-read
    #: (`DigestCheck.wire`): nothing was digested for them while the update streamed
    landed_bytes: int = 0
    #: of `digest_bytes`, those whose digests as received were the transport's own
    #: check of each piece as it landed (`DigestCheck.arrived`): not read at receipt
    arrived_bytes: int = 0
    shadow_bytes: int = 0
    probed: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    shadow: bool = True  # whether a shadow was built at all
    #: how the shadow was built: "streamed" (unit by unit, `engine.shadow`), "whole"
    #: (a second model at once), or "" (none)
    shadow_kind: str = ""
    shadow_units: int = 0  # units the streamed shadow built (one at a time)
    shadow_why: str = ""  # why a shadow was built whole, where it was
    #: the most bytes of real tensors the shadow held at once (parameters and buffers
    #: after its loader or its processing, whichever held more)
    shadow_tensor_bytes: int = 0
    #: the most device memory the shadow added at once, measured where the allocator
    #: tracks it (CUDA), else None (`shadow.PeakMemory`)
    shadow_peak_bytes: int | None = None
    #: where the time went: digests, building the shadow, comparing (and repairing)
    seconds: dict[str, float] = field(default_factory=dict)
    #: the verdict of the last update stood for this one (`Settled`): the same model
    #: structure and landing addresses, and a re-read found every landed byte as received
    settled: bool = False

    @property
    def how(self) -> str:
        parts = [p for p, n in (("digest", self.digest), ("shadow", self.shadow and
                                                           self.compared)) if n]
        return "+".join(parts) or "nothing to compare"

    def to_dict(self) -> dict[str, Any]:
        return {"compared": self.compared, "mismatched": self.mismatched[:50],
                "repaired": self.repaired[:50], "unreadable": self.unreadable[:50],
                "how": self.how, "digest": self.digest, "digest_bytes": self.digest_bytes,
                "landed_bytes": self.landed_bytes, "arrived_bytes": self.arrived_bytes,
                "shadow_bytes": self.shadow_bytes,
                "settled": self.settled,
                "probed": self.probed[:50],
                "unverified": self.unverified[:50], "shadow_kind": self.shadow_kind,
                "shadow_units": self.shadow_units, "shadow_why": self.shadow_why,
                "shadow_tensor_bytes": self.shadow_tensor_bytes,
                "shadow_peak_bytes": self.shadow_peak_bytes}


@dataclass
class DigestCheck:
    """What the copy plan wrote as plain copies in one update, with the digest of each
    run of bytes as it was received: destination name -> [(first element, end element,
    algorithm, digest)]. A destination whose runs cover it exactly once and each of
    which holds, after apply, the digest of the bytes received for it holds exactly the
    bytes sent (`check`): it needs no shadow. A destination some write of which is not
    a plain contiguous copy of the same dtype (a constant fill, a strided or sharded
    source, a clone first) is `unproved` and left to the shadow. `uncopied`: planned
    tensors of which no host copy was kept (the digests were to prove them): a
    destination of theirs that fails its digest cannot be repaired from a shadow in
    this update."""

    runs: dict[str, list[tuple[int, int, str, int | torch.Tensor]]] = field(default_factory=dict)
    unproved: set[str] = field(default_factory=set)
    uncopied: set[str] = field(default_factory=set)
    received_bytes: int = 0
    #: device vectors the received runs' digest terms are added into (`_device_term`)
    _slots: dict[torch.device, tuple[torch.Tensor, int]] = field(default_factory=dict)
    #: what receivers landed in the destinations themselves, digesting it as they did
    #: (`transports.base.WireLanding`): proved by one re-read after apply, no digest here
    landings: list[Any] = field(default_factory=list)
    #: received name -> (the address it landed at, bytes landed), over every landing
    _wired: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: destination -> the received name a landing proves it by
    _wired_dest: dict[str, str] = field(default_factory=dict)
    #: the launched re-reads (`reread`): per landing window, which buckets differ
    _rereads: list[tuple[torch.Tensor, list[Any]]] | None = None
    #: runs digested here as they arrived (not proved by a receiver's landing)
    digested: int = 0
    #: received name -> its pieces the receive loop checked: (first byte, bytes,
    #: algorithm, the sender's digest)
    _arrived: dict[str, list[tuple[int, int, str, int]]] = field(default_factory=dict)
    #: destination -> bytes of it whose received digests `add` took from `_arrived`
    arrived_dests: dict[str, int] = field(default_factory=dict)

    def arrived(self, name: str, start: int, nbytes: int, algo: str, digest: int) -> None:
        """Bytes [start, start + nbytes) of tensor `name` arrived in a bucket of their own
        and the receive loop checked them against the sender's `digest` (`Target.
        arrived_piece`), before the tensor is fed: where its pieces tile it, `add`
        takes their digests for a host copy of all of it in the same algorithm instead
        of reading the bytes again (the transport read them for its check)."""
        self._arrived.setdefault(name, []).append((start, nbytes, algo, digest))

    def _pieces(self, name: str | None, algo: str, received: torch.Tensor
                ) -> list[tuple[int, int, int]] | None:
        """(first element, end element, digest) of each piece of `received` the receive
        loop checked (`arrived`), in order, where they tile it exactly in elements and
        in `algo`; else None."""
        got = self._arrived.get(name) if name is not None else None
        if not got:
            return None
        es, at, out = received.element_size(), 0, []
        for start, nbytes, a, dig in sorted(got):
            if a != algo or start != at or start % es or nbytes % es:
                return None
            out.append((start // es, (start + nbytes) // es, dig))
            at = start + nbytes
        return out if at == received.nbytes else None

    def only_landed(self) -> bool:
        """Whether a receiver's landing proves every run, whole destination by whole
        destination, and nothing is unproved (what a `Settled` verdict can stand for)."""
        return (not self.digested and not self.unproved and bool(self.runs)
                and all(len(r) == 1 and r[0][2] == _WIRE for r in self.runs.values()))

    def landed_dests(self) -> set[str]:
        """Destinations a receiver's landing proves (`wire`)."""
        return set(self._wired_dest)

    def wire(self, landing: Any) -> None:
        """A receiver's `WireLanding`, before it yields the tensors it names."""
        self.landings.append(landing)
        if not self._wired:  # the first (in a push of one doorbell, the only) landing
            self._wired.update(landing.names)
            return
        for name, (addr, nbytes) in landing.names.items():
            a, b = self._wired.get(name, (addr, 0))
            self._wired[name] = (addr if a == addr else -1, b + nbytes)

    def _device_term(self, b: torch.Tensor) -> torch.Tensor | None:
        """The `sum64` term of received bytes `b` (without the length term, which both
        sides of a comparison share) as a 0-dim device tensor, added by one kernel into
        a slot of a vector this check holds (`checksums.sum64_into`), with no host sync;
        None off CUDA. A digest read back per tensor costs ~0.2 ms on a GPU (a sync
        each), and `sum64_tensor`'s launches and temporaries ~0.09 ms: most of a push of a
        few GB. The terms are compared in one batch by `check`."""
        from enginehooks.core.checksums import sum64_into

        if b.device.type != "cuda":
            return None
        vec, k = self._slots.get(b.device, (None, _SLOTS))
        if vec is None or k == _SLOTS:  # a new vector (the old one's slots stay referenced)
            vec, k = torch.zeros(_SLOTS, dtype=torch.int64, device=b.device), 0
        self._slots[b.device] = (vec, k + 1)
        sum64_into(b, vec, k)
        return vec[k]

    @staticmethod
    def provable(steps: Sequence[Any], received: torch.Tensor,
                 dtypes: Mapping[str, torch.dtype]) -> bool:
        """Whether every write of a planned tensor is a plain contiguous copy of the same
        dtype (what `check` can prove)."""
        if not received.is_contiguous():
            return False
        for dest, d, s, pre in _step_runs(steps):
            if s is None or pre or d is None or dtypes.get(dest) != received.dtype:
                return False
        return True

    def add(self, steps: Sequence[Any], received: torch.Tensor,
            dtypes: Mapping[str, torch.dtype], name: str | None = None) -> None:
        """The steps (`copy_plan.Step`) of one planned tensor and the tensor received
        (before or as it was written: the digest is of what arrived). `name`: the
        received name, where a receiver may have landed it itself (`wire`)."""
        contiguous = received.is_contiguous()
        numel, nbytes = received.numel(), received.nbytes
        wired = self._wired.get(name) if name is not None else None
        if wired is not None and (not contiguous or wired[0] != received.data_ptr()
                                  or wired[1] != nbytes):
            wired = None  # not (all) where the receiver landed it: digested here
        flat: torch.Tensor | None = None  # made only for a run digested here
        for dest, d, s, pre in _step_runs(steps):
            if (not contiguous or d is None or s is None or pre
                    or dtypes.get(dest) != received.dtype):
                self.unproved.add(dest)
                continue
            if wired is not None and name is not None and s == (0, numel):
                # the receiver landed all of it in this destination (if the address
                # `check` finds there is not the landing's, the destination is bad)
                self.runs.setdefault(dest, []).append((d[0], d[1], _WIRE, wired[0]))
                self._wired_dest[dest] = name
                self.received_bytes += nbytes
                continue
            whole = s == (0, numel)
            if (whole and name in self._arrived and received.device.type == "cpu"
                    and received.layout == torch.strided):
                # checked piece by piece as it arrived: not read again (nor viewed: a
                # few microseconds of torch calls per tensor, hundreds of tensors)
                pieces = self._pieces(name, HOST_DIGEST, received)
                if pieces is not None:
                    self.digested += 1
                    self.received_bytes += nbytes
                    self.runs.setdefault(dest, []).extend(
                        (d[0] + p0, d[0] + p1, HOST_DIGEST, dig) for p0, p1, dig in pieces)
                    self.arrived_dests[dest] = self.arrived_dests.get(dest, 0) + nbytes
                    continue
            if whole:
                b = _bits(received)
            else:
                if flat is None:
                    flat = received.detach().reshape(-1)
                b = _bits(flat[s[0]:s[1]])
            if b is None:
                self.unproved.add(dest)
                continue
            algo = digest_algorithm(b)
            self.digested += 1
            self.received_bytes += b.numel()
            term = self._device_term(b) if algo == DIGEST else None
            if term is not None:
                self.runs.setdefault(dest, []).append((d[0], d[1], algo, term))
                continue
            self.runs.setdefault(dest, []).append((d[0], d[1], algo, _digest(algo, b)))

    def check(self, live: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """(destinations proved to hold the bytes sent, those whose bytes differ).

        Runs whose received digest was left on the device (`_device_term`: no host
        sync per tensor as they arrived) are read back in one batch here: one launch
        over every destination run, one comparison, one sync for the whole update."""
        good: list[str] = []
        bad: list[str] = []
        batched: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (dest, live run, want)
        hosted: list[tuple[str, str, torch.Tensor, Any]] = []  # (dest, algo, live run, want)
        by_host: list[str] = []  # destinations judged by their host digests alone
        wired: list[str] = []  # destinations proved by a receiver's landing
        for dest, runs in self.runs.items():
            t = live.get(dest)
            if dest in self.unproved or t is None or not t.is_contiguous():
                continue
            if len(runs) == 1 and runs[0][2] == _WIRE:  # the common case, without views
                start, end, _, want = runs[0]
                if (start, end) != (0, t.numel()):
                    continue  # written in part: what else is there is the loader's
                # bad: no longer where the receiver landed it
                (wired if t.data_ptr() == want else bad).append(dest)
                continue
            flat = t.detach().reshape(-1)
            at, covered = 0, True
            for start, end, _, _ in sorted(runs, key=lambda r: (r[0], r[1])):
                covered = covered and start == at
                at = end
            if not covered or at != flat.numel():
                continue  # written in part: what else is there is the loader's
            same, later = True, False
            for start, end, algo, want in runs:
                if algo == _WIRE:
                    # the whole destination, at the address the receiver landed it in
                    if (start, end) == (0, flat.numel()) and flat.data_ptr() == want:
                        wired.append(dest)
                        later = True
                    else:
                        same = False
                    continue
                b = _bits(flat[start:end])
                if isinstance(want, torch.Tensor):
                    if b is None or b.device != want.device:
                        same = False
                    else:
                        batched.append((dest, b, want))
                        later = True
                    continue
                if b is None:
                    same = False
                else:
                    hosted.append((dest, algo, b, want))
            if not same:
                bad.append(dest)
            elif not later:
                by_host.append(dest)
        # the host digests, spread over the cores where they are many bytes; a
        # destination with one wrong run is bad whatever its other runs hold
        wrong_here = {dest for (dest, _, _, want), got in zip(
            hosted, _host_digests([(a, b) for _, a, b, _ in hosted]), strict=True)
            if got != want}
        bad.extend(dest for dest in dict.fromkeys(d for d, _, _, _ in hosted)
                   if dest in wrong_here and dest not in bad)
        good.extend(dest for dest in by_host if dest not in wrong_here)
        if batched:
            differs = _device_terms_differ([b for _, b, _ in batched], [w for _, _, w in batched])
            wrong = {dest for (dest, _, _), d in zip(batched, differs, strict=True) if d}
            for dest in dict.fromkeys(dest for dest, _, _ in batched):
                if dest not in bad:
                    (bad if dest in wrong else good).append(dest)
        if wired:
            changed = self._landed_changed()
            for dest in wired:
                if dest not in bad:
                    (bad if self._wired_dest[dest] in changed else good).append(dest)
        return good, bad

    def reread(self) -> None:
        """Launch the re-read of every landed destination (`_landed_changed`) without
        waiting for it: called first thing after apply, so the device reads while the
        host walks the model for the rest of the verification."""
        if self._rereads is not None or not self.landings:
            return
        groups: dict[int, tuple[torch.Tensor, list[Any]]] = {}
        for ld in self.landings:
            groups.setdefault(ld.sums.data_ptr(), (ld.sums, []))[1].append(ld)
        self._rereads = []
        for sums, lds in groups.values():
            replay = _reread_table(sums, lds)
            # what differs, still on the device: one read of it in `_landed_changed`
            with torch.cuda.device(sums.device):
                self._rereads.append((replay.differs(sums), lds))

    def _landed_changed(self) -> set[str]:
        """Received names in a bucket whose landed destinations, re-read now with the
        landing's own weights, no longer sum to what the receiver read as it landed
        them: one launch per landing window (`reread`) and one sync."""
        self.reread()
        rereads, self._rereads = self._rereads or [], None  # a later check reads anew
        changed: set[str] = set()
        for differs, lds in rereads:
            # one copy to the host (a bucket a flag): no kernel to find the few that differ
            for k, d in enumerate(differs.tolist()):
                if d:
                    for ld in lds:
                        changed.update(ld.by_bucket.get(k, ()))
        return changed


def _reread_table(sums: torch.Tensor, lds: list[Any]) -> Any:
    """The replayable re-read (`fused_copy.Replay`) of landings `lds` (one landing
    window's `sums`). In a training loop the landings repeat push after push: the device
    table of the last one is launched again where its rows are the same. A receiver
    hands the same arrays again where nothing changed (`cuda_ipc._landing`): the same
    objects (held by `_RECHECKS`, so never another array at a reused id) are the same
    rows without comparing them; other arrays are compared row by row."""
    import numpy as np

    from enginehooks.core import fused_copy

    hit = _RECHECKS.get(sums.device)
    if hit is not None and hit[1].out.shape != sums.shape:
        hit = None  # another number of buckets: a table of its own
    own = tuple(getattr(ld, f) for ld in lds for f in _LANDING_COLUMNS)
    if hit is not None and len(own) == len(hit[2]) and all(map(operator.is_, own, hit[2])):
        return hit[1]
    arrays = tuple(np.concatenate([getattr(ld, f) for ld in lds]) for f in _LANDING_COLUMNS)
    if hit is not None and all(a.shape == b.shape and np.array_equal(a, b)
                               for a, b in zip(hit[0], arrays, strict=True)):
        replay = hit[1]
    else:  # a table of its own (not a ring slot: it is kept)
        dst, nb, word, bk = arrays
        with torch.cuda.device(sums.device):
            replay = fused_copy.Replay(fused_copy.build(dst, dst, nb, word, bk, sums.device),
                                       len(sums), sums.device)
    _RECHECKS[sums.device] = (arrays, replay, own)
    return replay


#: `_step_runs`' memo: id(steps) -> (the steps, their runs); a plan's routes live as long
#: as the plan, so a training loop asks for the same lists push after push
_STEP_RUNS: dict[int, tuple[Any, tuple[tuple[str, Any, Any, bool], ...]]] = {}


def _step_runs(steps: Sequence[Any]) -> tuple[tuple[str, Any, Any, bool], ...]:
    """(destination, its run, the source's run, whether the loader cloned first) for
    each step of a planned tensor that writes an element (`copy_plan.Step`; a run is
    `View.flat_range`, None where the view is no one contiguous run). What `provable`
    and `add` read of every planned tensor of every update, derived once per route."""
    hit = _STEP_RUNS.get(id(steps))
    if hit is not None and hit[0] is steps:
        return hit[1]
    runs = tuple((st.dest, st.view.flat_range(),
                  st.src.flat_range() if st.src is not None else None, bool(st.pre))
                 for st in steps if st.view.numel() != 0)
    if len(_STEP_RUNS) >= 1 << 16:  # plans replaced many times over: start again
        _STEP_RUNS.clear()
    _STEP_RUNS[id(steps)] = (steps, runs)
    return runs


#: host digests of at least this many bytes in one `check` are spread over threads
_SPREAD_BYTES = 64 << 20


_POOL: list[ThreadPoolExecutor] = []  # (made once, where there are cores to spare)


def _digest_pool() -> ThreadPoolExecutor | None:
    """The threads host digests are computed on (xxhash releases the GIL): one per core
    up to 8, made on first use; None on one core."""
    cores = min(os.cpu_count() or 1, 8)
    if cores < 2:
        return None
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(cores, thread_name_prefix="enginehooks-digest"))
    return _POOL[0]


def _host_digests(items: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
    """The digests of host runs `items` ((algorithm, bytes)), in order: on several
    threads where there are cores and bytes enough (xxhash releases the GIL: 1 GB in
    two halves on two threads took 61-73 ms against 125-131 ms on one, 2-core Intel
    host), the largest runs first so one big run does not end last; else one after the
    other."""
    pool = _digest_pool() if len(items) > 1 else None
    if pool is None or sum(b.numel() for _, b in items) < _SPREAD_BYTES:
        return [_digest(a, b) for a, b in items]
    order = sorted(range(len(items)), key=lambda i: -items[i][1].numel())
    out = [0] * len(items)
    for i, d in zip(order, pool.map(lambda i: _digest(*items[i]), order), strict=True):
        out[i] = d
    return out


def digest_algorithm(b: torch.Tensor) -> str:
    """sum64 where the bytes are on an accelerator (computed there, no copy to the host);
    xxh3 on the host (a few GB/s, where sum64's torch path is slow)."""
    return DIGEST if b.device.type != "cpu" else HOST_DIGEST


def _digest(algo: str, b: torch.Tensor) -> int:
    from enginehooks.core.checksums import digest

    return digest(algo, b)


#: digest terms per device vector of a `DigestCheck` (a vector per 1024 received runs)
_SLOTS = 1024
#: a run a receiver's landing proves (`DigestCheck.wire`): its "digest" is the address
_WIRE = "landed"
#: per device, the last re-read's rows, its replayable launch, and the landings' own
#: arrays it was made from (`DigestCheck.reread`)
_RECHECKS: dict[torch.device, tuple[tuple[Any, ...], Any, tuple[Any, ...]]] = {}
#: a `WireLanding`'s pieces, as the re-read's table takes them
_LANDING_COLUMNS = ("dst", "nbytes", "word", "bucket")


def _launch_terms(runs: list[torch.Tensor], out: torch.Tensor) -> None:
    """Add each run's `sum64` term (from word 0) into `out[i]`: one launch of the fused
    kernel (digest only; the same definition as `sum64_tensor`), its table staged through
    the thread's reused pinned ring."""
    import numpy as np

    from enginehooks.core import fused_copy

    ptr = np.array([b.data_ptr() for b in runs], dtype=np.int64)
    n = np.array([b.numel() for b in runs], dtype=np.int64)
    zero = np.zeros(len(runs), dtype=np.int64)
    fused_copy.launch(fused_copy.build(ptr, ptr, n, zero, np.arange(len(runs), dtype=np.int64),
                                       out.device, fused_copy.stager_for(out.device)),
                      out, copy=False)


def _device_terms_differ(runs: list[torch.Tensor], wants: list[torch.Tensor]) -> list[bool]:
    """Per run (flat uint8 device tensors), whether its `sum64` term now differs from
    `wants` (from `_device_term`): one launch for every run where the fused kernel runs,
    one sync."""
    from enginehooks.core import fused_copy
    from enginehooks.core.checksums import sum64_tensor

    device = wants[0].device
    if fused_copy.available(device):
        runs = [b if b.data_ptr() % 4 == 0 else b.clone() for b in runs]  # its alignment
        now = torch.zeros(len(runs), dtype=torch.int64, device=device)
        _launch_terms(runs, now)
    else:  # no Triton: a launch per run, still one sync
        now = torch.stack([sum64_tensor(b) for b in runs])
    return [bool(x) for x in (now != torch.stack(wants)).tolist()]


def digest_only_modules(model: torch.nn.Module, landed: Collection[str],
                        proved: Collection[str], suspect: Collection[str],
                        prepared: Prepared | None = None) -> set[str]:
    """Touched modules every readable tensor of which is a destination `proved` by its
    digest (or that hold none), and no opaque storage (`opaque_captures`): nothing the
    loader or post-load processing computed lives there, so the shadow need not look
    at them. `suspect` modules (once repaired)
    always go to the shadow."""
    proved = set(proved)
    out: set[str] = set()
    walk = prepared if prepared is not None else Prepared.of(model, landed)
    modules = walk.modules
    for mname in walk.touched:
        if mname not in suspect and _only_proved(mname, modules[mname], proved):
            out.add(mname)
    return out


def _only_proved(mname: str, module: torch.nn.Module, proved: Collection[str]) -> bool:
    """Whether every key of `readable_tensors(module)` is in `proved` (under `mname`)
    and `opaque_captures(module)` is empty: the same reading of the module's dicts,
    stopping at the first key that is not (a closure's tensor never is), without
    building either table (this runs for every touched module of every update)."""
    dot = f"{mname}." if mname else ""
    for own in (module._parameters, module._buffers):
        for k, t in own.items():
            if t is not None and dot + k not in proved:
                return False
    for name, value in vars(module).items():
        if name in _MODULE_STATE:
            continue
        if isinstance(value, torch.Tensor):
            if dot + name not in proved:
                return False
        elif callable(value) and not isinstance(value, torch.nn.Module):
            for cname, _ in _closure_tensors(value):
                if f"{dot}{name}<{cname}>" not in proved:
                    return False  # a captured tensor (`readable_tensors`' key for it)
            if not name.startswith("_"):
                code = getattr(value, "__code__", None)
                cells = getattr(value, "__closure__", None) or ()
                for cell in cells[:len(code.co_freevars) if code is not None else 0]:
                    try:
                        v = cell.cell_contents
                    except ValueError:
                        continue
                    if not isinstance(v, _PLAIN) and type(v).__module__ != "builtins":
                        return False  # opaque storage (`opaque_captures`)
    return True


def touched_modules(model: torch.nn.Module, landed: Collection[str],
                    modules: Mapping[str, torch.nn.Module] | None = None) -> set[str]:
    """Names of the modules that own a landed tensor, and their ancestors (a parent may
    hold a buffer or a packed copy derived from a child's parameter). `modules`: the
    model's `named_modules()`, where the caller has them."""
    names = modules.keys() if modules is not None else {n for n, _ in model.named_modules()}
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


def _with_aliases(model: torch.nn.Module, landed: Collection[str],
                  tensors: Mapping[str, torch.Tensor] | None = None) -> set[str]:
    """`landed` plus every other name of the same storage (a tied output head is the
    embedding under a second name). `tensors`: the model's `live_tensors`, where the
    caller has them."""
    by_storage: dict[int, list[str]] = {}
    for name, t in (tensors if tensors is not None else live_tensors(model)).items():
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


def _view_pair(t: torch.Tensor, f: torch.Tensor) -> tuple[Any, ...] | None:
    """What identifies a (live, fresh) pair of views: their storages, offsets, shapes,
    strides and dtype; None where a tensor has no plain storage."""
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()),
                f.untyped_storage().data_ptr(), f.storage_offset(), tuple(f.stride()),
                tuple(t.shape), t.dtype, t.device, f.device)
    except Exception:
        return None


@dataclass
class Prepared:
    """What every compare of one verification shares, computed once (a streamed shadow
    compares unit by unit, and each compare would otherwise walk the whole live model
    again): the landed names with their aliases, the touched modules, the live modules
    by name."""

    landed: set[str]
    touched: set[str]
    modules: dict[str, torch.nn.Module]
    #: every parameter and buffer by every name (`named_live`), read in the same walk
    tensors: dict[str, torch.Tensor]

    @staticmethod
    def of(live: torch.nn.Module, landed: Collection[str]) -> Prepared:
        mods = modules_by_name(live)
        tensors = tensors_by_name(mods)
        aliased = _with_aliases(live, landed, tensors)
        modules = unique_modules(mods)
        return Prepared(aliased, touched_modules(live, aliased, modules), modules, tensors)


def compare(live: torch.nn.Module, fresh: torch.nn.Module, landed: Collection[str],
            verdict: Verdict, skip: Collection[str] = (),
            only: Collection[str] | None = None,
            prepared: Prepared | None = None) -> list[Mismatch]:
    """Every readable tensor of the touched modules of `live` that differs from
    `fresh`. Parameters are compared where this update landed something in them (others
    hold whatever they were initialised with, in both models); buffers, attributes and
    captured tensors of touched modules always (they are derived from the weights).
    Modules in `skip` were proved otherwise (digests); with `only`, modules outside it
    are left for another unit of a streamed shadow. Bits that cannot be read are
    compared through the modules' forwards on a probe input (`probe`), once per module;
    what that cannot compare either is listed in `verdict.unverified`. `prepared`: the
    walks of the live model every compare of one verification shares (`Prepared`)."""
    prepared = prepared if prepared is not None else Prepared.of(live, landed)
    landed = prepared.landed
    touched = prepared.touched - set(skip)
    if only is not None:
        touched &= set(only)
    fresh_modules = dict(fresh.named_modules())
    out: list[Mismatch] = []
    device = next((t.device for _, t in live.named_parameters()), torch.device("cpu"))
    # views of the live model and the shadow already compared equal in this call (a tied
    # output head is the embedding under a second name in both: its bytes are read once;
    # within one call every shadow tensor is alive, so an address names one tensor)
    equal: set[tuple[Any, ...]] = set()
    for mname, module in prepared.modules.items():
        if mname not in touched or mname not in fresh_modules:
            continue
        opaque: list[str] = []
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
            pair = _view_pair(t, f)
            if pair is not None and pair in equal:
                continue  # this very pair of views compared equal under another name
            if t is f:  # the fresh load's own tensor (a product moved into the live model)
                continue
            a, b = _bits(t), _bits(f.to(t.device))
            if a is None or b is None:
                verdict.unreadable.append(full)
                opaque.append(full)
                continue
            verdict.shadow_bytes += a.numel()
            if not torch.equal(a, b):
                out.append(Mismatch(full, kind, "values", t, f))
            elif pair is not None:
                equal.add(pair)
        if opaque:
            tp = time.perf_counter()
            same = probe(module, fresh_modules[mname], device)
            verdict.seconds["probe"] = verdict.seconds.get("probe", 0.0) + time.perf_counter() - tp
            if same is None:
                verdict.unverified.extend(opaque)
            elif same:
                verdict.probed.extend(opaque)
            else:
                out.append(Mismatch(mname or "<model>", "forward", "forward", None, None))
        probed = dict(opaque_captures(module))
        # a callable whose captured tensors are not the fresh one's by name (another
        # kernel's packing, a stale closure): its tensors matched nothing above, so its
        # forward is compared instead
        fresh_captures = _captures(theirs)
        for attr, names in _captures(mine).items():
            if attr not in probed and names != fresh_captures.get(attr):
                probed[attr] = ",".join(sorted(names))
        for attr, captured in probed.items():
            full = f"{mname}.{attr}<{captured}>".lstrip(".")
            verdict.compared += 1
            tp = time.perf_counter()
            same = probe_callable(module, fresh_modules[mname], attr, device)
            verdict.seconds["probe"] = verdict.seconds.get("probe", 0.0) + time.perf_counter() - tp
            if same is None:
                verdict.unverified.append(full)
            elif same:
                verdict.probed.append(full)
            else:
                out.append(Mismatch(full, "opaque", "forward", None, None,
                                    module=module, fresh_module=fresh_modules[mname], attr=attr))
    return out


def _captures(tensors: Mapping[str, tuple[str, torch.Tensor]]) -> dict[str, set[str]]:
    """Attribute -> the names of the tensors its callable captured, from
    `readable_tensors`' keys (`attr<name>`)."""
    out: dict[str, set[str]] = {}
    for key, (kind, _) in tensors.items():
        if kind == "closure":
            attr, _, name = key.partition("<")
            out.setdefault(attr, set()).add(name.rstrip(">"))
    return out


def verify_and_repair(live: torch.nn.Module, build_fresh: Callable[[], torch.nn.Module],
                      landed: Collection[str], *, engine: str,
                      digests: DigestCheck | None = None,
                      suspect: Collection[str] = (),
                      stream_fresh: Callable[[Collection[str]], Iterator[Pass]] | None = None
                      ) -> Verdict:
    """Prove what the digests of planned plain copies can (`DigestCheck`); build the
    fresh-load shadow only when some touched module is left, compare it there, repair
    in place what differs in values, compare again. Raises `WeightsMismatch` naming what
    still differs. `stream_fresh(needed)`, where the engine gives one, streams the
    shadow unit by unit (`engine.shadow`) for the modules `needed`; the whole shadow
    (`build_fresh`) is built where it cannot stream (`Unstreamable`, or
    `ENGINEHOOKS_SHADOW=whole`)."""
    verdict = Verdict()
    skip: set[str] = set()
    t0 = time.perf_counter()
    if digests is not None:
        digests.reread()  # the device re-reads the landings while the host walks
    tw = time.perf_counter()
    # the walk of the live model every step below shares (once per verification)
    prepared = Prepared.of(live, landed)
    touched = prepared.touched
    # where the digest path's time goes (10 us resolution): launching the re-read, the
    # walk, the check (which waits for the re-read), the digest-only test
    verdict.seconds["reread_launch"] = round(tw - t0, 5)
    verdict.seconds["walk"] = round(time.perf_counter() - tw, 5)
    if digests is not None and (digests.runs or digests.unproved):
        tensors = prepared.tensors
        tc = time.perf_counter()
        good, bad = digests.check(tensors)
        verdict.seconds["digest_check"] = round(time.perf_counter() - tc, 5)
        if bad and isinstance(suspect, set):
            suspect.update(d.rpartition(".")[0] for d in bad)
        if bad and digests.uncopied:  # (no shadow can be complete without them)
            raise WeightsMismatch(
                f"after the update, {len(bad)} tensors the copy plan wrote as plain copies do "
                f"not hold the bytes received ({', '.join(bad[:8])}): something after the "
                f"load changed them (the {engine} engine's post-load processing?); no copy "
                "of them was kept (the digests were to prove them), so the engine is torn "
                "until the next update, which compares them on a fresh-load shadow and "
                "repairs them")
        if bad and not isinstance(suspect, set):
            # a plain copy that does not hold the bytes sent, and no suspect set to hold
            # its module out of the digest-only ones: the shadow judges everything
            log.warning("%s: %d planned copies do not hold the bytes received (%s): "
                        "comparing everything with a fresh load", engine, len(bad), bad[:8])
        else:
            if bad:
                # their modules are suspect now (above): the shadow judges (and repairs)
                # them, and every module not proved; a module every tensor of which holds
                # the bytes sent is proved as on any update (vLLM CPU on AMX hosts turns
                # a small linear's bias to float32 after every load: a digest can never
                # hold there, and that must not send the whole model to the shadow)
                log.warning("%s: %d planned copies do not hold the bytes received (%s): "
                            "comparing their modules with a fresh load", engine, len(bad),
                            bad[:8])
            td = time.perf_counter()
            skip = digest_only_modules(live, landed, good, suspect, prepared)
            verdict.seconds["digest_only"] = round(time.perf_counter() - td, 5)
            proved = [d for d in good if d.rpartition(".")[0] in skip]
            verdict.digest = len(proved)
            verdict.digest_bytes = sum(tensors[d].nbytes for d in proved)
            by_landing = digests.landed_dests()
            verdict.landed_bytes = sum(tensors[d].nbytes for d in proved if d in by_landing)
            verdict.arrived_bytes = sum(digests.arrived_dests.get(d, 0) for d in proved)
    t1 = time.perf_counter()
    verdict.seconds["digest"] = round(t1 - t0, 5)
    if touched <= skip:
        verdict.shadow = False
        return verdict
    if digests is not None and digests.uncopied:
        # a shadow built without them would not be this update's fresh load
        raise WeightsMismatch(
            f"after the update, {len(touched - skip)} modules need a fresh-load shadow "
            f"({sorted(touched - skip)[:4]}) where the last update needed none, and no copy "
            f"of {len(digests.uncopied)} planned tensors was kept: the engine is torn "
            "until the next update, which keeps copies and compares them on a shadow")
    device = next((t.device for _, t in live.named_parameters()), torch.device("cpu"))
    built = compared = 0.0
    with torch.no_grad():
        if stream_fresh is not None and shadow_mode() == "streamed":
            before = dataclasses.replace(verdict, seconds=dict(verdict.seconds))
            peak = PeakMemory(device)
            passes = stream_fresh(touched - skip)
            why = ""
            timers: dict[str, float] = {}
            try:
                while True:
                    tb = time.perf_counter()
                    p = next(passes, None)
                    tc = time.perf_counter()
                    built += tc - tb
                    if p is None:
                        break
                    verdict.shadow_units += 1
                    timers = p.timers
                    verdict.shadow_tensor_bytes = max(verdict.shadow_tensor_bytes,
                                                      p.loaded_bytes, held_bytes(p.model))
                    _compare_and_repair(live, p.model, landed, verdict, skip, engine, p.modules,
                                        prepared)
                    compared += time.perf_counter() - tc
                verdict.shadow_kind = "streamed"
                verdict.shadow_peak_bytes = peak.peak()
                # where the shadow's time went, step by step (`shadow.Timers`)
                verdict.seconds.update({f"shadow_{k}": round(v, 4) for k, v in timers.items()})
            except Unstreamable as e:
                log.info("%s: the shadow is built whole: %s", engine, e)
                why = str(e)
            except WeightsMismatch:
                raise
            except Exception as e:
                log.warning("%s: the streamed shadow failed (%s: %s); building it whole",
                            engine, type(e).__name__, e)
                why = f"the streamed shadow failed: {type(e).__name__}: {e}"
            finally:
                passes.close()  # type: ignore[attr-defined]
            if verdict.shadow_kind != "streamed":  # again on a whole shadow, keeping
                # what was repaired already (those modules are suspect from now on)
                before.mismatched, before.repaired = verdict.mismatched, verdict.repaired
                verdict = before
                verdict.shadow_why = why[:300]
        if verdict.shadow_kind != "streamed":
            if stream_fresh is None:
                verdict.shadow_why = ("no streamed shadow offered (the engine gives none, or "
                                      "the copy plan's first check reads the whole "
                                      "loader's result)")
            elif shadow_mode() != "streamed":
                verdict.shadow_why = f"{SHADOW_ENV}=whole"
            peak = PeakMemory(device)
            tb = time.perf_counter()
            fresh = build_fresh()
            tc = time.perf_counter()
            built += tc - tb
            verdict.shadow_kind = "whole"
            verdict.shadow_tensor_bytes = max(held_bytes(fresh), getattr(fresh, LOADED_ATTR, 0))
            verdict.shadow_peak_bytes = peak.peak()
            _compare_and_repair(live, fresh, landed, verdict, skip, engine,
                                prepared=prepared)
            del fresh
            compared += time.perf_counter() - tc
    verdict.seconds["shadow"] = round(built, 4)
    verdict.seconds["compare"] = round(compared, 4)
    if "probe" in verdict.seconds:  # (part of compare)
        verdict.seconds["probe"] = round(verdict.seconds["probe"], 4)
    return verdict


def _compare_and_repair(live: torch.nn.Module, fresh: torch.nn.Module, landed: Collection[str],
                        verdict: Verdict, skip: Collection[str], engine: str,
                        only: Collection[str] | None = None,
                        prepared: Prepared | None = None) -> None:
    """Compare `fresh` (the shadow, or one unit of it) with `live`, repair in place what
    differs, compare again; raise `WeightsMismatch` naming what still differs."""
    first = compare(live, fresh, landed, verdict, skip, only, prepared)
    for m in first:
        if m.why == "values" and m.live is not None and m.fresh is not None:
            m.live.copy_(m.fresh.to(m.live.device))
            verdict.repaired.append(m.name)
        elif m.kind == "opaque" and m.module is not None and m.attr is not None:
            setattr(m.module, m.attr, getattr(m.fresh_module, m.attr))
            verdict.repaired.append(m.name)
    verdict.mismatched.extend(m.name for m in first)
    if not first:
        return
    log.warning("%s: after the update %d tensors differed from a fresh load of the same "
                "weights (%s); repaired in place from the fresh load: %s", engine,
                len(first), ", ".join(f"{m.name} [{m.why}]" for m in first[:8]),
                sum(1 for m in first if m.name in verdict.repaired))
    again = compare(live, fresh, landed, Verdict(), skip, only, prepared)
    if again:
        raise WeightsMismatch(
            f"after the update, {len(again)} tensors the {engine} engine's forward reads "
            f"differ from a fresh load of the same weights and could not be repaired: "
            + ", ".join(f"{m.name} ({m.why})" for m in again[:8])
            + "; the engine is torn and refuses generation until an update succeeds "
            "(report it upstream: the engine's reload path)")


def named_live(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every name (aliases included)."""
    yield from live_tensors(model).items()


@dataclass
class Settled:
    """A digest-only verdict kept for the next update of the same layout.

    In a training loop every update lands the same tensors at the same addresses, and
    the model's structure does not change: the digest-only test (`digest_only_modules`)
    and the check of each destination's address (`DigestCheck.check`) would give the
    same answer push after push, and they are most of what verification costs on a GPU.
    What this keeps is exactly what those answers depend on: the model's `Structure`
    (every module and what it holds, by identity; every tensor's address, shape,
    strides and dtype), the landed names, and every destination's landing address.
    Where all of them are the same, only the bytes can differ: the re-read of the
    landings (`DigestCheck._landed_changed`, the same launch the full path makes) is
    then the whole verification. Anything else (a module an engine replaced or gave a
    new attribute, a tensor moved, a destination landed elsewhere, a run digested
    rather than landed, a re-read that differs) takes the full path.

    The structure holds the model's modules and tensors as they were at the last
    verified update (identity needs the objects alive: an id can be reused); the next
    update replaces it, so what an engine dropped meanwhile is released then."""

    landed: frozenset[str]
    runs: dict[str, list[tuple[int, int, str, int | torch.Tensor]]]
    structure: Structure
    digest: int
    digest_bytes: int
    landed_bytes: int

    @staticmethod
    def of(live: torch.nn.Module, landed: Collection[str], digests: DigestCheck,
           verdict: Verdict) -> Settled | None:
        """What a digest-only `verdict` (no shadow, nothing differed or unverified) on
        `live` can be kept as; None where a re-read alone could not stand for it."""
        if (verdict.shadow or verdict.mismatched or verdict.unverified or verdict.unreadable
                or not digests.only_landed()):
            return None
        structure = Structure.of(live)
        if structure is None:
            return None
        return Settled(frozenset(landed), dict(digests.runs), structure,
                       verdict.digest, verdict.digest_bytes, verdict.landed_bytes)

    def verdict(self, live: torch.nn.Module, landed: Collection[str],
                digests: DigestCheck) -> Verdict | None:
        """This update's verdict where it is the settled one's (the same model, landed
        names, landing addresses and structure, and a re-read that found every landed
        byte as received); None where the full path must judge."""
        t0 = time.perf_counter()
        digests.reread()
        t1 = time.perf_counter()
        if (digests.digested or digests.unproved or digests.runs != self.runs
                or frozenset(landed) != self.landed or not self.structure.matches(live)):
            return None
        t2 = time.perf_counter()
        if digests._landed_changed():
            return None  # the full path names what differs (and re-reads it again)
        t3 = time.perf_counter()
        return Verdict(digest=self.digest, digest_bytes=self.digest_bytes,
                       landed_bytes=self.landed_bytes, shadow=False, settled=True,
                       seconds={"reread_launch": round(t1 - t0, 5),
                                "settled_check": round(t2 - t1, 5),
                                "digest_check": round(t3 - t2, 5),
                                "digest": round(t3 - t0, 5)})


def _settle(live: torch.nn.Module, landed: Collection[str], digests: DigestCheck,
            verdict: Verdict) -> Settled | None:
    """`Settled.of`, or None where the model cannot be read for it (the verdict stands;
    the next update takes the full path)."""
    try:
        return Settled.of(live, landed, digests, verdict)
    except Exception as e:  # a module whose dicts are not torch's: nothing kept
        log.debug("nothing settles for this model: %s: %s", type(e).__name__, e)
        return None


#: what `Verifier.state()["updates"]` counts, per outcome of an update
OUTCOMES = ("verified", "repaired", "unverified", "failed")


class Verifier:
    """When to verify, and what each verification found, for one engine worker.

    Policy (`ENGINEHOOKS_VERIFY`): "always" (the default: every update); "first"
    verifies the first update in the process and, once any verification needed a
    repair, every later one; "never". A shadow that cannot be built (the engine cannot
    construct a second model here) leaves the update unverified, logged and reported by
    `state()`, rather than failing weights that the engine's own reload path applied.
    `state()["updates"]` counts updates by outcome: verified (equal to a fresh load),
    repaired (differed, repaired in place, equal after), unverified (not verified, or
    some tensors could not be compared), failed (torn).
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        try:
            self.policy = verify_policy()
        except ConfigError as e:
            log.error("%s; verifying every update", e)
            self.policy = DEFAULT_POLICY
        self.verified = 0
        self.sticky = False
        self.last: dict[str, Any] | None = None
        self.counts = dict.fromkeys(OUTCOMES, 0)
        #: the last verification needed no shadow (digests proved everything): the next
        #: update keeps no copies of what the digests will prove
        self.digest_only_last = False
        #: modules that once differed from a fresh load: always compared on a shadow
        self.suspect: set[str] = set()
        #: the last digest-only verdict, kept for the next update (`Settled`)
        self.settled: Settled | None = None

    def wanted(self, requested: bool = False) -> bool:
        """Whether this update is verified; `requested`: the trainer asked
        (`WeightSync(verify=True)`), which even policy "never" honours."""
        if requested:
            return True
        if self.policy == "never":
            return False
        return self.policy == "always" or self.verified == 0 or self.sticky

    def skipped(self) -> None:
        """An update the policy did not verify: counted and reported as such."""
        self.counts["unverified"] += 1
        self.digest_only_last = False
        self.last = {"ok": None, "how": "not verified",
                     "error": f"not verified: {VERIFY_ENV}={self.policy}"}

    def run(self, live: torch.nn.Module, build_fresh: Callable[[], torch.nn.Module],
            landed: Collection[str], digests: DigestCheck | None = None,
            stream_fresh: Callable[[Collection[str]], Iterator[Pass]] | None = None
            ) -> Verdict | None:
        settled, self.settled = self.settled, None
        verdict = None
        try:
            if settled is not None and digests is not None and not self.suspect:
                verdict = settled.verdict(live, landed, digests)
                if verdict is not None:
                    self.settled = settled
            if verdict is None:
                verdict = verify_and_repair(live, build_fresh, landed, engine=self.engine,
                                            digests=digests, suspect=self.suspect,
                                            stream_fresh=stream_fresh)
                if digests is not None and not self.suspect:
                    self.settled = _settle(live, landed, digests, verdict)
        except WeightsMismatch as e:
            self.sticky, self.digest_only_last = True, False
            self.counts["failed"] += 1
            self.last = {"ok": False, "error": str(e)}
            raise
        except Exception as e:  # the shadow could not be built: our own limitation
            log.warning("%s: could not verify this update (%s: %s); the weights were applied "
                        "by the engine's own reload path", self.engine, type(e).__name__, e)
            self.counts["unverified"] += 1
            self.digest_only_last = False
            self.last = {"ok": None, "error": f"not verified: {type(e).__name__}: {e}"}
            return None
        self.verified += 1
        self.digest_only_last = not verdict.shadow and not verdict.mismatched
        self.sticky = self.sticky or bool(verdict.mismatched)
        self.suspect.update(m.rpartition(".")[0] for m in verdict.mismatched)
        outcome = ("repaired" if verdict.mismatched else
                   "unverified" if verdict.unverified else "verified")
        self.counts[outcome] += 1
        self.last = {"ok": True, "outcome": outcome, **verdict.to_dict(),
                     "seconds": verdict.seconds}
        return verdict

    def state(self) -> dict[str, Any]:
        return {"policy": self.policy, "verified": self.verified,
                "every_update": self.sticky or self.policy == "always",
                "updates": dict(self.counts), "last": self.last}

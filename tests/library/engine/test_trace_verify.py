"""The byte tracer, the meta skeleton and verify-after-apply, on small torch models.

The engines' loaders are exercised for real by the conformance cells (GPT-OSS's direct
`param.data.copy_`, Mamba2's aliasing conv buffer, Apertus' constructor that reads a
parameter); these tests pin each mechanism down on models written here, whose loaders
do exactly one of those things, so a regression names the mechanism.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.expectations import LoaderExpectations, skeleton_on_meta
from enginehooks.engine.trace import ByteTracer, MetaScalars
from enginehooks.engine.verify import (
    Verifier,
    WeightsMismatch,
    readable_tensors,
    verify_and_repair,
)


class Loaders(nn.Module):
    """A model whose `load_weights` writes each tensor a different way, as engines do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4, 4))     # weight_loader-style narrow + copy_
        self.b = nn.Parameter(torch.zeros(4))        # direct param.data.copy_
        self.c = nn.Parameter(torch.zeros(1))        # fill_(w.item())
        self.d = nn.Parameter(torch.zeros(2, 4))     # param.data = w (assignment)
        self.fused = nn.Parameter(torch.zeros(8, 4))  # two tensors into halves

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "a":
                self.a.data.narrow(0, 0, 4).copy_(w.t())
            elif name == "b":
                self.b.data.copy_(w.to(self.b.dtype))
            elif name == "c":
                self.c.data.fill_(w.item())
            elif name == "d":
                self.d.data = w
            elif name in ("up", "gate"):
                half = 0 if name == "up" else 4
                self.fused.data[half:half + 4].copy_(w * 1.0)
            elif name == "dropped":
                _ = w.clone()  # read, written nowhere


def meta_model() -> Loaders:
    with torch.device("meta"):
        return Loaders()


SPECS = {"a": (4, 4), "b": (4,), "c": (1,), "d": (2, 4), "up": (4, 4), "gate": (4, 4),
         "dropped": (3,)}


def trace(names: Iterable[str], dtype: torch.dtype = torch.float32) -> ByteTracer:
    model = meta_model()
    tracer = ByteTracer(model)
    feed = ((n, torch.empty(SPECS[n], dtype=dtype, device="meta")) for n in names)
    with torch.no_grad(), tracer:
        model.load_weights(tracer.feed(feed))
    tracer.settle(model)
    return tracer


def test_every_way_a_loader_writes_is_seen_and_a_dropped_tensor_lands_nowhere() -> None:
    tr = trace(SPECS)
    assert tr.written["a"].into == {"a": 16}
    assert tr.written["b"].into == {"b": 4}           # direct copy (no weight_loader)
    assert tr.written["c"].into == {"c": 1}           # fill_ from .item() of a meta tensor
    assert tr.written["d"].into == {"d": 8}           # param.data = w
    assert tr.written["up"].into == {"fused": 16}
    assert tr.written["gate"].into == {"fused": 16}
    assert tr.written["dropped"].into == {}


def expectations(checkpoint: dict[str, TensorSpec]) -> LoaderExpectations:
    return LoaderExpectations(meta_model, lambda m, w: m.load_weights(w), checkpoint,
                              engine="toy")


def spec(name: str, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, dtype, SPECS[name])


def test_a_tensor_the_loader_drops_is_refused_naming_it() -> None:
    exp = expectations({n: spec(n) for n in ("a", "b", "c", "d", "up", "gate")})
    full = [spec(n) for n in ("a", "b", "c", "d", "up", "gate")]
    assert exp.problems(full) == []
    problems = exp.problems([*full, spec("dropped")])
    assert len(problems) == 1 and "'dropped'" in problems[0] and "no parameter" in problems[0]


def test_a_direct_copy_counts_toward_whole_layers() -> None:
    # Before the tracer, `b` (a direct copy) landed "nowhere": leaving it out of an
    # update went unnoticed. Now its absence is named.
    exp = expectations({n: spec(n) for n in ("a", "b", "c", "d", "up", "gate")})
    problems = exp.problems([spec(n) for n in ("a", "c", "d", "up", "gate")])
    assert problems and "'b'" in problems[0]


def test_a_floating_cast_the_loader_performs_is_accepted() -> None:
    exp = expectations({n: spec(n) for n in ("a", "b", "c", "d", "up", "gate")})
    # the engine's checkpoint is fp32; an update in bf16 lands through copy_ (a cast)
    assert exp.problems([spec(n, "bfloat16") for n in ("a", "b", "c", "d", "up", "gate")]) == []


class ReadsItsParameter(nn.Module):
    """Like vLLM's xIELU: the constructor reads a parameter's value."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.tensor(0.5))
        self.scalar = float(self.beta.detach().cpu().float().item())


def test_a_constructor_that_reads_a_parameter_builds_on_meta() -> None:
    def build(device: torch.device) -> nn.Module:
        with device:
            return ReadsItsParameter()

    with pytest.raises(NotImplementedError):
        build(torch.device("meta"))  # what the dry run met before MetaScalars
    model = skeleton_on_meta(build, engine="toy")
    assert model.beta.is_meta
    with MetaScalars():
        assert float(torch.empty((), device="meta").item()) == 0.0


class Conv(nn.Module):
    """Like vLLM's MambaMixer2: a non-persistent buffer views a parameter, and a packed
    copy of the weight is captured by a callable (like CPU vLLM's `cpu_linear`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 1, 3))
        self.register_buffer("alias", self.weight.view(4, 3), persistent=False)
        packed = self.weight.detach().flip(0).clone()
        self.forward_fn = lambda x: x @ packed.reshape(4, 3)

    def load(self, w: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(w)


def test_a_stale_alias_and_a_stale_packed_copy_are_found_and_repaired() -> None:
    new = torch.arange(12.0).reshape(4, 1, 3)

    def fresh() -> nn.Module:
        m = Conv()
        m.load(new)
        # the fresh load's post-processing packs the loaded weight
        packed = m.weight.detach().flip(0).clone()
        m.forward_fn = lambda x: x @ packed.reshape(4, 3)
        return m

    live = Conv()
    # what a reload that breaks the alias leaves: the parameter replaced, the buffer
    # and the packed copy on old values
    live.weight = nn.Parameter(new.clone())
    verdict = verify_and_repair(live, fresh, {"weight"}, engine="toy")
    assert set(verdict.mismatched) == {"alias", "forward_fn<packed>"}
    assert set(verdict.repaired) == {"alias", "forward_fn<packed>"}
    assert torch.equal(live.alias, new.view(4, 3))
    packed = dict(readable_tensors(live))["forward_fn<packed>"][1]
    assert torch.equal(packed, new.flip(0))
    # and now it verifies clean
    assert verify_and_repair(live, fresh, {"weight"}, engine="toy").mismatched == []


def test_what_cannot_be_repaired_is_a_mismatch_naming_the_tensor() -> None:
    def fresh() -> nn.Module:
        m = Conv()
        m.register_buffer("alias", torch.ones(2, 6), persistent=False)  # another shape
        return m

    with pytest.raises(WeightsMismatch, match="alias"):
        verify_and_repair(Conv(), fresh, {"weight"}, engine="toy")


def test_parameters_the_update_did_not_land_in_are_not_compared() -> None:
    def fresh() -> nn.Module:
        m = Conv()
        m.weight.data.fill_(7.0)  # differs, but this update landed nothing there
        m.register_buffer("alias", torch.zeros(4, 3), persistent=False)
        return m

    verdict = verify_and_repair(Conv(), fresh, set(), engine="toy")
    assert verdict.compared == 0 and verdict.mismatched == []


def test_the_policy_verifies_the_first_update_and_every_one_after_a_repair(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "first")
    v = Verifier("toy")
    assert v.wanted()
    clean = Conv()
    v.run(clean, Conv, {"weight"})
    assert not v.wanted() and v.state()["verified"] == 1

    live = Conv()
    live.weight = nn.Parameter(torch.ones(4, 1, 3))

    def fresh() -> nn.Module:
        m = Conv()
        m.load(torch.ones(4, 1, 3))
        return m

    v2 = Verifier("toy")
    v2.run(live, fresh, {"weight"})
    assert v2.wanted() and v2.state()["every_update"]

    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "never")
    assert not Verifier("toy").wanted()
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "sometimes")
    assert Verifier("toy").policy == "always"  # a bad value is logged, the default used


def test_a_shadow_that_cannot_be_built_leaves_the_update_unverified_not_failed() -> None:
    def broken() -> Any:
        raise RuntimeError("no memory for a second model")

    v = Verifier("toy")
    assert v.run(Conv(), broken, {"weight"}) is None
    assert v.state()["last"]["ok"] is None and "no memory" in v.state()["last"]["error"]


def test_a_model_the_dry_run_cannot_build_refuses_updates_and_info_still_answers() -> None:
    def unbuildable() -> nn.Module:
        raise RuntimeError("a constructor that needs real data")

    exp = LoaderExpectations(unbuildable, lambda m, w: m.load_weights(w),
                             {"a": spec("a")}, engine="toy")
    assert exp.wire_dtypes() == {}  # `info` answers (no exception reaches the engine)
    problems = exp.problems([spec("a")])
    assert len(problems) == 1 and "cannot build this model" in problems[0]
    assert "keeps serving" in problems[0]


def test_parameters_no_checkpoint_tensor_loads_are_reported_tied_ones_are_not() -> None:
    """`info()["unloaded"]`: a parameter no checkpoint tensor lands in holds what the
    constructor left, in a fresh load too (vLLM's GPT-OSS with a tied checkpoint: its
    untied `lm_head`). A parameter tied to a loaded one is loaded."""

    class Tied(Loaders):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Module()
            self.head.weight = self.a  # tied: the same parameter under another name
            self.orphan = nn.Parameter(torch.zeros(3))

    def meta_tied() -> Tied:
        with torch.device("meta"):
            return Tied()

    names = ("a", "b", "c", "d", "up", "gate")
    exp = LoaderExpectations(meta_tied, lambda m, w: m.load_weights(w),
                             {n: spec(n) for n in names}, engine="toy")
    assert exp.unloaded() == ["orphan"]
    assert expectations({n: spec(n) for n in names}).unloaded() == []
    without_c = LoaderExpectations(meta_model, lambda m, w: m.load_weights(w),
                                   {n: spec(n) for n in names if n != "c"}, engine="toy")
    assert without_c.unloaded() == ["c"]


def test_tensors_the_loader_computes_on_travel_uncast() -> None:
    """A loader that computes on a tensor before it lands (SGLang's Gemma adds 1.0 to its
    norms in place) computes in the dtype it receives; a fresh load receives the
    checkpoint's. Such tensors are announced `uncast` (the trainer sends its own dtype)
    and get no wire dtype; pure copies (views plus one copy_) are cast on the trainer,
    which rounds as the copy would. Found by the generated SGLang Gemma bf16 cell: the
    push differed from a fresh load in the last bits of a logprob."""
    names = ("a", "b", "c", "d", "up", "gate")
    exp = expectations({n: spec(n) for n in names})
    assert exp.uncast() == ["c", "d", "gate", "up"]   # fill_(item), .data =, w * 1.0
    assert exp.wire_dtypes() == {"a": "float32", "b": "float32"}  # narrow/t + copy_, copy_


def test_an_uncast_exception_keeps_the_trainers_dtype() -> None:
    from enginehooks.trainer_side.choose import adapter_for

    a = adapter_for(nn.Linear(2, 2), dtype=torch.bfloat16,
                    dtypes={"weight": None, "bias": torch.float16})
    assert a.wire_dtype(torch.float32, "weight") == torch.float32
    assert a.wire_dtype(torch.float32, "bias") == torch.float16
    assert a.wire_dtype(torch.float32, "other") == torch.bfloat16
    assert a.wire_dtype(torch.int64, "weight") == torch.int64

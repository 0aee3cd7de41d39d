"""A loader that removes parameters from the model it loads into (`engine/transplant.py`).

SGLang's MiniCPM3 derives `w_kc` / `w_vc` from each layer's `kv_b_proj` and deletes it;
its reload then fails with `KeyError` after writing part of the update. The real engine
case is the generated conformance cell `gen:MiniCPM3ForCausalLM` on SGLang (pinned in
tests/engines/conformance/test_conformance.py). Here a small torch model with the same loader
pattern pins the pieces: the dry run sees the removal (never by model name), an update
that needs a fresh load is whole, and the copy into the live model writes nothing
unless every tensor matches.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import TensorSpec
from enginehooks.engine.expectations import LoaderExpectations
from enginehooks.engine.transplant import removed_parameters, state_tensors, transplant


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kv_b_proj = nn.Linear(4, 6, bias=False)
        self.o_proj = nn.Linear(6, 4, bias=False)


class Removing(nn.Module):
    """Loads like SGLang's MiniCPM3: by parameter name, then derives `w_kc` from
    `kv_b_proj` and deletes it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention(), Attention()])
        self.register_buffer("scale", torch.ones(2))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)  # KeyError once kv_b_proj is gone
        for layer in self.layers:
            layer.w_kc = layer.kv_b_proj.weight.t().contiguous()
            del layer.kv_b_proj


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in Removing().named_parameters()}


def loaded(seed: int) -> Removing:
    m = Removing()
    with torch.no_grad():
        m.load_weights(checkpoint(seed).items())
    return m


def specs(ws: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, "float32", tuple(t.shape)) for n, t in ws.items()]


def expectations(live: Removing) -> LoaderExpectations:
    return LoaderExpectations(lambda: Removing().to("meta"), lambda m, w: m.load_weights(w),
                              {s.name: s for s in specs(checkpoint(0))}, engine="toy",
                              live=lambda: live)


def test_the_loader_cannot_run_again_on_the_live_model() -> None:
    """The engine bug this routes around: the second load raises after writing part."""
    live = loaded(0)
    with pytest.raises(KeyError, match="kv_b_proj"):
        live.load_weights(checkpoint(1).items())


def test_state_tensors_are_parameters_buffers_and_tensor_attributes() -> None:
    names = set(state_tensors(loaded(0)))
    assert names == {"scale", "layers.0.o_proj.weight", "layers.1.o_proj.weight",
                     "layers.0.w_kc", "layers.1.w_kc"}


def test_the_dry_run_sees_the_removal_from_the_skeleton_as_built() -> None:
    live = loaded(0)
    exp = expectations(live)
    ws = checkpoint(1)
    removed = ["layers.0.kv_b_proj.weight", "layers.1.kv_b_proj.weight"]
    assert exp.fresh_load_needed(specs(ws)) == removed
    # the dry run removed them from the skeleton too; the skeleton as built still counts
    assert exp.fresh_load_needed(specs(ws)) == removed
    assert removed_parameters(live, exp._built) == set(removed)
    assert exp.problems(specs(ws)) == []  # whole: applied by a fresh load
    # a partial update that does not touch them runs through the loader in place
    assert exp.fresh_load_needed(specs({"layers.0.o_proj.weight": ws["layers.0.o_proj.weight"]})) == []
    no_live = LoaderExpectations(lambda: Removing().to("meta"), lambda m, w: m.load_weights(w),
                                 exp.checkpoint, engine="toy")
    assert no_live.fresh_load_needed(specs(ws)) == []


def test_a_later_dry_run_gets_the_skeleton_whole_again() -> None:
    """The dry run of the checkpoint removed kv_b_proj from the skeleton too; a dry run
    of other wire dtypes (an fp32 checkpoint, a bf16 push) must not then find it gone
    (the generated SGLang MiniCPM3 bf16 cell was refused with the loader's KeyError)."""
    exp = expectations(loaded(0))
    ws = checkpoint(1)
    assert exp.problems(specs(ws)) == []
    bf16 = [TensorSpec(n, "bfloat16", tuple(t.shape)) for n, t in ws.items()]
    assert exp.problems(bf16) == []
    assert exp.fresh_load_needed(bf16) == ["layers.0.kv_b_proj.weight",
                                           "layers.1.kv_b_proj.weight"]


def test_an_update_that_needs_a_fresh_load_is_whole() -> None:
    """A fresh load needs every tensor: the dry run already refuses an update that
    leaves any parameter on old values, so a partial one never reaches the fresh load."""
    exp = expectations(loaded(0))
    ws = checkpoint(1)
    part = {"layers.0.kv_b_proj.weight": ws["layers.0.kv_b_proj.weight"]}
    problems = exp.problems(specs(part))
    assert len(problems) == 1 and "missing from the update" in problems[0], problems


def test_transplant_writes_the_fresh_load_into_the_live_storage() -> None:
    live, fresh = loaded(0), loaded(1)
    before = {n: t.untyped_storage().data_ptr() for n, t in state_tensors(live).items()}
    nbytes = transplant(fresh, live)
    after = state_tensors(live)
    assert {n: t.untyped_storage().data_ptr() for n, t in after.items()} == before
    assert all(torch.equal(after[n], t) for n, t in state_tensors(fresh).items())
    assert torch.equal(live.layers[1].w_kc, checkpoint(1)["layers.1.kv_b_proj.weight"].t())
    assert nbytes == sum(t.nbytes for t in after.values())


@pytest.mark.parametrize("break_it", ["shape", "dtype", "missing", "extra"])
def test_transplant_writes_nothing_unless_every_tensor_matches(break_it: str) -> None:
    live, fresh = loaded(0), loaded(1)
    if break_it == "shape":
        fresh.layers[1].w_kc = torch.zeros(5, 5)
    elif break_it == "dtype":
        fresh.layers[1].w_kc = fresh.layers[1].w_kc.double()
    elif break_it == "missing":
        del fresh.layers[1].w_kc
    else:
        fresh.layers[1].w_extra = torch.zeros(1)
    was = {n: t.clone() for n, t in state_tensors(live).items()}
    with pytest.raises(ManifestError, match="nothing was written"):
        transplant(fresh, live)
    assert all(torch.equal(state_tensors(live)[n], t) for n, t in was.items())

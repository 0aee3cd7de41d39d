"""`engine/shard_direct.py` (issue 40): an engine rank's needs, learned from its copy plan
(tensor-parallel rows and columns, fused parts, its own experts and none of the others'),
and its landing of the transfers the static schedule sends it, against a fresh load, on a
tensor-parallel module replica (`enginehooks_testkit/tp_module.py`). The bytes are handed
over in process here; tests/multihost/test_shard_direct.py sends them over gloo."""

from __future__ import annotations

import pytest
import torch

from enginehooks.core.dtypes import dtype_name
from enginehooks.core.errors import ConfigError, ManifestError
from enginehooks.core.manifest import TensorSpec
from enginehooks.core.schedule import Slice, Transfer, dim0_shards, link_bytes, schedule
from enginehooks.engine.copy_plan import named_tensors, record_plan
from enginehooks.engine.shard_direct import ShardLanding, needs_of
from enginehooks_testkit import tp_module as tp

WORLD = 2


def _state() -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in tp.TinyFull(seed=3).state_dict().items()}


def _specs(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in state.items()]


def _plan(rank: int, specs: list[TensorSpec]):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        skeleton = tp.TinyTP(rank, WORLD)
    return record_plan(skeleton, specs, tp.load_weights)


def _holds(state: dict[str, torch.Tensor], senders: int) -> dict[int, list[Slice]]:
    out: dict[int, list[Slice]] = {r: [] for r in range(senders)}
    for n, t in state.items():
        for r, s in dim0_shards(n, tuple(t.shape), t.element_size(), senders).items():
            out[r].append(s)
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_needs_are_each_ranks_slices_and_the_loader_tensors_whole() -> None:
    state = _state()
    specs = _specs(state)
    sizes = {s.name: s.nbytes for s in specs}
    for rank in range(WORLD):
        plan = _plan(rank, specs)
        assert "computes" in (plan.routes["layers.0.scale"].reason or "")
        needs = needs_of(plan, specs)
        by = {}
        for s in needs:
            by.setdefault(s.name, []).append(s)
        half = sizes["layers.0.q_proj.weight"] // 2
        assert by["layers.0.q_proj.weight"] == [Slice("layers.0.q_proj.weight",
                                                      rank * half, (rank + 1) * half)]
        # row parallel: the rank's columns, one run per row (16 of 32 floats)
        o = by["layers.0.o_proj.weight"]
        assert len(o) == tp.Dims().hidden and all(s.stop - s.start == 64 for s in o)
        assert o[0].start == rank * 64
        assert by["layers.0.scale"] == [Slice("layers.0.scale", 0, sizes["layers.0.scale"])]
        assert by["layers.1.norm"] == [Slice("layers.1.norm", 0, sizes["layers.1.norm"])]
        # expert parallel: its own two experts whole, none of the other rank's
        mine = {f"layers.0.experts.{j}.weight" for j in (2 * rank, 2 * rank + 1)}
        assert {n for n in by if ".experts." in n and n.startswith("layers.0.")} == mine
        assert all(by[n] == [Slice(n, 0, sizes[n])] for n in mine)
    # together the two ranks need each byte of the sharded tensors once: the model's
    # bytes plus the replicated norms and scales a second time
    needs = {r: needs_of(_plan(r, specs), specs) for r in range(WORLD)}
    replicated = sum(sizes[n] for n in sizes if n.endswith(("norm", "scale")))
    assert any(".experts." in n for n in sizes)
    total = sum(s.stop - s.start for ns in needs.values() for s in ns)
    assert total == sum(sizes.values()) + replicated


def _land(state: dict[str, torch.Tensor], senders: int, rank: int,
          transfers: list[Transfer]) -> tuple[tp.TinyTP, dict[str, str], int]:
    specs = _specs(state)
    plan = _plan(rank, specs)
    model = tp.TinyTP(rank, WORLD)
    landing = ShardLanding(plan, specs, transfers, rank, dict(named_tensors(model)),
                           lambda items: tp.load_weights(model, items))
    for t in transfers:
        if t.dst == rank:
            landing.dest(t).copy_(_raw(state[t.name])[t.start:t.stop])
    return model, landing.finish(), landing.received_direct


@pytest.mark.parametrize("senders", [1, 2, 3])
def test_landing_the_schedule_equals_a_fresh_load(senders: int) -> None:
    state = _state()
    specs = _specs(state)
    needs = {r: needs_of(_plan(r, specs), specs) for r in range(WORLD)}
    transfers = schedule(_holds(state, senders), needs)
    _egress, ingress = link_bytes(transfers)
    assert sum(ingress.values()) == sum(s.stop - s.start for ns in needs.values() for s in ns)
    for rank in range(WORLD):
        model, how, direct = _land(state, senders, rank, transfers)
        oracle = tp.fresh(rank, WORLD, state)
        for (n, a), (_, b) in zip(model.named_parameters(), oracle.named_parameters()):
            assert torch.equal(a, b), n
        assert how["layers.0.q_proj.weight"] == "direct"   # rows straight into qkv
        assert how["layers.0.o_proj.weight"] == "replayed"  # columns: assembled, replayed
        assert how["layers.0.scale"] == "loader"
        assert how[f"layers.0.experts.{2 * rank}.weight"] == "direct"
        assert f"layers.0.experts.{2 - 2 * rank}.weight" not in how  # the other rank's
        assert direct > 0


def test_a_needed_byte_left_unsent_is_refused_before_anything_lands() -> None:
    state = _state()
    specs = _specs(state)
    needs = {r: needs_of(_plan(r, specs), specs) for r in range(WORLD)}
    transfers = schedule(_holds(state, 2), needs)
    drop = next(t for t in transfers if t.dst == 1 and t.name == "layers.1.o_proj.weight")
    short = [t for t in transfers if t != drop]
    assert len(short) < len(transfers)
    with pytest.raises(ManifestError, match=r"layers\.1\.o_proj\.weight.*engine rank 1"):
        _land(state, 2, 1, short)


def test_a_destination_not_in_the_recorded_layout_is_refused_before_anything_lands() -> None:
    state = _state()
    specs = _specs(state)
    plan = _plan(0, specs)
    needs = {r: needs_of(_plan(r, specs), specs) for r in range(WORLD)}
    transfers = schedule(_holds(state, 1), needs)
    model = tp.TinyTP(0, WORLD)
    tensors = dict(named_tensors(model))
    tensors["layers.0.o"] = tensors["layers.0.o"].t()  # another layout than recorded
    with pytest.raises(ConfigError, match=r"layers\.0\.o: not in the recorded layout"):
        ShardLanding(plan, specs, transfers, 0, tensors, lambda items: None)
    del tensors["layers.0.o"]
    with pytest.raises(ConfigError, match=r"layers\.0\.o: not in the recorded layout"):
        ShardLanding(plan, specs, transfers, 0, tensors, lambda items: None)


def test_a_tensor_the_loader_copies_into_two_places_lands_in_both() -> None:
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(4))
            self.b = torch.nn.Parameter(torch.zeros(4))

    def load(m: torch.nn.Module, weights) -> None:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            for _, w in weights:
                m.a.copy_(w)
                m.b.copy_(w)

    specs = [TensorSpec("w", "float32", (4,))]
    with torch.device("meta"):
        plan = record_plan(Two(), specs, load)
    model = Two()
    w = torch.arange(4.0)
    landing = ShardLanding(plan, specs, [Transfer(0, 0, "w", 0, 16)], 0,
                           dict(named_tensors(model)), lambda items: None)
    landing.dest(Transfer(0, 0, "w", 0, 16)).copy_(_raw(w))
    assert landing.finish() == {"w": "replayed"}
    assert torch.equal(model.a, w) and torch.equal(model.b, w)

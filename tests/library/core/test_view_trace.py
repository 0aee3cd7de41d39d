"""`core/view_trace.py`: which outputs of a conversion are views of its inputs, followed
through the copies (`contiguous()`) that made them. Generated chains of views and
copies are traced on meta tensors and the answer is checked against the same chain run
on real data, element for element; arithmetic and in-place writes are never taken for
a view. Then transformers' own conversion of a MoE through `CheckpointFormat`: every
per-expert tensor is a view of the fused module tensor, the stream equals what
`save_pretrained` writes push after push, and a traced view that does not match the
conversion is refused the first time it is used."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks.core.view_trace import ViewBatch, ViewOf, trace_views

Op = Callable[[torch.Tensor], torch.Tensor]


def _random_chain(rng: random.Random, arithmetic: bool) -> list[tuple[str, Op]]:
    """A chain of view and copy ops that keeps a tensor of rank 1-4 non-empty."""
    chain: list[tuple[str, Op]] = []
    for _ in range(rng.randint(1, 7)):
        kind = rng.choice(["transpose", "chunk", "select", "narrow", "copy", "copy",
                           "unsqueeze", "squeeze", "permute", "flatten"]
                          + (["mul", "add_"] if arithmetic else []))
        a, b, k = rng.random(), rng.random(), rng.randint(0, 3)

        def op(t: torch.Tensor, kind: str = kind, a: float = a, b: float = b,
               k: int = k) -> torch.Tensor:
            d = t.dim()
            if kind == "transpose" and d >= 2:
                return t.transpose(int(a * d), int(b * d))
            if kind == "chunk" and d >= 1:
                dim = int(a * d)
                parts = t.chunk(2 + k % 2, dim=dim)
                return parts[int(b * len(parts))]
            if kind == "select" and d >= 2:
                dim = int(a * d)
                return t.select(dim, int(b * t.shape[dim]))
            if kind == "narrow" and d >= 1:
                dim = int(a * d)
                n = t.shape[dim]
                start = int(b * n)
                return t.narrow(dim, start, max(1, (n - start) // 2))
            if kind == "copy":
                return t.contiguous() if k % 2 else t.clone()
            if kind == "unsqueeze" and d <= 3:
                return t.unsqueeze(int(a * (d + 1)))
            if kind == "squeeze":
                return t.squeeze()
            if kind == "permute" and d >= 2:
                order = list(range(d))
                random.Random(k).shuffle(order)
                return t.permute(order)
            if kind == "flatten" and d >= 2 and t.is_contiguous():
                return t.flatten(0, 1)
            if kind == "mul":
                return t * 2
            if kind == "add_":
                return t.clone().add_(1)
            return t

        chain.append((kind, op))
    return chain


def _run(chain: list[tuple[str, Op]], t: torch.Tensor) -> torch.Tensor:
    for _, op in chain:
        t = op(t)
    return t


@pytest.mark.parametrize("arithmetic", [False, True])
def test_generated_chains_are_traced_exactly(arithmetic: bool) -> None:
    rng = random.Random(1234 + arithmetic)
    resolved = refused = 0
    for case in range(400):
        chain = _random_chain(rng, arithmetic)
        shape = tuple(rng.randint(2, 6) for _ in range(rng.randint(2, 4)))
        found = trace_views(lambda d, chain=chain: {"out": _run(chain, d["x"])},  # type: ignore[misc]
                            {"x": torch.empty(shape, device="meta")})
        x = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        want = _run(chain, x)
        view = found["out"]
        kinds = [k for k, _ in chain]
        if view is None:
            refused += 1
            continue
        resolved += 1
        assert not {"mul", "add_"} & set(kinds), (case, kinds, view)
        got = view.of(x)
        assert got.shape == want.shape and torch.equal(got, want), (case, kinds, view)
    # the test is not vacuous: most chains of views and copies resolve
    assert resolved > (100 if arithmetic else 300), (resolved, refused)


def test_a_view_of_a_copy_that_carries_across_dimensions_is_not_a_view() -> None:
    """A copy of a transposed tensor, flattened and cut across rows: one strided view
    of the source cannot say it (no ViewOf), and the answer is None, not a wrong view."""
    def conv(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat = d["x"].t().contiguous().reshape(-1)
        return {"across": flat[3:9], "inside": flat[0:4]}

    found = trace_views(conv, {"x": torch.empty(4, 6, device="meta")})
    x = torch.arange(24.0).reshape(4, 6)
    assert found["across"] is None
    inside = found["inside"]
    assert isinstance(inside, ViewOf) and torch.equal(inside.of(x), conv({"x": x})["inside"])


# -- transformers' conversion of a MoE, through CheckpointFormat ---------------------------
def _moe(tmp: Path) -> Any:
    from tests.library.core.test_checkpoint_format import model_of

    return model_of("qwen3_moe", tmp)


def _planned_moe(tmp: Path) -> tuple[Any, dict[str, torch.Tensor], Any, Any, Any]:
    """(model, what `save_pretrained` writes, its adapter, planned: format, layout)."""
    from enginehooks.trainer_side import ModuleAdapter
    from tests.library.core.test_checkpoint_format import saved

    model = _moe(tmp)
    want = saved(model, tmp)
    adapter = ModuleAdapter(model)
    adapter.specs()
    fmt, layout = adapter._format, adapter._layout
    assert fmt is not None and layout is not None
    return model, want, adapter, fmt, layout


def test_moe_experts_are_views_of_the_fused_tensor_push_after_push(tmp_path: Path) -> None:
    from enginehooks.trainer_side import ModuleAdapter

    model, want, adapter, fmt, layout = _planned_moe(tmp_path)
    viewed = [g for g in layout.groups if g.views is not None]
    assert viewed, "no group of a MoE was traced to views"
    state = model.state_dict()
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    for push in range(3):
        streamed = dict(adapter.stream())
        assert sorted(streamed) == sorted(want)
        for name, t in streamed.items():
            assert torch.equal(t, want[name]), (push, name)
        experts = [t for n, t in streamed.items() if ".experts." in n]
        assert experts and all(t.untyped_storage().data_ptr() in storages for t in experts)
    assert all(fmt._proved.get(id(g)) is g for g in viewed)
    # a new plan for the same model (another adapter, the full path) trusts the proof
    # made for it: transformers' conversion runs only for groups without views
    again = ModuleAdapter(model)
    again.specs()
    assert again._format is not fmt and again._layout is not None
    calls: list[int] = []
    inner = again._format._revert  # type: ignore[union-attr]

    def spy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(len(state))
        return inner(state)

    again._format._revert = spy  # type: ignore[method-assign,union-attr]
    streamed = dict(again.stream())
    assert all(torch.equal(t, want[n]) for n, t in streamed.items())
    assert any(g.views is not None for g in again._layout.groups)
    others = [g for g in again._layout.groups if g.views is None and not g.identity]
    assert len(calls) == len(others), (len(calls), len(others))


def test_a_traced_view_that_differs_from_the_conversion_is_refused(tmp_path: Path) -> None:
    """Protective line: the first use of a group's traced views compares them with the
    conversion's real output (`CheckpointFormat.convert`). With two experts' views
    swapped, the stream must still equal `save_pretrained`'s bytes and the group is
    refused (converted by transformers on every push)."""
    import dataclasses

    _model, want, adapter, fmt, layout = _planned_moe(tmp_path)
    i, g = next((i, g) for i, g in enumerate(layout.groups) if g.views is not None)
    views = list(g.views or ())
    a = next(k for k, o in enumerate(g.outputs) if o.name.endswith("experts.0.gate_proj.weight"))
    b = next(k for k, o in enumerate(g.outputs) if o.name.endswith("experts.1.gate_proj.weight"))
    views[a], views[b] = views[b], views[a]
    wrong = dataclasses.replace(g, views=tuple(views))
    groups = list(layout.groups)
    groups[i] = wrong
    adapter._layout = dataclasses.replace(layout, groups=tuple(groups))
    for _ in range(2):
        streamed = dict(adapter.stream())
        for name, t in streamed.items():
            assert torch.equal(t, want[name]), name
    assert fmt._refused.get(id(wrong)) is wrong and id(wrong) not in fmt._proved


@pytest.mark.parametrize("seed", range(4))
def test_view_batches_are_the_same_views_as_one_by_one(seed: int) -> None:
    """`ViewBatch` makes evenly stepped views of one source as one strided tensor cut
    by `unbind`: generated groups (families with even and uneven steps, several sources,
    shuffled order) give views of the same storage, offset, sizes and strides as
    `ViewOf.of`, in the group's order."""
    rng = random.Random(seed)
    src = {"a": torch.arange(4096, dtype=torch.float32),
           "b": torch.arange(1982, dtype=torch.float32)[7:].reshape(25, 79)}
    views: list[ViewOf] = []
    for name in src:
        for _ in range(rng.randint(1, 3)):
            sizes = (rng.randint(1, 6), rng.randint(1, 8))
            strides = (sizes[1] + rng.randint(0, 3), 1)
            step, first = rng.randint(1, 60), rng.randint(0, 20)
            even = rng.random() < 0.7
            for k in range(rng.randint(1, 9)):
                off = first + k * step + (0 if even else rng.randint(0, 5))
                views.append(ViewOf(name, off, sizes, strides))
    rng.shuffle(views)
    batch = ViewBatch(tuple(views))
    assert batch.runs, "no family stepped evenly"
    for v, got in zip(views, batch.of(src), strict=True):
        want = v.of(src[v.source])
        assert got.untyped_storage().data_ptr() == want.untyped_storage().data_ptr()
        assert (got.storage_offset(), got.shape, got.stride()) == (
            want.storage_offset(), want.shape, want.stride())
        assert torch.equal(got, want)

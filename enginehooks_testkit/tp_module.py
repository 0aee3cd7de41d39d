"""A tensor-parallel module replica for shard-direct tests (issue 40): one engine rank of
TP=`world`, with a loader written the way vLLM's parallel layers load a checkpoint, so the
copy plan learns real tensor-parallel slices from it (nothing in the library knows this
model): fused q/k/v and gate/up parameters filled from three and two checkpoint tensors,
each narrowed on dim 0 to the rank's rows; o/down projections narrowed on dim 1 (row
parallel: one run per row); a vocabulary-parallel embedding and head; replicated norms;
experts stacked per rank (expert parallel: a rank's loader skips the other ranks' experts,
so it needs none of their bytes); and `scale`, which the loader computes with (`w * 2`),
so the plan leaves it on the loader.

`TinyFull` is the same model in checkpoint layout (the trainer's module: its state dict
is the checkpoint), seeded so every process builds the same weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Dims:
    """The model's sizes (the defaults: 78 KB in fp32, for tests; benchmarks scale them)."""

    vocab: int = 64
    hidden: int = 32
    inter: int = 48
    layers: int = 2
    experts: int = 4


class _FullLayer(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        h = d.hidden
        for name, (o, i) in {"q_proj": (h, h), "k_proj": (h // 2, h), "v_proj": (h // 2, h),
                             "o_proj": (h, h), "gate_proj": (d.inter, h),
                             "up_proj": (d.inter, h), "down_proj": (h, d.inter)}.items():
            setattr(self, name, nn.Linear(i, o, bias=False))
        self.norm = nn.Parameter(torch.randn(h))
        self.scale = nn.Parameter(torch.randn(h))
        self.experts = nn.ModuleList(nn.Linear(h, h // 2, bias=False) for _ in range(d.experts))


class TinyFull(nn.Module):
    """The checkpoint-layout model (see the module docstring)."""

    def __init__(self, seed: int = 0, dims: Dims = Dims()) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(dims.vocab, dims.hidden)
        self.layers = nn.ModuleList(_FullLayer(dims) for _ in range(dims.layers))
        self.lm_head = nn.Linear(dims.hidden, dims.vocab, bias=False)


class _TPLayer(nn.Module):
    def __init__(self, world: int, d: Dims) -> None:
        super().__init__()
        h = d.hidden
        q, kv = h // world, h // 2 // world
        self.qkv = nn.Parameter(torch.zeros(q + 2 * kv, h))
        self.o = nn.Parameter(torch.zeros(h, h // world))
        self.gate_up = nn.Parameter(torch.zeros(2 * d.inter // world, h))
        self.down = nn.Parameter(torch.zeros(h, d.inter // world))
        self.norm = nn.Parameter(torch.zeros(h))
        self.scale = nn.Parameter(torch.zeros(h))
        self.experts = nn.Parameter(torch.zeros(d.experts // world, h // 2, h))


class TinyTP(nn.Module):
    """Engine rank `rank` of TP=`world` (see the module docstring)."""

    def __init__(self, rank: int, world: int, dims: Dims = Dims()) -> None:
        super().__init__()
        self.rank, self.world, self.dims = rank, world, dims
        self.embed = nn.Parameter(torch.zeros(dims.vocab // world, dims.hidden))
        self.layers = nn.ModuleList(_TPLayer(world, dims) for _ in range(dims.layers))
        self.lm_head = nn.Parameter(torch.zeros(dims.vocab // world, dims.hidden))


def _rows(param: torch.Tensor, at: int, w: torch.Tensor, rank: int, world: int) -> None:
    n = w.shape[0] // world
    param.data.narrow(0, at, n).copy_(w.narrow(0, rank * n, n))


def load_weights(model: TinyTP, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The engine's loader: checkpoint tensors into this rank's parameters."""
    r, world, d = model.rank, model.world, model.dims
    q, kv, inter = d.hidden // world, d.hidden // 2 // world, d.inter // world
    with torch.no_grad():
        for name, w in weights:
            if name == "embed.weight":
                _rows(model.embed, 0, w, r, world)
                continue
            if name == "lm_head.weight":
                _rows(model.lm_head, 0, w, r, world)
                continue
            _, i, rest = name.split(".", 2)
            layer = model.layers[int(i)]
            assert isinstance(layer, _TPLayer)
            part = rest.split(".")[0]
            if part in ("q_proj", "k_proj", "v_proj"):
                _rows(layer.qkv, {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[part], w, r, world)
            elif part in ("gate_proj", "up_proj"):
                _rows(layer.gate_up, 0 if part == "gate_proj" else inter, w, r, world)
            elif part in ("o_proj", "down_proj"):
                dest = layer.o if part == "o_proj" else layer.down
                n = w.shape[1] // world
                dest.data.copy_(w.narrow(1, r * n, n))
            elif part == "norm":
                layer.norm.data.copy_(w)
            elif part == "scale":
                layer.scale.data.copy_(w * 2)
            elif part == "experts":
                # expert parallel: this rank loads only its own experts, stacked
                j, local = int(rest.split(".")[1]), d.experts // world
                if j // local == r:
                    layer.experts.data[j % local].copy_(w)
            else:
                raise KeyError(name)


def fresh(rank: int, world: int, state: dict[str, torch.Tensor], dims: Dims = Dims()
          ) -> TinyTP:
    """A fresh load of `state` into engine rank `rank`: the oracle."""
    m = TinyTP(rank, world, dims)
    load_weights(m, state.items())
    return m

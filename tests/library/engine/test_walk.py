"""`engine/walk.py` returns exactly what torch's own walks return (names, order, objects),
on models with the shapes that make those walks subtle: a module reachable by two names,
a tied parameter, a `None` buffer and parameter, a buffer-only module, a real
transformers model."""

from __future__ import annotations

import pytest
import torch

from enginehooks.engine.walk import live_tensors, modules_by_name, unique_modules


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = self.a  # the same module under a second name
        self.c = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4, bias=False))
        self.c[1].weight = self.a.weight  # a tied parameter
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("absent", None)
        self.register_parameter("unset", None)
        self.stats = torch.nn.Module()
        self.stats.register_buffer("count", torch.zeros(1), persistent=False)


def _tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("build", [Shared, _tiny_llama], ids=["shared", "llama-tied"])
def test_same_as_torch(build) -> None:
    model = build()
    mods = modules_by_name(model)
    assert [(n, id(m)) for n, m in mods] == \
        [(n, id(m)) for n, m in model.named_modules(remove_duplicate=False)]
    assert [(n, id(m)) for n, m in unique_modules(mods).items()] == \
        [(n, id(m)) for n, m in model.named_modules()]
    want = [*model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False)]
    assert [(n, id(t)) for n, t in live_tensors(model).items()] == [(n, id(t)) for n, t in want]


def test_sees_a_swapped_parameter() -> None:
    """Nothing is cached: a parameter an engine replaced after the last walk is seen."""
    model = Shared()
    before = live_tensors(model)["c.0.weight"]
    model.c[0].weight = torch.nn.Parameter(torch.zeros(4))
    after = live_tensors(model)["c.0.weight"]
    assert after is model.c[0].weight and after is not before

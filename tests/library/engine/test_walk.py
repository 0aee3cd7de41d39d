"""`engine/walk.py` returns exactly what torch's own walks return (names, order, objects),
on models with the shapes that make those walks subtle: a module reachable by two names,
a tied parameter, a `None` buffer and parameter, a buffer-only module, a real
transformers model."""

from __future__ import annotations

import pytest
import torch

from enginehooks.engine.walk import Structure, live_tensors, modules_by_name, unique_modules


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


# -- Structure: what a settled verdict stands for (`verify.Settled`) ------------------------
def _changes() -> list[tuple[str, object]]:
    """(what an engine step might do after a load, the step) on a `Shared` model."""

    def attr(m: Shared) -> None:
        m.c[0].packed = m.c[0].weight.detach().clone()  # a derived tensor, kept aside

    def rebind(m: Shared) -> None:
        m.a.weight = torch.nn.Parameter(m.a.weight.detach().clone())

    def swap_data(m: Shared) -> None:
        m.c[0].weight.data = m.c[0].weight.detach().clone()  # same Parameter object

    def transpose(m: Shared) -> None:
        w = m.c[1].weight  # 4x4: the same address and shape, other strides
        w.data = w.data.t()

    def reinterpret(m: Shared) -> None:
        m.scale.data = m.scale.data.view(torch.int32)  # the same bytes, another dtype

    def replace_child(m: Shared) -> None:
        m.c[0] = torch.nn.LayerNorm(4)

    def add_buffer(m: Shared) -> None:
        m.stats.register_buffer("total", torch.zeros(1))

    def plain_value(m: Shared) -> None:
        m.c[0].eps = 1e-3

    return [("attr", attr), ("rebind", rebind), ("swap_data", swap_data),
            ("transpose", transpose), ("reinterpret", reinterpret),
            ("replace_child", replace_child), ("add_buffer", add_buffer),
            ("plain_value", plain_value)]


def test_a_structure_is_the_same_only_while_nothing_it_holds_changed() -> None:
    """Two walks of an unchanged model are the same structure; each change an engine's
    post-load step could make (a new attribute, a rebound or re-pointed parameter, a
    transposed or reinterpreted view at the same address, a replaced child, a new
    buffer, a changed plain value) makes it another. A held plain callable (a closure
    may capture a tensor) leaves no structure at all."""
    torch.manual_seed(0)
    for what, change in _changes():
        m = Shared()
        before = Structure.of(m)
        assert before is not None and before.matches(m), what
        change(m)  # type: ignore[operator]
        assert not before.matches(m), what
        after = Structure.of(m)
        assert after is not None and after.matches(m), what
    m = Shared()
    assert not Structure.of(m).matches(Shared())  # type: ignore[union-attr]
    m.c[1].hook = lambda x: x * m.a.weight  # type: ignore[assignment]
    assert Structure.of(m) is None


def test_a_child_moved_to_the_next_module_in_the_walk_is_a_change() -> None:
    """`Structure.matches` compares what the modules hold as one flat sequence: a child
    that one module lost at the end of its part, and the next module in the walk gained
    at the start of its own, leaves the same sequence but for the lengths of the dicts
    it is read from."""
    root = torch.nn.Module()
    root.x = torch.nn.Linear(2, 2)
    root.y = torch.nn.Linear(2, 2)
    before = Structure.of(root)
    assert before is not None and before.matches(root)
    y = root._modules.pop("y")  # root's last child, the end of root's part
    held = dict(root.x.__dict__)  # x follows root in the walk: y becomes its first value
    root.x.__dict__.clear()
    root.x.__dict__["moved"] = y
    root.x.__dict__.update(held)
    assert not before.matches(root)


def test_a_module_given_another_dict_or_losing_torch_s_own_is_a_change() -> None:
    """`Structure.matches` reads the modules' dicts as they are now: a module given
    another `__dict__` (even holding the same values), or whose parameters dict was
    removed or replaced by something that is no dict, is not the structure it was, and
    the check says so rather than failing."""
    for what in ("new_dict", "no_params", "not_a_dict"):
        root = torch.nn.Module()
        root.x = torch.nn.Linear(2, 2)
        before = Structure.of(root)
        assert before is not None and before.matches(root), what
        if what == "new_dict":
            root.x.__dict__ = dict(root.x.__dict__)
        elif what == "no_params":
            del root.x.__dict__["_parameters"]
        else:
            root.x.__dict__["_parameters"] = list(root.x.__dict__["_parameters"].values())
        assert not before.matches(root), what

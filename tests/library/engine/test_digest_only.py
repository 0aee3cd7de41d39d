"""`verify._only_proved` (what `digest_only_modules` asks of every touched module on every
update) answers as its definition does: every key of `readable_tensors` proved and no
`opaque_captures`. Each case below is a way a module can hold something the loader or
post-load processing computed, which digests of what was received cannot prove."""

from __future__ import annotations

import pytest
import torch

from enginehooks.engine.verify import _only_proved, opaque_captures, readable_tensors


class Handler:
    """An engine's own object holding packed weights (opaque storage)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.packed = w.t().contiguous()


def _linear() -> torch.nn.Linear:
    return torch.nn.Linear(4, 4)


def _with_attr() -> torch.nn.Module:
    m = _linear()
    m.derived = m.weight.detach() * 2  # a tensor attribute computed after load
    return m


def _with_closure_tensor(private: bool) -> torch.nn.Module:
    m = _linear()
    w = m.weight.detach().clone()

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return x @ w

    setattr(m, "_fwd" if private else "fwd", fwd)
    return m


def _with_opaque(private: bool) -> torch.nn.Module:
    m = _linear()
    handler = Handler(m.weight.detach())

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return x @ handler.packed

    setattr(m, "_fwd" if private else "fwd", fwd)
    return m


def _with_plain_callable() -> torch.nn.Module:
    m = _linear()
    act = torch.nn.functional.silu

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return act(x)

    m.fwd = fwd
    return m


def _with_buffer() -> torch.nn.Module:
    m = _linear()
    m.register_buffer("cache", torch.zeros(2))
    return m


CASES = {
    "plain": _linear, "attr": _with_attr,
    "closure-tensor": lambda: _with_closure_tensor(False),
    "private-closure-tensor": lambda: _with_closure_tensor(True),
    "opaque": lambda: _with_opaque(False), "private-opaque": lambda: _with_opaque(True),
    "plain-callable": _with_plain_callable, "buffer": _with_buffer,
}


def _definition(mname: str, m: torch.nn.Module, proved: set[str]) -> bool:
    keys = readable_tensors(m)
    return (all(f"{mname}.{k}".lstrip(".") in proved for k in keys)
            and not opaque_captures(m))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mname", ["", "layers.0.proj"])
def test_same_answer_as_the_definition(case: str, mname: str) -> None:
    m = CASES[case]()
    dot = f"{mname}." if mname else ""
    params = {dot + k for k, _ in m.named_parameters(recurse=False)}
    own = params | {dot + k for k, _ in m.named_buffers(recurse=False)}
    every = own | {dot + k for k in readable_tensors(m)}
    for proved in (set(), params, own, every, {dot + "weight"}):
        assert _only_proved(mname, m, proved) == _definition(mname, m, proved), (case, proved)
    # what each case is there for: once everything it registered is proved, a module is
    # left to digests unless it holds a tensor attribute, a captured tensor, or a public
    # callable that captured an engine's own object (`opaque_captures` reads public names)
    assert _only_proved(mname, m, own) == (
        case in ("plain", "plain-callable", "buffer", "private-opaque"))

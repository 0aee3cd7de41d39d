"""Tests that kill the mutants `make mutants` left open in engine/trace.py (docs/testing.md):
which arguments of an op the tracer reads as written (`_destinations`: a custom op's
optional mutable argument left out), and what it taints (`_mark_derived`: never a model
tensor's own storage, so a loader that reads a parameter it already wrote does not count
the first tensor twice or land it where it never went)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from enginehooks.engine.trace import ByteTracer

# An op as engines register them (vLLM's and SGLang's custom kernels): it writes `dst`
# and, when given, `stats`; a call that leaves `stats` out passes only two arguments to
# the dispatcher (trailing defaults are dropped).
_LIB = torch.library.Library("enginehooks_mutants_trace", "DEF")
_LIB.define("copy_into_(Tensor(a!) dst, Tensor src, Tensor(b!)? stats=None) -> ()")


def _copy_into(dst: torch.Tensor, src: torch.Tensor, stats: torch.Tensor | None = None) -> None:
    dst.copy_(src)
    if stats is not None:
        stats.fill_(1)


_LIB.impl("copy_into_", _copy_into, "CompositeExplicitAutograd")
copy_into = torch.ops.enginehooks_mutants_trace.copy_into_


class Kernels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(3))
        self.stats = nn.Parameter(torch.zeros(1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "a":
                copy_into(self.a.data, w)                    # stats left out
            else:
                copy_into(self.b.data, w, self.stats.data)   # stats given


def traced(model: nn.Module, ws: dict[str, torch.Tensor]) -> ByteTracer:
    tracer = ByteTracer(model)
    with torch.no_grad(), tracer:
        model.load_weights(tracer.feed(ws.items()))  # type: ignore[operator]
    tracer.settle(model)
    return tracer


def test_a_custom_op_with_an_optional_mutable_argument_left_out_is_traced() -> None:
    tracer = traced(Kernels(), {"a": torch.randn(3), "b": torch.randn(3)})
    assert {n: w.into for n, w in tracer.written.items()} == {
        "a": {"a": 3}, "b": {"b": 3, "stats": 1}}


class Derived(nn.Module):
    """A parameter computed from itself after the copy (vLLM's `composed_weight_loader`,
    Mamba2's A from A_log), and one computed from a parameter another tensor wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.zeros(4))
        self.p = nn.Parameter(torch.zeros(4))
        self.q = nn.Parameter(torch.zeros(4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "A_log":
                self.A.data.copy_(w)
                self.A.data.copy_(-torch.exp(self.A.data))
            elif name == "p":
                self.p.data.copy_(w)
            else:
                self.q.data.copy_(self.p.data + w)


def test_a_parameter_read_after_it_was_written_carries_no_taint() -> None:
    ws = {"A_log": torch.randn(4), "p": torch.randn(4), "q": torch.randn(4)}
    tracer = traced(Derived(), ws)
    assert {n: w.into for n, w in tracer.written.items()} == {
        "A_log": {"A": 4}, "p": {"p": 4}, "q": {"q": 4}}


class Reassigned(nn.Module):
    """Loaders that assign `param.data = w` (freeing the parameter's old storage) and then
    copy a computed temporary into another parameter, 32 times over."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"d{i}", nn.Parameter(torch.zeros(4)))
            self.register_parameter(f"e{i}", nn.Parameter(torch.zeros(4)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name[0] == "d":
                getattr(self, name).data = w
            else:
                getattr(self, name).data.copy_(w * 1.0)


def test_a_freed_parameter_storage_is_never_taken_for_a_temporary() -> None:
    # Found by a flaky run of test_verify_mutants's tracer test: the tracer knew model
    # tensors by storage address, and after `param.data = w` the freed address was reused
    # by the next temporary, which then counted as that parameter (never tainted: the
    # tensor copied from it landed nowhere). The tracer now keeps the storages alive.
    n = 32
    with torch.device("meta"):
        model = Reassigned(n)
    ws = {f"{k}{i}": torch.empty(4, device="meta") for i in range(n) for k in "de"}
    tracer = traced(model, ws)
    assert {name: w.into for name, w in tracer.written.items()} == {
        name: {name: 4} for name in ws}

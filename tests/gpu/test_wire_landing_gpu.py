"""Verification of bytes a receiver landed itself (`core/landing.py` `WireLanding`,
issue 38): where a receiver copies pieces straight into the engine's tensors in a pass
that also digests them (a packed NCCL bucket's fused landing, `cuda_ipc`'s single copy),
verification proves those tensors by one re-read after apply instead of a digest of each
received tensor as it streams. The re-read must still name a destination whose bytes
changed after landing (the engine's post-processing), and one that is no longer where
the bytes landed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from enginehooks.core.errors import EngineHooksError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = torch.device("cuda", 0)


def _fused_or_skip() -> None:
    from enginehooks.core import fused_copy

    if not fused_copy.available(DEV):
        pytest.skip("the fused kernel does not run here (no Triton)")


@pytest.mark.parametrize("how", ["fused", "split"])
def test_a_landed_bucket_is_proved_by_one_reread_and_a_changed_byte_is_named(how: str) -> None:
    """The receiver half of `nccl` (`Unpacker.land`, as `receive_in_order` calls it) with
    a target that wants landings. The target is a stand-in for `ApplyTarget`'s two
    methods (its plumbing is run end to end by the cuda_ipc test below and by
    `benchmarks/bench_verify.py` on the device); the Unpacker and `DigestCheck` are real.
    `fused`: small pieces, landed by the fused copy-and-digest launch; `split`: buckets
    of a few large pieces, where that launch is the slower way, landed by a copy per
    piece and a digest pass that sums the landed pieces apart.
    Protective lines: `DigestCheck._landed_changed` (without it the flipped byte is
    proved) and the address check in `DigestCheck.check` (without it the moved
    destination is proved by the landing's bytes elsewhere)."""
    from enginehooks.core.buckets import (
        Unpacker,
        buffer_bytes,
        fused_landing_pays,
        pack,
        read_trailer,
    )
    from enginehooks.core.manifest import TensorSpec, plan
    from enginehooks.engine.copy_plan import Step, View
    from enginehooks.engine.verify import DigestCheck

    _fused_or_skip()
    g = torch.Generator().manual_seed(5)
    if how == "fused":
        sent = {"a": torch.randn(256, 128, generator=g).to(torch.bfloat16),
                "b": torch.randn(64, 33, generator=g),
                "odd": torch.randn(7, 3, generator=g).to(torch.bfloat16),  # 42 bytes: not landed
                "big": torch.randn(1024, 700, generator=g).to(torch.bfloat16),  # split: not landed
                "c": torch.randn(300, 211, generator=g)}
        bucket = 1 << 19
    else:  # pieces of 24-28 MiB, two to a 64 MiB bucket
        sent = {"a": torch.randn(7168, 2048, generator=g).to(torch.bfloat16),
                "b": torch.randn(3584, 2048, generator=g),
                "odd": torch.randn(7, 3, generator=g).to(torch.bfloat16),
                "big": torch.randn(24576, 2048, generator=g).to(torch.bfloat16),  # split
                "c": torch.randn(3072, 2048, generator=g)}
        bucket = 64 << 20
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
             for n, t in sent.items()]
    m = plan(specs, weight_version=1, bucket_bytes=bucket, checksum="sum64")
    pays = [fused_landing_pays(sum(1 for e in m.tensors for p in e.pieces if p.bucket == k),
                               b.nbytes) for k, b in enumerate(m.buckets) if not b.direct]
    assert pays and all(pays) == (how == "fused") and any(pays) == (how == "fused"), pays
    dests = {n: torch.zeros_like(t, device=DEV) for n, t in sent.items()}
    dtypes = {n: t.dtype for n, t in sent.items()}
    check = DigestCheck()

    class Witness:
        def landing_wanted(self) -> bool:
            return True

        def wire_landed(self, landing: Any) -> None:
            check.wire(landing)

    size = buffer_bytes(m)
    u = Unpacker(m, DEV, dests.get, target=Witness())
    bufs = pack(m, iter((n, t.to(DEV)) for n, t in sent.items()),
                lambda _i: torch.empty(size, dtype=torch.uint8, device=DEV))
    for i, buf in bufs:
        buf = buf.clone()
        dig = read_trailer(buf)[4]
        u.verify(i, buf, check_digest=False)
        placed = u.land(i, buf, dig)
        for name, t in u.unpack(i, buf, verified=True, placed=placed):
            d = dests[name]
            if t.data_ptr() != d.data_ptr():
                d.copy_(t)
            full = View(0, tuple(t.shape), tuple(t.stride()))
            check.add([Step(name, full, full)], t, dtypes, name)
    u.finish()
    torch.cuda.synchronize()
    for n, t in sent.items():
        assert torch.equal(dests[n].cpu(), t), n
    landed = check.landed_dests()
    assert landed == {"a", "b", "c"}, landed
    assert all(r[2] == "landed" for n in landed for r in check.runs[n])
    good, bad = check.check(dests)
    assert sorted(good) == sorted(sent) and bad == []

    same_bucket = {n for ld in check.landings for names in ld.by_bucket.values()
                   if "a" in names for n in names}
    dests["a"].view(-1).view(torch.uint8)[1001] ^= 1  # after landing, as processing might
    good, bad = check.check(dests)
    assert "a" in bad and set(bad) <= same_bucket, (bad, same_bucket)
    assert {"odd", "big"} <= set(good)
    dests["a"].view(-1).view(torch.uint8)[1001] ^= 1
    good, bad = check.check(dests)
    assert bad == []

    moved = dict(dests, c=dests["c"].clone())  # the engine swapped the tensor object
    good, bad = check.check(moved)
    assert bad == ["c"], bad


# -- cuda_ipc into a real ApplyTarget, in process ---------------------------------------------
class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(256, 256, bias=True, dtype=torch.bfloat16) for _ in range(3))

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)


def _replica() -> tuple[Any, torch.nn.Module, dict[str, bool]]:
    """An in-process module replica behind the real `ApplyTarget` and `EngineSide`, whose
    post-load step (`after_load`) flips one byte of a landed weight when `fault["on"]`:
    the engine processing that changes what it was sent."""
    from enginehooks_testkit.inprocess_replica import inprocess_replica

    fault: dict[str, Any] = {"on": False, "rebind": None}

    def build(dev: torch.device) -> torch.nn.Module:
        with dev:
            return Blocks()

    def after_load(m: torch.nn.Module, landed: set[str]) -> None:
        if fault["on"]:
            with torch.no_grad():
                m.layers[1].weight.view(-1).view(torch.uint8)[77] ^= 4  # type: ignore[index]
        if fault["rebind"] is not None:  # the engine serves another tensor from now on
            m.layers[2].weight = torch.nn.Parameter(fault["rebind"], requires_grad=False)  # type: ignore[index]
            fault["rebind"] = None

    handle, model = inprocess_replica(build, DEV, after_load=after_load)
    return handle, model, fault


class _Pushes:
    """A trainer pushing over `cuda_ipc` into a fresh `_replica()`, new weights each push."""

    def __init__(self) -> None:
        from enginehooks import WeightSync

        self.handle, self.model, self.fault = _replica()
        self.trainer = Blocks().to(DEV)
        self.sync = WeightSync(transport="cuda_ipc", checksum="sum64", bucket_bytes=1 << 18,
                               timeout_s=120, device=DEV)
        self.sync.add_replica(self.handle)

    def last(self) -> dict[str, Any]:
        return self.handle.side.info()["verification"]["last"]  # type: ignore[no-any-return]

    def push(self, v: int) -> None:
        with torch.no_grad():
            for p in self.trainer.parameters():
                p.copy_(torch.randn_like(p))
        self.sync.push(self.trainer, version=v)
        torch.cuda.synchronize()

    def equal(self) -> None:
        for (n, a), b in zip(self.trainer.state_dict().items(),
                             self.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), n

    def close(self) -> None:
        self.sync.close()


def test_cuda_ipc_landings_prove_every_later_push_and_a_changed_byte_ends_it_torn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pushes over `cuda_ipc` (single copy) into a real `ApplyTarget` with verification on
    every update: once the copy plan is verified, the receiver lands every tensor in the
    engine's own and verification proves all of them by the re-read (`landed_bytes` is
    every byte). An engine step that changes a landed byte after the load ends that
    update torn (no host copy was kept for a shadow), never `current`, and the next
    update keeps copies, verifies on a shadow and is `current` again. Protective line:
    `DigestCheck._landed_changed` (without it the changed byte is reported verified)."""
    _fused_or_skip()
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "always")
    run = _Pushes()
    handle, model, fault, push, last, equal = (run.handle, run.model, run.fault, run.push,
                                               run.last, run.equal)
    try:
        for v in range(1, 5):  # record the plan, check it on a shadow, then steady state
            push(v)
            equal()
        total = sum(p.nbytes for p in model.parameters())
        assert last()["how"] == "digest" and last()["landed_bytes"] == total, last()
        # the steady state: the last verdict stands, after a re-read of every landing
        assert last()["settled"] is True, last()
        fault["on"] = True
        with pytest.raises(EngineHooksError, match="do not hold the bytes received"):
            push(5)
        assert handle.side.state == "torn"
        fault["on"] = False
        push(6)
        equal()
        assert handle.side.state == "current" and last()["ok"] is True
    finally:
        run.close()


def test_a_settled_verdict_stands_only_for_the_same_structure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once an update was proved by digests alone, the next one of the same layout is
    judged by a re-read of its landings, provided the model's structure is the same
    (`verify.Settled`). An engine step that, after a later load, makes a layer serve
    another tensor holding older bytes leaves every landing intact (the bytes landed
    where the old tensor was): only the structure says the model changed. That update
    must end torn, never `current`; the next one verifies on the full path and is
    `current` with the trainer's bytes. Protective line: the `Structure` comparison in
    `Settled.verdict` (without it the stale weight is reported verified)."""
    _fused_or_skip()
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "always")
    run = _Pushes()
    handle, model, fault, push, last, equal = (run.handle, run.model, run.fault, run.push,
                                               run.last, run.equal)
    try:
        for v in range(1, 5):
            push(v)
        assert last()["settled"] is True, last()
        stale = model.layers[2].weight.detach().clone()  # type: ignore[index]
        fault["rebind"] = stale
        with pytest.raises(EngineHooksError, match="do not hold the bytes received"):
            push(5)
        assert handle.side.state == "torn"
        assert model.layers[2].weight.data_ptr() == stale.data_ptr()  # type: ignore[index]
        push(6)
        assert handle.side.state == "current" and last()["ok"] is True
        assert last()["settled"] is False, last()  # the full path judged it
        assert "shadow" in last()["how"], last()
        equal()
        # the layer that differed is compared on a shadow from now on (`suspect`):
        # nothing settles while it is
        push(7)
        assert last()["settled"] is False and "shadow" in last()["how"], last()
    finally:
        run.close()


def test_the_last_exchange_waits_beside_the_apply_and_nothing_is_current_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`deliver` awaits the sender's digests and sends the final ack on a thread while the
    target's apply finishes (post-load steps, verification with its device re-read):
    the two waits overlap. Here that exchange is held until the apply has verified: done
    inline, before the apply's tail, it would wait for something that cannot happen
    and the push would fail. Meanwhile the engine says `updating`, never `current`: it
    is `current` only once the digests matched (a mismatch after a verified apply ends
    torn: `test_cuda_ipc_doorbell.py`)."""
    import threading

    from enginehooks.engine.apply import ApplyTarget
    from enginehooks.transports.cuda_ipc import CudaIpcReceiver

    _fused_or_skip()
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "always")
    verified = threading.Event()
    seen: list[tuple[bool, str]] = []
    real_verify, real_final = ApplyTarget._record_and_verify, CudaIpcReceiver._final

    def verify(self: Any, *a: Any, **k: Any) -> None:
        real_verify(self, *a, **k)
        verified.set()

    run = _Pushes()

    def final(self: Any, *a: Any, **k: Any) -> None:
        seen.append((verified.wait(timeout=30), run.handle.side.state))
        real_final(self, *a, **k)

    monkeypatch.setattr(ApplyTarget, "_record_and_verify", verify)
    monkeypatch.setattr(CudaIpcReceiver, "_final", final)
    try:
        for v in range(1, 5):  # the plan recorded, checked, then the settled steady state
            verified.clear()
            run.push(v)
            run.equal()
            assert seen[-1] == (True, "updating"), seen
            assert run.handle.side.state == "current" and run.last()["ok"] is True
        assert len(seen) == 4 and run.last()["settled"] is True, run.last()
    finally:
        run.close()

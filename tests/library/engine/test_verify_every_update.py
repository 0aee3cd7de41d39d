"""Every update verified by default (issue 38), through the engine of docs/engines.md.

Four successive pushes (the last returns exactly to the first's weights) are each
verified: the first on the fresh-load shadow (it records the copy plan), the second
through the plan against a fresh load in full, the later ones by the digests of what the
plan wrote (no shadow built: the engine holds nothing the loader computed). A later push
whose post-load step runs twice (the failure users report on the second and later
syncs) is caught by the digest: no copy of a digest-proved tensor is kept, so that push
ends torn, naming the tensor; the next ones keep copies of that module, compare it on a
shadow, repair it and meet the oracle; all counted in `info()` and in Prometheus.
With `ENGINEHOOKS_VERIFY=never` the same
corruption stays: the check is what makes the difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.engine.verify import WeightsMismatch
from enginehooks.trainer_side import adapter_for
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.library.metrics.test_prometheus import scrape, value
from tests.support.engine_page import MinimalEngine


def _holds(engine: MinimalEngine, model: Any) -> list[str]:
    """Names of the engine's parameters that are not exactly the trainer's tensors."""
    params = dict(engine.tiny.model.named_parameters())
    return [n for n, t in adapter_for(model).stream() if not torch.equal(params[n], t)]


def _verification(handle: Any) -> dict[str, Any]:
    return handle.info(30)[0]["verification"]  # type: ignore[no-any-return]


def _twice(engine: MinimalEngine) -> Any:
    """An `after_load` whose post-load step (scaling the final norm) is applied a
    second time on every update from the fourth on: the class of engine bug issue 38
    names (post-load processing that is not idempotent)."""
    target = engine.handle().side.target  # type: ignore[attr-defined]
    calls = {"n": 0}

    def after_load(model: torch.nn.Module, landed: set[str]) -> None:
        calls["n"] += 1
        if calls["n"] >= 4 and "model.norm.weight" in landed:
            with torch.no_grad():
                model.model.norm.weight.mul_(2.0)  # type: ignore[union-attr, operator]

    target.after_load = after_load
    return target


def test_every_push_is_verified_and_later_ones_by_digest(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINEHOOKS_VERIFY", raising=False)
    monkeypatch.delenv("ENGINEHOOKS_COPY_PLAN", raising=False)
    engine = MinimalEngine(model_dirs["llama"])
    handle = engine.handle()
    versions = [perturb(load_tiny(model_dirs["llama"]), seed=s) for s in (11, 12, 13)]
    versions.append(versions[0])  # back to the first version's weights exactly
    hows = []
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        for i, model in enumerate(versions):
            report = sync.push(model, version=i + 1)
            assert _holds(engine, model) == [], i
            v = _verification(handle)
            assert v["last"]["ok"] is True and v["last"]["outcome"] == "verified", v
            assert v["last"]["unverified"] == [] and v["last"]["mismatched"] == []
            worker = report.replicas[0].stats["workers"][0]
            assert worker["verification"] == v["last"]  # the push report says it too
            hows.append(v["last"]["how"])
    assert hows[:2] == ["shadow", "shadow"], hows  # recording, then the plan's first use
    assert hows[2:] == ["digest", "digest"], hows
    v = _verification(handle)
    assert v["policy"] == "always" and v["verified"] == 4
    assert v["updates"] == {"verified": 4, "repaired": 0, "unverified": 0, "failed": 0}
    assert v["last"]["digest_bytes"] == sum(t.nbytes for _, t in adapter_for(versions[0]).stream())
    assert v["last"]["shadow_bytes"] == 0
    engine.close()


def test_a_later_push_corrupted_by_its_post_load_step_is_repaired_and_counted(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, plugin: Any) -> None:
    from enginehooks.metrics import PrometheusMetrics

    monkeypatch.delenv("ENGINEHOOKS_VERIFY", raising=False)
    metrics = plugin(PrometheusMetrics(), name="prometheus")
    port = metrics.serve(0)
    engine = MinimalEngine(model_dirs["llama"])
    handle = engine.handle()
    _twice(engine)
    versions = [perturb(load_tiny(model_dirs["llama"]), seed=s) for s in range(21, 27)]
    try:
        with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
            sync.add_replica(handle)
            for i, model in enumerate(versions):
                # push 3 was proved by digests alone, so push 4 keeps no copies
                if i == 3:  # the first corrupted push: the digest caught it, torn
                    with pytest.raises(WeightsMismatch, match=r"plain copies do not hold the "
                                                           r"bytes received \(model\.norm"):
                        sync.push(model, version=i + 1)
                    assert handle.info(30)[0]["state"] == "torn"
                    assert _verification(handle)["last"]["ok"] is False
                    continue
                sync.push(model, version=i + 1)
                # the exact oracle after every push, the repaired ones included
                assert _holds(engine, model) == [], i
                v = _verification(handle)
                if i >= 4:  # every later one is compared on a shadow there, repaired
                    assert v["last"]["outcome"] == "repaired", v
                    assert v["last"]["repaired"] == ["model.norm.weight"], v
                    assert "shadow" in v["last"]["how"], v
            sync.push(versions[0], version=7)
            assert _holds(engine, versions[0]) == []
        m = scrape(port)
    finally:
        metrics.close()
    v = _verification(handle)
    assert v["updates"] == {"verified": 3, "repaired": 3, "unverified": 0, "failed": 1}
    assert value(m, "enginehooks_replica_updates_total", replica="minimal",
                 outcome="verified") == 3
    assert value(m, "enginehooks_replica_updates_total", replica="minimal",
                 outcome="repaired") == 3
    engine.close()


def test_with_verification_off_the_same_corruption_stays(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "never")
    engine = MinimalEngine(model_dirs["llama"])
    handle = engine.handle()
    _twice(engine)
    versions = [perturb(load_tiny(model_dirs["llama"]), seed=s) for s in (31, 32, 33, 34)]
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        for i, model in enumerate(versions):
            sync.push(model, version=i + 1)
    assert _holds(engine, versions[-1]) == ["model.norm.weight"]
    v = _verification(handle)
    # the plan's first use is verified whatever the policy; the others are counted
    assert v["updates"] == {"verified": 1, "repaired": 0, "unverified": 3, "failed": 0}, v
    assert v["last"]["ok"] is None and v["last"]["how"] == "not verified", v
    engine.close()


def test_digests_prove_fused_destinations_and_name_what_differs() -> None:
    from enginehooks.engine.copy_plan import Step, View
    from enginehooks.engine.verify import DigestCheck, Verdict, verify_and_repair

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Parameter(torch.zeros(6, 4))
            self.part = torch.nn.Parameter(torch.zeros(4, 4))

    q, k = torch.randn(4, 4), torch.randn(2, 4)
    # q and k land in rows 0-3 and 4-5 of the fused qkv; `part` gets only its first rows
    q_step = Step("qkv", View(0, (4, 4), (4, 1)), View(0, (4, 4), (4, 1)))
    k_step = Step("qkv", View(16, (2, 4), (4, 1)), View(0, (2, 4), (4, 1)))
    h_step = Step("part", View(0, (2, 4), (4, 1)), View(0, (2, 4), (4, 1)))
    fill = Step("part", View(8, (2, 4), (4, 1)), None, 0.0)
    dtypes = {"qkv": torch.float32, "part": torch.float32}
    assert DigestCheck.provable([q_step], q, dtypes)
    assert not DigestCheck.provable([h_step, fill], k, dtypes)  # a constant fill
    assert not DigestCheck.provable([q_step], q.t(), dtypes)  # not contiguous
    assert not DigestCheck.provable([q_step], q.double(), dtypes)  # converted on the way

    live = Fused()
    with torch.no_grad():
        live.qkv[:4].copy_(q)
        live.qkv[4:].copy_(k)
        live.part[:2].copy_(k)
    check = DigestCheck()
    check.add([q_step], q, dtypes)
    check.add([k_step], k, dtypes)
    check.add([h_step], k, dtypes)
    tensors = dict(live.named_parameters())
    # `part` is written in part: what else it holds is not the plan's to prove
    assert check.check(tensors) == (["qkv"], [])
    with torch.no_grad():
        live.qkv[5, 3] += 1.0
    assert check.check(tensors) == ([], ["qkv"])
    # without host copies (an accelerator), a digest failure cannot be repaired now: the
    # update is torn, naming the tensor, and the module is compared on a shadow next time
    check.uncopied.add("k")
    suspect: set[str] = set()
    with pytest.raises(WeightsMismatch, match=r"plain copies do not hold the bytes received "
                                              r"\(qkv\)"):
        verify_and_repair(live, Fused, {"qkv"}, engine="toy", digests=check, suspect=suspect)
    assert suspect == {""}
    assert Verdict(digest=1).how == "digest" and Verdict().how == "nothing to compare"


class Opaque(torch.nn.Module):
    """A linear layer whose forward reads a packed copy of its weight that cannot be
    read as bytes (a sparse layout stands in for a oneDNN handle)."""

    def __init__(self, w: torch.Tensor, in_features: int | None = 3) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone())
        self.packed = w.clone().to_sparse()
        if in_features is not None:
            self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.packed, x.t()).t()


def test_opaque_storage_is_compared_through_the_forward_never_skipped() -> None:
    from enginehooks.engine.verify import verify_and_repair

    w = torch.randn(2, 3)
    same = verify_and_repair(Opaque(w), lambda: Opaque(w), {"weight"}, engine="toy")
    assert same.probed == ["packed"] and same.unverified == [] and same.mismatched == []
    live = Opaque(w)
    live.packed = (w * 2).to_sparse()  # post-load processing that went wrong
    with pytest.raises(WeightsMismatch, match=r"<model> \(forward\)"):
        verify_and_repair(live, lambda: Opaque(w), {"weight"}, engine="toy")
    # a module whose forward cannot be probed: said, not skipped
    blind = verify_and_repair(Opaque(w, None), lambda: Opaque(w, None), {"weight"}, engine="toy")
    assert blind.unverified == ["packed"] and blind.probed == []


class Handler:
    """An engine's opaque packed weight (vLLM CPU's `CPUDNNLGEMMHandler` stands here)."""

    def __init__(self, w: torch.Tensor) -> None:
        self._w = w.clone()

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self._w.t()


class Packed(torch.nn.Module):
    """A linear layer after CPU prepacking: `weight` emptied, the forward's GEMM a
    closure over the handler."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.input_size_per_partition = w.shape[1]
        self.weight = torch.nn.Parameter(torch.empty(0))
        handler = Handler(w)
        self.cpu_linear = lambda x, weight, bias: handler.gemm(x)


def test_a_packed_weight_held_by_a_closure_is_probed_and_repaired() -> None:
    from enginehooks.engine.verify import digest_only_modules, opaque_captures, verify_and_repair

    w = torch.randn(2, 3)
    assert opaque_captures(Packed(w)) == {"cpu_linear": "handler"}
    same = verify_and_repair(Packed(w), lambda: Packed(w), {"weight"}, engine="toy")
    assert same.probed == ["cpu_linear<handler>"] and same.mismatched == []
    stale = Packed(w * 3)  # the packed copy kept old values: the weight itself is empty
    got = verify_and_repair(stale, lambda: Packed(w), {"weight"}, engine="toy")
    assert got.repaired == ["cpu_linear<handler>"]
    x = torch.randn(4, 3)
    assert torch.equal(stale.cpu_linear(x, None, None), x @ w.t())
    # a module holding such storage is never proved by digests alone
    assert digest_only_modules(Packed(w), {"weight"}, {"weight"}, set()) == set()


class TensorPacked(torch.nn.Module):
    """A linear layer packed into a readable tensor a closure captures under `name`
    (vLLM CPU's sgl-kernel packing captures `packed_weight`)."""

    def __init__(self, w: torch.Tensor, name: str) -> None:
        super().__init__()
        self.input_size_per_partition = w.shape[1]
        self.weight = torch.nn.Parameter(torch.empty(0))
        packed = w.t().contiguous()
        self.cpu_linear = {
            "packed_weight": lambda x, weight, bias: x @ packed,
            "stale": (lambda stale: lambda x, weight, bias: x @ stale)(packed),
        }[name]


def test_a_callable_capturing_other_tensors_than_the_fresh_ones_is_probed() -> None:
    """The live callable captured tensors under other names than the fresh load's (a
    closure left by another kernel's packing, or an older one): no tensor of it matches
    one of the fresh load's by name, so its forward is compared instead; without that
    check nothing would compare it at all."""
    from enginehooks.engine.verify import verify_and_repair

    w = torch.randn(2, 3)
    same = verify_and_repair(TensorPacked(w, "stale"), lambda: TensorPacked(w, "packed_weight"),
                             {"weight"}, engine="toy")
    assert same.mismatched == [] and same.probed == ["cpu_linear<stale>"], same
    wrong = TensorPacked(w * 3, "stale")
    got = verify_and_repair(wrong, lambda: TensorPacked(w, "packed_weight"), {"weight"},
                            engine="toy")
    assert got.repaired == ["cpu_linear<stale>"], got
    x = torch.randn(4, 3)
    assert torch.equal(wrong.cpu_linear(x, None, None), x @ w.t().contiguous())


def test_a_planned_copy_the_engine_always_processes_sends_only_its_module_to_the_shadow(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose post-load processing rewrites one planned tensor on every load,
    the fresh load included (vLLM CPU on AMX hosts turns a small linear's bias to
    float32): that tensor's digest can never hold, yet the engine equals a fresh load.
    Its module goes to the shadow (compared, equal: verified), and every other module
    is still proved by its digests: `digest` > 0 on every push after the plan's first
    use. Before, one such tensor sent the whole model to the shadow on every push."""
    monkeypatch.delenv("ENGINEHOOKS_VERIFY", raising=False)
    monkeypatch.delenv("ENGINEHOOKS_COPY_PLAN", raising=False)
    engine = MinimalEngine(model_dirs["llama"])
    handle = engine.handle()
    target = handle.side.target  # type: ignore[attr-defined]

    def process(model: torch.nn.Module) -> None:
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)  # type: ignore[union-attr, operator]

    def after_load(model: torch.nn.Module, landed: set[str]) -> None:
        if "model.norm.weight" in landed:
            process(model)

    fresh_load = target.fresh_load

    def processed_fresh_load(weights: Any, before_processing: Any = None) -> torch.nn.Module:
        model = fresh_load(weights, before_processing)
        process(model)
        return model  # type: ignore[no-any-return]

    target.after_load = after_load
    target.fresh_load = processed_fresh_load
    versions = [perturb(load_tiny(model_dirs["llama"]), seed=s) for s in (31, 32, 33, 34)]
    total = sum(t.nbytes for _, t in adapter_for(versions[0]).stream())
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        for i, model in enumerate(versions):
            sync.push(model, version=i + 1)
            v = _verification(handle)["last"]
            assert v["ok"] is True and v["outcome"] == "verified", v
            assert v["mismatched"] == [] and v["unverified"] == [], v
            if i >= 2:  # after the plan's first use: digests, and a shadow for the norm
                assert v["how"] == "digest+shadow", v
                assert 0 < v["digest_bytes"] < total, v
    engine.close()


@pytest.mark.parametrize("spread", [False, True])
def test_host_digests_spread_over_threads_judge_each_destination(
        monkeypatch: pytest.MonkeyPatch, spread: bool) -> None:
    """After apply the host digests of an update's plain copies are computed on several
    threads where there are many bytes (`verify._host_digests`): each destination is
    still judged by its own runs, in whatever order they finish. A fused destination
    written by two runs is bad when either run is, a flipped byte in a large run among
    many small ones is found, and the rest are good. The spread path is forced on (and
    off) by the byte threshold, and its threads observed."""
    import threading

    from enginehooks.engine import verify
    from enginehooks.engine.copy_plan import Step, View
    from enginehooks.engine.verify import DigestCheck

    monkeypatch.setattr(verify, "_SPREAD_BYTES", 0 if spread else 1 << 60)
    monkeypatch.setattr(verify.os, "cpu_count", lambda: 4)
    threads: set[str] = set()
    real = verify._digest

    def digest(algo: str, b: torch.Tensor) -> int:
        threads.add(threading.current_thread().name)
        return real(algo, b)

    monkeypatch.setattr(verify, "_digest", digest)
    g = torch.Generator().manual_seed(7)
    sizes = [(256, 64)] + [(4, 8)] * 12  # one large run, many small ones
    names = [f"w{i}" for i in range(len(sizes))]
    received = [torch.randn(*s, generator=g) for s in sizes]
    live = {n: t.clone() for n, t in zip(names, received, strict=True)}
    dtypes = {n: torch.float32 for n in [*names, "fused"]}
    check = DigestCheck()
    for n, t in zip(names, received, strict=True):
        full = View(0, tuple(t.shape), (t.shape[1], 1))
        check.add([Step(n, full, full)], t, dtypes)
    # two received tensors land in the halves of one fused destination
    a, b = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    live["fused"] = torch.cat([a, b])
    check.add([Step("fused", View(0, (2, 8), (8, 1)), View(0, (2, 8), (8, 1)))], a, dtypes)
    check.add([Step("fused", View(16, (2, 8), (8, 1)), View(0, (2, 8), (8, 1)))], b, dtypes)

    good, bad = check.check(live)
    assert sorted(good) == sorted([*names, "fused"]) and bad == []
    assert any(t.startswith("enginehooks-digest") for t in threads) == spread
    live["w0"][200, 3] += 1.0  # the large run
    live["fused"][3, 7] += 1.0  # the second half of the fused one
    good, bad = check.check(live)
    assert sorted(bad) == ["fused", "w0"]
    assert sorted(good) == sorted(names[1:])


@pytest.mark.parametrize("bucket", [1 << 16, 4 << 20])
def test_a_tensor_the_transport_checked_as_it_landed_is_not_read_again(
        monkeypatch: pytest.MonkeyPatch, bucket: int) -> None:
    """Over gloo a tensor of 1 MB or more travels in buckets of its own (one, or pieces
    of a bucket each where it is larger), which the receive loop checks against the
    sender's digests as they land in the replica's own tensor: verification takes those
    digests (`Target.arrived_piece`), one run per piece, instead of reading the tensor
    again at receipt, and still proves it after apply. Pushed into a real `ApplyTarget`
    on CPU: the digest-verified pushes read none of the large tensor at receipt, and one
    whose bytes the engine's post-load step changes after they landed ends torn, naming
    it (the sender's digests no longer hold)."""
    from enginehooks import WeightSync
    from enginehooks.engine import verify
    from enginehooks_testkit.inprocess_replica import inprocess_replica

    monkeypatch.delenv("ENGINEHOOKS_VERIFY", raising=False)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = torch.nn.Linear(1024, 512, bias=True)  # 2 MB: a bucket of its own
            self.small = torch.nn.Linear(16, 16, bias=True)  # packed

        def load_weights(self, weights: Any) -> None:
            params = dict(self.named_parameters())
            with torch.no_grad():
                for name, t in weights:
                    params[name].copy_(t)

    fault = {"on": False}

    def after_load(m: torch.nn.Module, landed: set[str]) -> None:
        if fault["on"]:
            with torch.no_grad():
                m.big.weight.mul_(2.0)  # type: ignore[union-attr, operator]

    read: list[int] = []
    real, real_add = verify._digest, verify.DigestCheck.add
    receiving = [False]

    def digest(algo: str, b: torch.Tensor) -> int:
        if receiving[0]:  # (the check after apply reads every destination, as it must)
            read.append(b.numel())
        return real(algo, b)

    def add(self: Any, *a: Any, **kw: Any) -> None:
        receiving[0] = True
        try:
            real_add(self, *a, **kw)
        finally:
            receiving[0] = False

    monkeypatch.setattr(verify, "_digest", digest)
    monkeypatch.setattr(verify.DigestCheck, "add", add)
    handle, live = inprocess_replica(lambda dev: Model().to(dev), torch.device("cpu"),
                                     after_load=after_load)
    trainer = Model()
    big = trainer.big.weight.nbytes
    with WeightSync("gloo", bucket_bytes=bucket, timeout_s=60) as sync:
        sync.add_replica(handle)
        for v in range(1, 5):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.copy_(torch.randn_like(p))
            read.clear()
            sync.push(trainer, version=v)
            last = handle.side.info()["verification"]["last"]
            assert last["ok"] is True and not last["repaired"], last
            for (n, a), b in zip(trainer.state_dict().items(), live.state_dict().values(),
                                 strict=True):
                assert torch.equal(a, b), n
            if v >= 3:  # proved by digests: the big weight was not read at receipt
                assert last["how"] == "digest", last
                assert read and big not in read, read
                # and the verdict says so: its received digests were the transport's
                assert last["arrived_bytes"] == big, last
        fault["on"] = True
        with pytest.raises(WeightsMismatch, match=r"big\.weight"):
            sync.push(trainer, version=5)

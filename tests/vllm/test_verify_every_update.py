"""Every update verified by default, in a real vLLM (bf16: linear layers prepacked).

Successive pushes into one engine, the exact oracle after each (a return to an earlier
version reuses that version's fresh load). Then a post-load step that is not safe to
run twice (the failure users report on the second and later syncs: here a norm
scaled again after every update, injected into the live engine's `after_load`, since
no real loader misbehaves on demand) corrupts every later push: with the default
policy each is caught (the norm is a plain copy, proved by its digest, which now
differs), repaired from a fresh load, counted, and meets the oracle; the push after
it is verified again. With verification disabled (policy "never"), the same push
leaves the engine wrong: this test fails exactly when verification of a later push is
turned off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks_testkit.engines import VLLMInProcess, first_difference, fresh_generate_of
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

NORM = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module", params=["off", "on"], ids=["live-processing", "twins"])
def engine(request: pytest.FixtureRequest, model_dirs: dict[str, Path]
           ) -> Iterator[VLLMInProcess]:
    """`ENGINEHOOKS_TWIN=off`, and the default, on (`engine.twin`: verified updates in
    the plan's steady state process the planned layers on fresh twins and move the
    products in)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ENGINEHOOKS_VERIFY", raising=False)  # the default policy
        mp.setenv("ENGINEHOOKS_TWIN", request.param)
        with VLLMInProcess(model_dirs["qwen2"], dtype="bfloat16") as llm:
            llm.twins = request.param == "on"  # type: ignore[attr-defined]
            yield llm


def _trainer(src: Path, seed: int) -> Any:
    return perturb(load_tiny(src), seed=seed).to(torch.bfloat16)


def _fresh(model: Any, src: Path, folder: Path) -> list:
    return fresh_generate_of("vllm", model, src, folder, dtype="bfloat16")


def _onednn_handlers(worker: Any) -> int:
    """How many of the worker's linears run through a oneDNN handler (a closure over
    `handler`, no readable bytes) rather than a packed tensor or torch's own linear."""
    model = worker._enginehooks_side().binding.target().model()
    return sum(1 for m in model.modules()
               if "handler" in getattr(getattr(getattr(m, "cpu_linear", None), "__code__", None),
                                       "co_freevars", ()))


def _post_load_twice(worker: Any, on: bool) -> bool:
    """Turn on (or off) a second application of a post-load step after every update:
    layer 0's input norm scaled by 2 once the engine's own `after_load` ran."""
    target = worker._enginehooks_side().binding.target()
    if not on:
        target.__dict__.pop("after_load", None)
        return False
    own = type(target).after_load

    def after_load(model: torch.nn.Module, landed: set[str]) -> None:
        own(target, model, landed)
        with torch.no_grad():
            model.get_parameter(NORM).mul_(2.0)

    target.after_load = after_load
    return True


def _policy(worker: Any, policy: str) -> str:
    verifier = worker._enginehooks_side().binding.target().verifier
    old, verifier.policy = verifier.policy, policy
    return str(old)


def _verification(engine: VLLMInProcess) -> dict[str, Any]:
    return engine.handle().info(30)[0]["verification"]  # type: ignore[no-any-return]


def test_successive_pushes_are_each_verified_and_a_repeated_post_load_step_is_repaired(
        engine: VLLMInProcess, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = model_dirs["qwen2"]
    a, b = _trainer(src, seed=401), _trainer(src, seed=402)
    with WeightSync("gloo", bucket_bytes=64 << 10, timeout_s=120) as sync:
        sync.add_replica(engine.handle())
        sync.push(a, version=1)  # through vLLM's reload; records the copy plan
        out_a = engine.generate()
        assert first_difference(out_a, _fresh(a, src, tmp_path / "a")) is None
        sync.push(b, version=2)  # the plan's first use, judged against a fresh load
        out_b = engine.generate()
        assert first_difference(out_b, _fresh(b, src, tmp_path / "b")) is None
        v = _verification(engine)
        assert v["policy"] == "always" and v["updates"]["verified"] == 2, v
        assert engine.handle().info(30)[0]["copy_plan"]["state"] == "on"

        sync.push(a, version=3)  # back to a, exactly: the plan's steady state
        assert first_difference(engine.generate(), out_a) is None
        v = _verification(engine)
        assert v["last"]["outcome"] == "verified" and v["last"]["digest"] > 0, v
        assert v["last"]["unverified"] == [], v
        # the prepacked GEMMs (oneDNN handlers, no readable bytes) compared by a probe,
        # wherever vLLM made any (on AMX hosts it packs these small linears for its
        # sgl kernel instead: a readable packed tensor, compared as a tensor)
        handlers = engine.llm.collective_rpc(_onednn_handlers)[0]
        assert any(p.endswith("cpu_linear<handler>") for p in v["last"]["probed"]) == (
            handlers > 0), (handlers, v)
        twins = engine.handle().info(30)[0]["copy_plan"].get("twins_last")
        if engine.twins:  # type: ignore[attr-defined]
            # every planned layer processed on its twin, its products moved in; the
            # check compared them with the twins, no shadow unit built besides
            assert twins is not None and twins["moved"] > 0 and twins["kept_live"] == 0, twins
            assert v["last"]["shadow_units"] == 1, v
        else:
            assert twins is None

        assert engine.llm.collective_rpc(_post_load_twice, args=(True,))[0]
        try:
            sync.push(b, version=4)  # corrupted by the repeated step: caught, repaired
            assert first_difference(engine.generate(), out_b) is None
            v = _verification(engine)
            assert v["last"]["outcome"] == "repaired" and NORM in v["last"]["repaired"], v
            sync.push(a, version=5)  # the next push is verified too (on a shadow there)
            assert first_difference(engine.generate(), out_a) is None
            v = _verification(engine)
            assert v["last"]["outcome"] == "repaired" and "shadow" in v["last"]["how"], v
            assert v["updates"] == {"verified": 3, "repaired": 2, "unverified": 0,
                                    "failed": 0}, v

            # verification of a later push disabled: the same corruption stays
            assert engine.llm.collective_rpc(_policy, args=("never",))[0] == "always"
            try:
                sync.push(b, version=6)
                assert first_difference(engine.generate(), out_b) is not None, \
                    "the corrupted push met the oracle without verification"
                assert _verification(engine)["updates"]["unverified"] == 1
            finally:
                engine.llm.collective_rpc(_policy, args=("always",))
        finally:
            engine.llm.collective_rpc(_post_load_twice, args=(False,))
        sync.push(a, version=7)  # the engine is put right for whatever runs next
        assert first_difference(engine.generate(), out_a) is None

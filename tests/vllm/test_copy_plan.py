"""The copy plan on a real vLLM (bf16: on this CPU class vLLM prepacks every linear layer).

The first push goes through vLLM's reload and records the plan from vLLM's own loader
(the meta skeleton under the tracer), checked on the fresh-load shadow; the second push
writes the planned tensors straight into vLLM's layers and is verified against a fresh
load (which turns the plan on); the third is planned and unverified. The trainer
sends bf16, the engine's dtype, so full copies are received straight into vLLM's
layers. After each, the
exact oracle: the engine generates what vLLM freshly loaded from `save_pretrained` of
the pushed weights generates. `info` reports what went through the plan.

A planned layer's post-load processing runs on a thread of its own (`PlannedLayers`):
an error there fails the update, the layer gets its kernel tensors back, and the next
update repairs the engine (the error is injected into one layer of the real engine: no
real loader fails on demand).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.core.errors import EngineHooksError
from enginehooks_testkit.engines import VLLMInProcess, first_difference, fresh_generate_of
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path]) -> Iterator[VLLMInProcess]:
    # policy "first" (an opt-out): the third push here is the unverified one
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINEHOOKS_VERIFY", "first")
        with VLLMInProcess(model_dirs["qwen2"], dtype="bfloat16") as llm:
            yield llm


def _trainer(src: Path, seed: int) -> object:
    """A 'trained' model in the engine's dtype: full copies then arrive in direct
    buckets of the parameter's own dtype, which land straight in vLLM's layers."""
    return perturb(load_tiny(src), seed=seed).to(torch.bfloat16)


def _embedding_full_copy(worker: object) -> bool:
    plan = worker._enginehooks_side().binding.target().plan.plan  # type: ignore[attr-defined]
    return plan.full_copy("model.embed_tokens.weight") is not None


def _fresh(model: object, src: Path, folder: Path) -> list:
    return fresh_generate_of("vllm", model, src, folder, dtype="bfloat16")


def test_planned_pushes_equal_a_fresh_load(engine: VLLMInProcess, model_dirs: dict[str, Path],
                                           tmp_path: Path) -> None:
    handle = engine.handle()
    src = model_dirs["qwen2"]
    # 8 KiB buckets: the tiny model's larger tensors fill buckets of their own (direct)
    with WeightSync("gloo", bucket_bytes=8 << 10, timeout_s=120) as sync:
        sync.add_replica(handle)
        first = _trainer(src, seed=91)
        sync.push(first, version="loader")
        plan = handle.info(30)[0]["copy_plan"]
        assert plan["state"] == "verifying", plan
        assert plan["planned"] > 0 and plan["applied"] == 0, plan
        assert plan["planned_last"] == 0
        total = plan["planned"] + plan["loader"]

        second = _trainer(src, seed=92)
        sync.push(second, version="planned")
        got = engine.generate()
        plan = handle.info(30)[0]["copy_plan"]
        assert plan["state"] == "on", plan
        assert plan["applied"] == 1 and plan["planned_last"] > 0, plan
        assert plan["planned_last"] + plan["loader_last"] == total
        # full copies (o_proj, down_proj, ...) in direct buckets were received into
        # their layers, without the replay's copy; the embedding too (its loader's fill
        # of an empty vocabulary padding is no second write)
        assert plan["in_place_last"] > 0, plan
        assert engine.llm.collective_rpc(_embedding_full_copy)[0]
        verification = handle.info(30)[0]["verification"]
        assert verification["last"]["ok"] is True and verification["last"]["mismatched"] == []
        diff = first_difference(got, _fresh(second, src, tmp_path / "second"))
        assert diff is None, f"vLLM after a planned push != vLLM freshly loaded: {diff}"

        third = _trainer(src, seed=93)
        verified = verification["verified"]
        sync.push(third, version="planned-unverified")
        got = engine.generate()
        info = handle.info(30)[0]
        assert info["copy_plan"]["applied"] == 2
        assert info["verification"]["verified"] == verified  # policy "first": not again
        diff = first_difference(got, _fresh(third, src, tmp_path / "third"))
        assert diff is None, f"vLLM after an unverified planned push != a fresh load: {diff}"


BROKEN = "injected: post-load processing failed"


def _break_down_proj(worker: object) -> int:
    """Make layer 0's `down_proj` processing raise once, on whichever thread runs it;
    return the id of the kernel tensor the engine holds for its weight."""
    layer = worker.model_runner.get_model().model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    qm = layer.quant_method
    original = qm.process_weights_after_loading

    def broken(module: object) -> None:
        if module is layer:
            del qm.process_weights_after_loading  # once: the next update processes it
            raise RuntimeError(BROKEN)
        original(module)

    qm.process_weights_after_loading = broken
    return id(layer.weight)


def _down_proj_weight(worker: object) -> int:
    return id(worker.model_runner.get_model().model.layers[0].mlp.down_proj.weight)  # type: ignore[attr-defined]


def test_a_processing_error_fails_the_update_and_the_next_repairs(
        engine: VLLMInProcess, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    handle = engine.handle()
    src = model_dirs["qwen2"]
    with WeightSync("gloo", bucket_bytes=64 << 10, timeout_s=120) as sync:
        sync.add_replica(handle)
        for seed in (94, 95):  # record and verify the plan, if this test runs alone
            if handle.info(30)[0]["copy_plan"]["state"] == "on":
                break
            sync.push(_trainer(src, seed=seed), version=f"setup-{seed}")
        assert handle.info(30)[0]["copy_plan"]["state"] == "on"
        kernel = engine.llm.collective_rpc(_break_down_proj)[0]
        with pytest.raises(EngineHooksError, match="post-load processing failed"):
            sync.push(_trainer(src, seed=96), version="broken")
        info = handle.info(30)[0]
        assert info["state"] == "torn", info
        # the failed layer was put back on the engine's own kernel tensors
        assert engine.llm.collective_rpc(_down_proj_weight)[0] == kernel
        last = _trainer(src, seed=97)
        sync.push(last, version="repaired")
    info = handle.info(30)[0]
    assert info["state"] == "current" and info["copy_plan"]["state"] == "on", info
    diff = first_difference(engine.generate(), _fresh(last, src, tmp_path / "repaired"))
    assert diff is None, f"vLLM after the repairing push != vLLM freshly loaded: {diff}"


def _offer_twice(worker: object, name: str, tensor: torch.Tensor) -> tuple[bool, bool, bool]:
    """Offer `name`'s destination, write it, and offer it again, on the live model through
    the engine's own recorded plan (the transport asks once per tensor, before its
    bytes; a second ask must not reopen a layer that was already rebuilt)."""
    from vllm.config import set_current_vllm_config

    from enginehooks.vllm_ext.worker_extension import PlannedLayers, plannable

    target = worker._enginehooks_side().binding.target()  # type: ignore[attr-defined]
    plan = target.plan.plan
    model = worker.model_runner.get_model()  # type: ignore[attr-defined]
    routes = plannable(model, plan, [r.spec for r in plan.routes.values()])
    layers = PlannedLayers(model, routes, background=False)
    first = layers.destination(name, plan)
    assert first is not None
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
        first.copy_(tensor)
        layers.write(name, first)
    closed = name.rpartition(".")[0] not in layers.open
    again = layers.destination(name, plan)
    return closed, again is None, not layers.open


def test_a_rebuilt_layer_is_never_reopened(engine: VLLMInProcess, model_dirs: dict[str, Path],
                                           tmp_path: Path) -> None:
    handle = engine.handle()
    src = model_dirs["qwen2"]
    name = "model.layers.0.self_attn.o_proj.weight"  # a plain full copy, alone in its layer
    with WeightSync("gloo", bucket_bytes=64 << 10, timeout_s=120) as sync:
        sync.add_replica(handle)
        for seed in (98, 99):  # record and verify the plan, if this test runs alone
            if handle.info(30)[0]["copy_plan"]["state"] == "on":
                break
            sync.push(_trainer(src, seed=seed), version=f"setup-{seed}")
        new = _trainer(src, seed=100)
        closed, refused, none_open = engine.llm.collective_rpc(
            _offer_twice, args=(name, new.state_dict()[name]))[0]
        assert closed and refused and none_open
        sync.push(new, version="after-offers")  # the rest of `new` (o_proj is already in)
    diff = first_difference(engine.generate(), _fresh(new, src, tmp_path / "after-offers"))
    assert diff is None, f"vLLM after the offers and a push != vLLM freshly loaded: {diff}"

"""vLLM's own weight-transfer API with backend "enginehooks", on an in-process `LLM`.

vLLM's trainer-side factory builds the engine from `EnginehooksTrainerInitInfo`, and
vLLM's own `LLM` calls (`init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`) drive the workers; enginehooks checks the
manifest against vLLM's loader first, moves the bytes over gloo with digests, and
reports. The same engine also runs the worker extension, which must see the same
receiving state, and the `WeightSync` path must record versions in vLLM's own
`weight_info` and verify with vLLM's `weight_checker`.

Correctness: the exact oracle (the engine after the push equals the same engine freshly
loaded from `save_pretrained` of the pushed weights, tokens and logprobs) and HF's
greedy tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import ConfigError, ManifestError, ReplicaError, WeightSync
from enginehooks.vllm_ext import VLLMEngine
from enginehooks.vllm_ext.handles import TORN, checksum_mismatches
from enginehooks_testkit.engines import (
    NEW_TOKENS,
    PROMPTS,
    VLLMInProcess,
    first_difference,
    fresh_generate_of,
)
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def native(model_dirs: dict[str, Path]) -> Iterator[VLLMInProcess]:
    """One `LLM` with backend "enginehooks" (found through vLLM's plugin entry point)
    and the worker extension."""
    with VLLMInProcess(model_dirs["llama"],
                       engine_args={"weight_transfer_config": {"backend": "enginehooks"}}) as llm:
        yield llm


def fresh_outputs(model: Any, like: Path, tmp: Path) -> list[Any]:
    return fresh_generate_of("vllm", model, like, tmp / "fresh")


def trainer_engine(client: Any, source: Any, **options: Any) -> Any:
    """What a vLLM-native RL framework writes, with backend "enginehooks"."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    info = EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=60,
                                      bucket_bytes=16 << 10, **options)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def module_source(model: Any) -> Any:
    from vllm.distributed.weight_transfer import ModuleSource

    return ModuleSource(model)


class BrokenSource:
    """A WeightSource whose iteration fails after `after` tensors: the trainer dies
    mid-push."""

    def __new__(cls, model: Any, after: int) -> Any:
        from vllm.distributed.weight_transfer import ModuleSource

        class Broken(ModuleSource):
            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                for i, item in enumerate(super().__iter__()):
                    if i == after:
                        raise RuntimeError("trainer lost a rank")
                    yield item

        return Broken(model)


def test_push_through_vllm_calls_equals_fresh_load(native: VLLMInProcess, model_dirs: dict[str, Path],
                                                   tmp_path: Path) -> None:
    model = perturb(load_tiny(model_dirs["llama"]), seed=71)
    before = native.generate()
    engine = trainer_engine(VLLMEngine(native.llm), module_source(model))
    try:
        report = engine.send_weights(weight_version="step-1")
    finally:
        engine.shutdown()
    assert report is not None and report.ok and report.buckets > 4
    assert set(report.phases) >= {"plan", "check", "transfer", "finish"}
    got = native.generate()
    assert first_difference(got, before) is not None, "the push did not change generation"
    diff = first_difference(got, fresh_outputs(model, model_dirs["llama"], tmp_path))
    assert diff is None, f"vLLM after the push != vLLM freshly loaded: {diff}"
    assert [list(g.tokens) for g in got] == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert native.llm.get_weight_version() == "step-1"  # vLLM's weight_info
    # The worker extension reports the backend's receiving state: one state per worker.
    assert native.handle().version() == "step-1"


def test_refused_manifest_changes_nothing(native: VLLMInProcess, model_dirs: dict[str, Path]) -> None:
    model = perturb(load_tiny(model_dirs["llama"]), seed=72)
    version, tokens = native.llm.get_weight_version(), native.generate()
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(torch.zeros(300, 64))  # wrong vocabulary
    engine = trainer_engine(VLLMEngine(native.llm), module_source(model))
    try:
        with pytest.raises(ManifestError, match=r"lm_head\.weight.*300") as err:
            engine.send_weights(weight_version="bad")
    finally:
        engine.shutdown()
    assert err.value.report is not None and err.value.report.bytes > 0  # type: ignore[union-attr]
    assert "transfer" not in err.value.report.phases  # type: ignore[union-attr]
    assert native.llm.get_weight_version() == version
    assert first_difference(native.generate(), tokens) is None
    assert native.handle().info(30)[0]["state"] != "torn"


def test_bad_calls_give_clear_errors(native: VLLMInProcess) -> None:
    with pytest.raises(ConfigError, match=r"enginehooks expects \{'endpoint'"):
        native.llm.init_weight_transfer_engine({"init_info": {"bogus": 1}})
    native.llm.start_weight_update()
    with pytest.raises(ConfigError, match=r"phase must be one of \('check', 'receive'\)"):
        native.llm.update_weights({"update_info": {"manifest": "{}", "phase": "apply"}})
    native.llm.start_weight_update()
    with pytest.raises(ManifestError, match="format_version None is not supported"):
        native.llm.update_weights({"update_info": {"manifest": "{}", "phase": "check"}})


def test_trainer_failure_mid_push_is_reported_torn_then_repaired(
    native: VLLMInProcess, model_dirs: dict[str, Path]
) -> None:
    model = perturb(load_tiny(model_dirs["llama"]), seed=73)
    client = VLLMEngine(native.llm)
    engine = trainer_engine(client, BrokenSource(model, after=5))
    try:
        t0 = time.monotonic()
        with pytest.raises((ReplicaError, RuntimeError), match="trainer lost a rank"):
            engine.send_weights(weight_version="broken")
        assert time.monotonic() - t0 < 60
        info = native.handle().info(30)[0]
        assert info["state"] == "torn" and info["version"] is None
        deadline = time.monotonic() + 30
        while native.llm.get_weight_version() != TORN and time.monotonic() < deadline:
            time.sleep(0.2)  # the torn mark is recorded off the failure path
        assert native.llm.get_weight_version() == TORN
    finally:
        engine.shutdown()
    engine = trainer_engine(client, module_source(model))
    try:
        engine.send_weights(weight_version="repaired")
    finally:
        engine.shutdown()
    assert native.llm.get_weight_version() == "repaired"
    assert native.handle().info(30)[0]["state"] == "current"
    assert [list(g.tokens) for g in native.generate()] == hf_greedy(model, PROMPTS, NEW_TOKENS)


def test_weightsync_records_vllm_version_and_verifies_with_weight_checker(
    native: VLLMInProcess, model_dirs: dict[str, Path]
) -> None:
    """The worker-extension path: vLLM's own weight version follows each push, and vLLM's
    weight_checker shows the same weights after the same push and others after another."""
    handle = native.handle()
    model = perturb(load_tiny(model_dirs["llama"]), seed=74)
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version=41)
        assert handle.engine_version() == "41" and handle.version() == 41
        first = handle.weight_checksums()
        sync.push(model, version=42)
        assert handle.engine_version() == "42"
        assert checksum_mismatches(first, handle.weight_checksums()) == []
        sync.push(perturb(model, seed=75), version=43)
    changed = checksum_mismatches(first, handle.weight_checksums())
    assert any("embed_tokens" in k for k in changed) and any("layers.1" in k for k in changed)

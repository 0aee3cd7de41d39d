"""The last hop into a real vLLM engine: what its loader accepts, and what it verifies.

- An fp32 trainer pushes into a bf16 engine the way vLLM's own RL example does (vLLM's
  weight-transfer API, backend "enginehooks"): the loader casts, so the update is taken,
  and the engine then equals a fresh bf16 load of the fp32 checkpoint (the exact
  oracle). Before the byte tracer, `check` refused every tensor ("dtype float32 but the
  engine runs bfloat16").
- The first update of the process is verified against a fresh-load shadow, and the
  worker reports what it compared.

The families whose reload vLLM gets wrong (GPT-OSS, Mamba2 in bf16) and whose
constructor reads a parameter (Apertus) run as conformance cells.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from enginehooks import ManifestError
from enginehooks.core.dtypes import dtype_name
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.vllm_ext import VLLMEngine
from enginehooks_testkit.engines import VLLMInProcess, first_difference, fresh_generate_of
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def bf16(model_dirs: dict[str, Path]) -> Iterator[VLLMInProcess]:
    # policy "first", the opt-out these tests are about (the default, "always", is
    # tests/vllm/test_verify_every_update.py's)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINEHOOKS_VERIFY", "first")
        with VLLMInProcess(model_dirs["llama"], dtype="bfloat16", engine_args={
                "weight_transfer_config": {"backend": "enginehooks"}}) as llm:
            yield llm


def test_the_loader_decides_dtypes_not_a_rule_of_ours(bf16: VLLMInProcess,
                                                      model_dirs: dict[str, Path]) -> None:
    handle = bf16.handle()
    model = load_tiny(model_dirs["llama"])
    specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in
             model.state_dict().items()]
    assert {s.dtype for s in specs} == {"float32"}
    handle.check(plan(specs, weight_version="fp32", bucket_bytes=1 << 20).to_json(), 60)
    # what the loader refuses is still refused, naming the tensor
    bad = [TensorSpec(s.name, s.dtype, (s.shape[0] + 1, *s.shape[1:]))
           if s.name == "model.embed_tokens.weight" else s for s in specs]
    with pytest.raises(ManifestError, match=r"model\.embed_tokens\.weight"):
        handle.check(plan(bad, weight_version="bad", bucket_bytes=1 << 20).to_json(), 60)


def test_fp32_trainer_into_bf16_engine_through_vllms_api_equals_fresh_load(
        bf16: VLLMInProcess, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    model = perturb(load_tiny(model_dirs["llama"]), seed=81)
    assert next(model.parameters()).dtype == torch.float32
    before = bf16.generate()
    info = EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=60, bucket_bytes=32 << 10)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=VLLMEngine(bf16.llm),
                                                       source=ModuleSource(model))
    try:
        report = engine.send_weights(weight_version="fp32-step")
    finally:
        engine.shutdown()
    assert report is not None and report.ok
    got = bf16.generate()
    assert first_difference(got, before) is not None, "the push did not change generation"
    # fp32 on disk: vLLM's loader casts it to bf16
    diff = first_difference(got, fresh_generate_of("vllm", model, model_dirs["llama"],
                                                   tmp_path / "fresh", dtype="bfloat16"))
    assert diff is None, f"bf16 vLLM after an fp32 push != bf16 vLLM freshly loaded: {diff}"
    # the first update in this process was verified against a fresh-load shadow
    verification = bf16.handle().info(30)[0]["verification"]
    assert verification["verified"] >= 1 and verification["last"]["ok"] is True
    assert verification["last"]["compared"] > 0 and verification["last"]["mismatched"] == []


def test_a_trainer_can_ask_for_every_push_to_be_verified(bf16: VLLMInProcess,
                                                         model_dirs: dict[str, Path]) -> None:
    from enginehooks import WeightSync

    handle = bf16.handle()
    model = perturb(load_tiny(model_dirs["llama"]), seed=82)
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version="unverified")  # policy "first": done already
        count = handle.info(30)[0]["verification"]["verified"]
        assert count >= 1
        sync.push(model, version="unverified-2")
        assert handle.info(30)[0]["verification"]["verified"] == count
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60, verify=True) as sync:
        sync.add_replica(handle)
        sync.push(perturb(model, seed=83), version="verified")
    after = handle.info(30)[0]["verification"]
    assert after["verified"] == count + 1 and after["last"]["ok"] is True

"""A PEFT LoRA model pushes its merged weights; the engine (real vLLM server) must
answer like HF transformers on the merged model (`merge_and_unload`)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.trainer_side import adapter_for
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.tiny import hf_greedy, perturb
from enginehooks_testkit.tiny import load_tiny as load_hf
from tests.support import have, requires_vllm

pytestmark = [pytest.mark.skipif(not have("peft"), reason="peft is not installed here")]


def lora_model(path: Path, seed: int, modules_to_save: list[str] | None = None) -> Any:
    from peft import LoraConfig, get_peft_model

    base = perturb(load_hf(path), seed=seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                     modules_to_save=modules_to_save)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # "trained" adapters: lora_B starts at zero, give it weight
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_peft_names_and_merge_without_touching_weights(model_dirs: dict[str, Path]) -> None:
    model = lora_model(model_dirs["llama"], seed=91, modules_to_save=["lm_head"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = adapter_for(model)
    assert adapter.name == "peft"
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    streamed = dict(adapter.stream())
    assert [s.name for s in adapter.specs()] == list(streamed)
    assert sorted(streamed) == sorted(merged)  # HF names only: no base_layer, no lora_*
    for name, t in streamed.items():
        torch.testing.assert_close(t, merged[name], rtol=0, atol=1e-6, msg=name)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "delta merge touched weights"


@requires_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("merge", ["delta", "inplace"])
def test_peft_merged_push_matches_hf(vllm_server: Any, model_dirs: dict[str, Path],
                                     merge: str) -> None:
    from enginehooks.trainer_side import PeftAdapter

    model = lora_model(model_dirs["llama"], seed=93 if merge == "delta" else 95)
    lora_before = {k: v.clone() for k, v in model.state_dict().items()}
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=60) as sync:
        from enginehooks.vllm_ext import VLLMServer

        sync.add_replica(VLLMServer(vllm_server.url, name="server"))
        report = sync.push(PeftAdapter(model, merge=merge), version=f"lora-{merge}")
    assert report.ok
    reference = copy.deepcopy(model).merge_and_unload()
    assert vllm_server.greedy() == hf_greedy(reference, PROMPTS, NEW_TOKENS)
    # the trainer goes on with an unmerged model (inplace: equal up to rounding)
    after = model.state_dict()
    for k, v in lora_before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0 if merge == "delta" else 1e-5)

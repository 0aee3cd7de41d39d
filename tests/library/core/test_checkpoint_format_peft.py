"""A PEFT model streams exactly what `save_pretrained` writes for its merged model,
bit for bit, including LoRA on parameters (PEFT's ParamWrapper on the fused experts of a
transformers-5 MoE layer, one nested wrapper per targeted parameter) and tied embeddings."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from enginehooks.trainer_side import adapter_for

peft = pytest.importorskip("peft")


def configs() -> dict[str, object]:
    from transformers import Qwen2Config, Qwen3MoeConfig

    small = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    return {
        "qwen3_moe": Qwen3MoeConfig(**small, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, head_dim=16),
        "qwen2_tied": Qwen2Config(**small, tie_word_embeddings=True),
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_tied"])
def test_peft_stream_equals_save_pretrained_of_the_merged_model(family: str,
                                                                tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs()[family])
    model.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                    target_modules="all-linear"))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    copy.deepcopy(pm).merge_and_unload().save_pretrained(tmp_path / "merged")
    expected = load_file(tmp_path / "merged" / "model.safetensors")
    got = dict(adapter_for(pm).stream())
    assert sorted(got) == sorted(expected)
    assert [n for n in expected if not torch.equal(got[n], expected[n])] == []
    # the LoRA factors reached every adapted tensor, the experts' included
    unadapted = load_file(tmp_path / "base" / "model.safetensors")
    changed = {n for n in expected if not torch.equal(expected[n], unadapted[n])}
    assert any(".experts." in n for n in changed) or family != "qwen3_moe", sorted(changed)[:5]

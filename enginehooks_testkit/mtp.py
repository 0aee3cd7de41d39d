"""A tiny checkpoint with a multi-token-prediction (MTP) head, and its trainer side.

transformers builds no MTP parameters for any family (DeepSeek-V3 reads
`num_nextn_predict_layers` and ignores it), so a checkpoint with an MTP head is built by
hand. The family is Xiaomi's MiMo: a Qwen2 model plus `model.mtp_layers.{i}.*`, which
vLLM registers (`MiMoForCausalLM`, drafter `MiMoMTP`, `--speculative-config
'{"method": "mtp"}'`) and runs on CPU; the others vLLM registers (DeepSeek-V3's MLA,
Qwen3-Next's linear attention, GLM-4.5's MoE) cannot run on vLLM's CPU build or are
larger to build.

The MTP layer is a Qwen2 decoder layer (transformers' own, so its tensor names and shapes
are the library's) plus the two input norms, the projection of their concatenation and
a final norm, under the names MiMo's checkpoints use (the ones vLLM's `MiMoMTP` loader
maps: its `hf_to_vllm_mapper`). The engine's own loader is the judge that they are
right: the drafter's loader dry run must land every one of them (`engine.companions`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from enginehooks.demo.tiny import save_tokenizer

#: where the checkpoint keeps its MTP layers (MiMo's layout)
MTP_PREFIX = "model.mtp_layers."


def mtp_layer(config: Any) -> Any:
    """One MTP layer of `config` (a transformers Qwen2Config), in MiMo's layout."""
    import torch
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

    class MiMoMTPLayer(torch.nn.Module):
        """One MTP layer in MiMo's checkpoint layout: the block's parts at its top level."""

        def __init__(self) -> None:
            super().__init__()
            h, eps = config.hidden_size, config.rms_norm_eps
            self.token_layernorm = Qwen2RMSNorm(h, eps=eps)
            self.hidden_layernorm = Qwen2RMSNorm(h, eps=eps)
            self.input_proj = torch.nn.Linear(2 * h, h, bias=False)
            for name, part in Qwen2DecoderLayer(config, 0).named_children():
                setattr(self, name, part)
            self.final_layernorm = Qwen2RMSNorm(h, eps=eps)

    return MiMoMTPLayer()


def with_mtp(model: Any, layers: int = 1) -> Any:
    """`model` (a transformers Qwen2ForCausalLM) with MTP layers attached under
    `model.mtp_layers`: its `state_dict` and `save_pretrained` carry them."""
    import torch

    model.model.mtp_layers = torch.nn.ModuleList(mtp_layer(model.config) for _ in range(layers))
    model.config.num_nextn_predict_layers = layers
    model.config.architectures = ["MiMoForCausalLM"]
    return model


def make_tiny_mimo(folder: str | os.PathLike[str], *, seed: int = 0, hidden_size: int = 64,
                   layers: int = 2, vocab_size: int = 256) -> Path:
    """A random tiny MiMo checkpoint (untied, fp32) with one MTP layer, and its tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=hidden_size // 2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")
    torch.manual_seed(seed)
    model = with_mtp(Qwen2ForCausalLM(config))
    with torch.no_grad():
        for t in model.state_dict().values():
            t.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    mimo_config(folder)
    save_tokenizer(folder, vocab_size)
    return folder


def mimo_config(folder: str | os.PathLike[str]) -> None:
    """Name MiMo as the architecture of a checkpoint saved by transformers (which writes
    its own class, Qwen2ForCausalLM): vLLM picks the model and its MTP drafter by it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    config.architectures = ["MiMoForCausalLM"]
    config.save_pretrained(folder)


def load_tiny_mimo(folder: str | os.PathLike[str]) -> Any:
    """The trainer side of a tiny MiMo checkpoint in fp32, MTP layers included."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2ForCausalLM

    config = AutoConfig.from_pretrained(folder)
    model = with_mtp(Qwen2ForCausalLM(config).to(torch.float32),
                     int(config.num_nextn_predict_layers))
    state: dict[str, Any] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def copying_head(model: Any) -> Any:
    """'Train' the MTP head of `model` into one that drafts what the model itself just
    predicted: the block adds nothing (zero output projections), the projection passes
    the main model's last hidden state through, and the final norm is the main model's.
    Its draft is accepted exactly where the model repeats its previous token, so its
    acceptance is neither zero nor total on a random model that repeats itself: a count
    that tells this head from a random one."""
    import torch

    h = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.mtp_layers:
            layer.token_layernorm.weight.fill_(1.0)
            layer.hidden_layernorm.weight.fill_(1.0)
            layer.input_proj.weight.zero_()
            layer.input_proj.weight[:, :h].copy_(torch.eye(h))  # [hidden, token] in vLLM
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            layer.final_layernorm.weight.copy_(model.model.norm.weight)
    return model

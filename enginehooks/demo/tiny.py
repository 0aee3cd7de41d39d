"""Tiny Hugging Face checkpoints built offline: what `enginehooks demo` starts an engine
on, and what the tests and benchmarks build theirs from (`enginehooks_testkit.tiny`).

Shipped in the wheel for the demo. No model hub is needed: these are real Llama / Qwen2
checkpoints with random weights and a word-level tokenizer over a small vocabulary (the
engines only need a real architecture). vLLM's CPU attention needs head_dim >= 32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from enginehooks.core.errors import ConfigError


def save_tokenizer(folder: str | os.PathLike[str], vocab_size: int = 256) -> None:
    """A word-level tokenizer over `vocab_size` ids (prompts are token ids anyway)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(folder)


def save_tiny(folder: str | os.PathLike[str], config: Any, *, model_class: str | None = None,
              seed: int = 0, dtype: str = "float32") -> Path:
    """Build a random model of `config` (its AutoModelForCausalLM class, or the
    transformers class named `model_class`), save it and a tokenizer into `folder`.
    Every floating parameter and persistent buffer is drawn from N(0, 0.2)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if model_class is None:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = getattr(transformers, model_class)._from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    save_tokenizer(folder, getattr(text, "vocab_size", 256))
    return folder


def make_tiny_model(
    folder: str | os.PathLike[str],
    *,
    arch: str = "llama",
    vocab_size: int = 256,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A random tiny Llama or Qwen2 (qkv bias) checkpoint with its tokenizer."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads, max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, dtype=dtype,
    )
    config: Any
    if arch == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(**common)
    elif arch == "qwen2":
        from transformers import Qwen2Config

        config = Qwen2Config(**common)
    else:
        raise ConfigError(f"unknown tiny architecture {arch!r} (llama or qwen2)")
    return save_tiny(folder, config, seed=seed, dtype=dtype)


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt with HF transformers: the reference output."""
    import torch

    outs = []
    model.eval()
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
            )
            outs.append(y[0, len(ids):].tolist())
    return outs

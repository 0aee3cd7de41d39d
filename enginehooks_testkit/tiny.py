"""Tiny Hugging Face models for the tests and benchmarks: the two checkpoints every engine
test uses, the trainer side's fp32 load of one, and a reproducible "training" step.

The checkpoints themselves come from `enginehooks.demo.tiny` (the demo builds its model
the same way, and ships in the wheel); re-exported here so tests import one place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from enginehooks.demo.tiny import hf_greedy, make_tiny_model, save_tiny, save_tokenizer

__all__ = ["hf_greedy", "load_tiny", "make_test_models", "make_tiny_model", "perturb", "save_tiny",
           "save_tokenizer", "step_in_place"]


def make_test_models(root: str | os.PathLike[str]) -> dict[str, Path]:
    """The two checkpoints every engine test uses: a Llama (untied) and a Qwen2 with qkv
    bias and tied embeddings (the layout where a stale output head hides)."""
    root = Path(root)
    return {
        "llama": make_tiny_model(root / "llama", arch="llama", seed=0),
        "qwen2": make_tiny_model(root / "qwen2", arch="qwen2", tie_word_embeddings=True, seed=1),
    }


def load_tiny(path: str | os.PathLike[str]) -> Any:
    """The HF model of a tiny checkpoint in fp32: the trainer side of a test."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def perturb(model: Any, seed: int, scale: float = 0.3) -> Any:
    """'Train' a model: a reproducible change to every floating weight (parameters and
    persistent buffers, such as a router's correction bias)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * scale)
    return model


def step_in_place(model: Any, state: dict[str, Any]) -> None:
    """A training step's effect on `model`: `state`'s values written into its own
    parameters, as an optimizer step writes them (the same parameter objects, at the
    same addresses: what lets a push reuse a prepared layout). A sharded parameter
    (FSDP2's `DTensor`) takes its shard of the value."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            value = state[name]
            if isinstance(p, DTensor):
                value = distribute_tensor(value, p.device_mesh, p.placements)
            p.copy_(value)

"""Apply an update through the engine's fresh-load path when its loader cannot take it
in place, then copy the freshly loaded state into the live model's own storage.

Some loaders change the model they load into. SGLang's MiniCPM3 `load_weights` derives
each layer's `w_kc` / `w_vc` from its `kv_b_proj` and then deletes `kv_b_proj`, so the
same loader run again (SGLang's own `update_weights_from_disk` as much as ours) looks
the parameter up, raises `KeyError` and leaves the layers it already wrote on the new
weights. That is observed, not looked up by model name: `needs_fresh_load` compares
where the engine's loader puts the update's tensors (its dry run on the engine's own
skeleton) with the parameters the live model still has. Where the loader needs one the
live model lost, the engine builds a fresh model from the update with its own
fresh-load path (the oracle's path by definition), and `transplant` copies every tensor
the live model's forward reads (parameters, buffers and plain tensor attributes such
as `w_kc`) from it, after checking that every one has a counterpart of the same shape
and dtype: nothing is written unless all of it can be.

A fresh load needs the whole model: `LoaderExpectations` already refuses, before any
byte moves, an update that covers any engine parameter less than the engine's own
checkpoint did (engines reload whole layers), so every update it lets through is whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from enginehooks.core.errors import ManifestError


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a module's forward can read by attribute: parameters, buffers, and
    plain tensor attributes (tensors a loader computed and assigned, like MLA's
    `w_kc`), by every name under which a module holds them."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                out[dot + name] = p
        for name, b in module._buffers.items():
            if b is not None:
                out[dot + name] = b
        for name, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not name.startswith("_"):
                out[dot + name] = v
    return out


def removed_parameters(live: torch.nn.Module, skeleton_names: Iterable[str]) -> set[str]:
    """Parameters the engine's model class has (its skeleton) that the live model no
    longer has: its loader or post-load processing removed them after the first load."""
    have = {n for n, _ in live.named_parameters(remove_duplicate=False)}
    return {n for n in skeleton_names if n not in have}


def needs_fresh_load(landed: Iterable[str], removed: set[str]) -> list[str]:
    """The removed parameters the loader would write this update into (sorted): the
    loader cannot run on the live model for them."""
    return sorted(set(landed) & removed)


def transplant(fresh: torch.nn.Module, live: torch.nn.Module) -> int:
    """Copy every state tensor of `fresh` into the same-named tensor of `live`, in
    place (storage, and so any pointer the engine captured, is kept). Every live
    tensor must have a counterpart of its shape and dtype, or nothing is written.
    Returns the bytes copied."""
    src, dst = state_tensors(fresh), state_tensors(live)
    problems = []
    for name, t in dst.items():
        f = src.get(name)
        if f is None:
            problems.append(f"{name!r}: the fresh load has no such tensor")
        elif tuple(f.shape) != tuple(t.shape) or f.dtype != t.dtype:
            problems.append(
                f"{name!r}: the fresh load made {f.dtype} {list(f.shape)}, the live "
                f"model holds {t.dtype} {list(t.shape)}"
            )
    extra = sorted(set(src) - set(dst))
    if extra:
        problems.append(f"the fresh load has tensors the live model lacks: {extra[:3]}")
    if problems:
        raise ManifestError(
            "the fresh load cannot replace the live weights (nothing was written): " + "; ".join(problems[:5])
        )
    copied, done = 0, set()
    with torch.no_grad():
        for name, t in dst.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
            if key in done:  # the same tensor under another name (tied, shared)
                continue
            done.add(key)
            t.copy_(src[name])
            copied += t.nbytes
    return copied

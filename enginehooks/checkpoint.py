"""What a model expects, read from the checkpoint it was loaded from.

Engines fuse and repack weights (qkv, gate_up, CPU prepacking), so the model's own
parameters do not say which HF-format tensors an update must carry. The checkpoint's
safetensors headers do, exactly, and reading them touches no tensor data.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from enginehooks.errors import ManifestError
from enginehooks.manifest import DTYPE_SIZES, TensorSpec

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def resolve_model_dir(model: str) -> Path:
    """A local folder for `model`: the path itself, or its snapshot in the HF cache."""
    p = Path(model)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as e:
        raise ManifestError(f"cannot find the checkpoint of {model!r} locally: {e}") from e


def checkpoint_specs(
    model_dir: str | os.PathLike[str], *, engine_dtype: str, tie_word_embeddings: bool = False
) -> dict[str, TensorSpec]:
    """HF name -> spec for every tensor in the folder's safetensors files.

    Floating tensors are expected in `engine_dtype` (what the engine runs and what the
    trainer must send); other dtypes as stored. With tied embeddings, `lm_head.weight`
    is expected too: engines that keep a separate output head need it sent.
    """
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ManifestError(f"no *.safetensors in {folder}: cannot validate updates against it")
    specs: dict[str, TensorSpec] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = st.get_slice(name)
                stored = _ST_DTYPES.get(sl.get_dtype(), "")
                if stored not in DTYPE_SIZES:
                    continue
                floating = stored.startswith(("float", "bfloat"))
                dtype = engine_dtype if floating and not stored.startswith("float8") else stored
                specs[name] = TensorSpec(name, dtype, tuple(sl.get_shape()))
    emb = specs.get("model.embed_tokens.weight")
    if tie_word_embeddings and "lm_head.weight" not in specs and emb is not None:
        specs["lm_head.weight"] = TensorSpec("lm_head.weight", emb.dtype, emb.shape)
    return specs


def readable_digests(
    params: Mapping[str, torch.Tensor], expected: Mapping[str, TensorSpec], names: Iterable[str]
) -> dict[str, Any]:
    """crc32 of the engine parameters that kept their checkpoint layout (embeddings,
    norms; fused or prepacked ones are skipped), for bit-exact checks that move no
    tensor. A vocabulary padded by the engine is compared on the checkpoint's rows."""
    from enginehooks.dtypes import dtype_name

    out: dict[str, Any] = {}
    for name in names:
        p, spec = params.get(name), expected.get(name)
        if p is None or spec is None or p.dim() != len(spec.shape):
            continue
        if tuple(p.shape[1:]) != tuple(spec.shape[1:]) or p.shape[0] < spec.shape[0]:
            continue
        data = p.detach()[: spec.shape[0]].contiguous().cpu()
        out[name] = {
            "dtype": dtype_name(data.dtype),
            "shape": list(data.shape),
            "crc32": zlib.crc32(data.reshape(-1).view(torch.uint8).numpy()),
        }
    return out

"""Names <-> torch dtypes, kept apart so the manifest itself never needs torch."""

from __future__ import annotations

import torch

from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import DTYPE_SIZES


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ManifestError(f"dtype {dtype} cannot travel in a manifest")
    return name


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPE_SIZES:
        raise ManifestError(f"unsupported dtype {name!r}")
    return getattr(torch, name)

"""Bucket digests, by name, so that a manifest can say which one its sender used.

Digests exist to catch silent corruption on the data plane (peers have shipped weights
torn by a missing stream sync, or overwritten by a transport's own magic bytes), so
receivers verify each bucket before applying it. `crc32` runs on the host; on a GPU
buffer it costs a device-to-host copy, which `sum64` avoids.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from enginehooks.errors import ManifestError

_MASK64 = (1 << 64) - 1


def _crc32(buf: torch.Tensor) -> int:
    if buf.device.type != "cpu":
        buf = buf.cpu()
    return zlib.crc32(buf.numpy())


def _sum64(buf: torch.Tensor) -> int:
    """Position-weighted sum of 32-bit words, computed where the buffer lives.

    Weighting by position catches swapped or shifted runs that a plain sum would miss.
    Integer overflow wraps, which is fine for a digest.
    """
    n = buf.numel()
    pad = (-n) % 4
    if pad:
        buf = torch.cat([buf, buf.new_zeros(pad)])
    words = buf.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(1, words.numel() + 1, device=buf.device, dtype=torch.int64)
    total = int((words * (weights % 65521 + 1)).sum().item())
    return (total ^ (n << 40)) & _MASK64


CHECKSUMS: dict[str, Callable[[torch.Tensor], int]] = {"crc32": _crc32, "sum64": _sum64}


def digest(name: str | None, buf: torch.Tensor) -> int:
    """Digest of a 1-D uint8 tensor with the named algorithm; 0 when `name` is None."""
    if name is None:
        return 0
    try:
        fn = CHECKSUMS[name]
    except KeyError:
        raise ManifestError(
            f"unknown checksum {name!r}; known: {sorted(CHECKSUMS)} or null"
        ) from None
    return fn(buf) & _MASK64


def check_name(name: str | None) -> None:
    if name is not None and name not in CHECKSUMS:
        raise ManifestError(f"unknown checksum {name!r}; known: {sorted(CHECKSUMS)} or null")

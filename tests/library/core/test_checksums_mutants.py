"""Tests that kill the mutants `make mutants` found surviving in core/checksums.py
(docs/testing.md): `sum64` against an independent numpy reference of its definition, at
every tail length, across the torch path's chunk boundary, and from an unaligned view."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginehooks.core import checksums
from enginehooks.core.checksums import digest


def reference_sum64(data: bytes) -> int:
    """The docstring's definition: zero-pad to little-endian 32-bit words w_i, then
    (sum_i w_i * (((i + 1) % 65521) + 1) mod 2**64) XOR (nbytes << 40)."""
    n = len(data)
    padded = data + b"\0" * (-n % 4)
    words = np.frombuffer(padded, dtype="<u4").astype(np.uint64)
    weights = (np.arange(1, len(words) + 1, dtype=np.uint64) % np.uint64(65521)) + np.uint64(1)
    with np.errstate(over="ignore"):
        total = int((words * weights).sum(dtype=np.uint64))
    return (total ^ (n << 40)) & ((1 << 64) - 1)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 6, 7, 8, 65521 * 4 + 3])
def test_sum64_matches_its_definition_at_every_tail_length(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    buf[-3:] = 255  # tail bytes with the high bits set
    assert digest("sum64", buf) == reference_sum64(buf.numpy().tobytes())


def test_sum64_across_the_chunk_boundary_and_from_an_unaligned_view(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksums, "_CHUNK_WORDS", 65521 * 2)
    monkeypatch.setattr(checksums, "_weights", {})
    g = torch.Generator().manual_seed(1)
    whole = torch.randint(0, 256, (65521 * 2 * 4 * 2 + 11,), dtype=torch.uint8, generator=g)
    for offset in (1, 4, 5):  # storage offsets 1 and 5 are not 4-byte aligned
        view = whole[offset:]
        assert digest("sum64", view) == reference_sum64(view.numpy().tobytes())
    assert digest("sum64", whole) == reference_sum64(whole.numpy().tobytes())

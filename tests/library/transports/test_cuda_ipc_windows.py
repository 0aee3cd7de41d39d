"""How `cuda_ipc` single copy cuts an update into doorbell windows (`doorbell_windows`),
on the host: the rule alone, from real manifests (`core.manifest.plan`). The windows'
landing, bit for bit, runs on a GPU (`tests/gpu/test_cuda_ipc_doorbell.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.transports.cuda_ipc import _layout, doorbell_windows


def manifest(shapes: list[int], bucket_bytes: int) -> Any:
    return plan([TensorSpec(f"t{i}", "float32", (n,)) for i, n in enumerate(shapes)],
                weight_version=1, bucket_bytes=bucket_bytes, checksum="sum64")


def windows(m: Any, window_bytes: int | None = None,
            window_tensors: int | None = None) -> list[tuple[int, int]]:
    """The sender's windows, with its defaults (`CudaIpcSender(window_bytes=None,
    window_tensors=None)`)."""
    return doorbell_windows(m, window_bytes, window_tensors)


def covers(ws: list[tuple[int, int]], n: int) -> bool:
    """Consecutive, non-empty, from bucket 0 to the last."""
    return (ws[0][0] == 0 and ws[-1][1] == n and all(a < b for a, b in ws)
            and all(ws[i][1] == ws[i + 1][0] for i in range(len(ws) - 1)))


def test_by_default_a_push_is_one_doorbell() -> None:
    m = manifest([64] * 3000, bucket_bytes=4096)  # 16 tensors a bucket
    assert windows(m) == [(0, len(m.buckets))]


@pytest.mark.parametrize("cap", [1, 3, 7, 64])
def test_windows_close_at_a_bucket_end_once_they_hold_the_tensor_count(cap: int) -> None:
    # 4 tensors of 1 KiB per 4 KiB bucket, one tensor of 10 KiB cut across three
    m = manifest([256] * 37 + [2560] + [256] * 50, bucket_bytes=4096)
    n, starts = len(m.buckets), _layout(m).starts_in
    ws = windows(m, window_tensors=cap)
    assert covers(ws, n)
    counts = [sum(len(starts[k]) for k in range(a, b)) for a, b in ws]
    for (a, b), c in zip(ws[:-1], counts[:-1], strict=True):
        # each closed window reached the count only with its last bucket
        assert c >= cap and c - len(starts[b - 1]) < cap, (a, b, c)
    assert len(ws) > 1


def test_bytes_and_tensors_bound_a_window_together() -> None:
    m = manifest([256] * 200, bucket_bytes=4096)  # 50 buckets of 4 tensors
    n = len(m.buckets)
    by_bytes = windows(m, window_bytes=3 * 4096, window_tensors=None)
    assert covers(by_bytes, n) and all(b - a <= 3 for a, b in by_bytes)
    both = windows(m, window_bytes=3 * 4096, window_tensors=8)
    assert covers(both, n) and all(b - a <= 2 for a, b in both)  # 8 tensors: 2 buckets

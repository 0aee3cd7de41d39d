"""`trainer_side/fsdp.py` `FSDP2Shards` (issue 40): what each trainer rank holds, read from
the DTensors' placements, and the refusals of layouts it does not derive (a mesh of one
rank in this process; two FSDP2 ranks run in tests/multihost/test_shard_direct.py)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from enginehooks.core.errors import ConfigError
from enginehooks.core.schedule import Slice, Transfer
from enginehooks.trainer_side.fsdp import FSDP2Shards


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0,
                            world_size=1, timeout=_dt.timedelta(seconds=10))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _module(**params: torch.Tensor) -> nn.Module:
    m = nn.Module()
    for n, t in params.items():
        m.register_parameter(n, nn.Parameter(t))
    return m


def _dtensor(t: torch.Tensor, mesh: object, placement: object) -> nn.Parameter:
    from torch.distributed.tensor import distribute_tensor

    return nn.Parameter(distribute_tensor(t, mesh, [placement]))  # type: ignore[arg-type]


def test_holdings_and_bytes_of_shard0_and_replicated_tensors(mesh: object) -> None:
    from torch.distributed.tensor import Replicate, Shard

    w, b = torch.arange(12.0).reshape(4, 3), torch.arange(3.0)
    m = _module(w=_dtensor(w, mesh, Shard(0)), b=_dtensor(b, mesh, Replicate()))
    shards = FSDP2Shards(m)
    assert shards.holds() == {0: [Slice("w", 0, 48), Slice("b", 0, 12)]}
    got = shards.source(Transfer(0, 0, "w", 12, 36))
    assert torch.equal(got, w.reshape(-1).view(torch.uint8)[12:36])
    # the wire dtype: bytes of the cast shard
    half = FSDP2Shards(m, dtype=torch.bfloat16)
    assert half.holds()[0][0] == Slice("w", 0, 24)
    assert torch.equal(half.source(Transfer(0, 0, "w", 0, 24)),
                       w.to(torch.bfloat16).reshape(-1).view(torch.uint8))
    with pytest.raises(ConfigError, match=r"holds no bytes \[40, 52\) of 'w'"):
        shards.source(Transfer(0, 0, "w", 40, 52))
    with pytest.raises(ConfigError, match="holds no bytes"):
        shards.source(Transfer(0, 0, "x", 0, 4))


def test_a_cast_segment_is_never_kept_across_calls(mesh: object) -> None:
    """`segments` casts anew on every call: a kept instance must never send the bytes of
    before an optimizer step, and a step may write the shard by routes no version
    counter sees (here `.data`, which leaves both the DTensor's and the local tensor's
    counters as they were). Keeping the cast per instance fails this test."""
    from torch.distributed.tensor import Shard

    w = torch.arange(12.0).reshape(4, 3)
    m = _module(w=_dtensor(w, mesh, Shard(0)))
    half = FSDP2Shards(m, dtype=torch.bfloat16)
    (a, b, first), = half.segments("w")
    assert (a, b) == (0, 24)
    assert torch.equal(first, w.to(torch.bfloat16).reshape(-1).view(torch.uint8))
    with torch.no_grad():
        m.w.data.add_(1.0)  # an in-place step the version counters do not see
    (_, _, second), = half.segments("w")
    want = (w + 1).to(torch.bfloat16).reshape(-1).view(torch.uint8)
    assert torch.equal(second, want)
    assert torch.equal(half.source(Transfer(0, 0, "w", 0, 24)), want)
    assert half.segments("x") == []


def test_layouts_it_does_not_derive_are_refused_by_name(mesh: object) -> None:
    from torch.distributed.tensor import Shard

    with pytest.raises(ConfigError, match="w: not a DTensor"):
        FSDP2Shards(_module(w=torch.zeros(4, 2)))
    with pytest.raises(ConfigError, match=r"w: placement S\(1\); shard-direct takes"):
        FSDP2Shards(_module(w=_dtensor(torch.zeros(4, 2), mesh, Shard(1))))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    two = init_device_mesh("cpu", (1, 1))
    hsdp = nn.Parameter(distribute_tensor(torch.zeros(4, 2), two, [Replicate(), Shard(0)]))
    with pytest.raises(ConfigError, match="w: a 2-D mesh"):
        FSDP2Shards(_module(w=hsdp))


def test_a_local_shard_other_than_shard0s_is_refused(mesh: object) -> None:
    from torch.distributed.tensor import Shard

    m = _module(w=_dtensor(torch.zeros(4, 2), mesh, Shard(0)))
    shards = FSDP2Shards(m)
    shards.local["w"] = torch.zeros(3, 2)  # not the rows Shard(0) gives this rank
    with pytest.raises(ConfigError, match="this rank's shard has 24 bytes, not the 32"):
        shards.source(Transfer(0, 0, "w", 0, 8))

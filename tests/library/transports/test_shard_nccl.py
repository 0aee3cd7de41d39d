"""The `shard_nccl` transport (`transports/shard_direct.py`, issue 40): shard-direct over
NCCL, chosen by name as `nccl` is next to `gloo`. On the host, what decides the path:
its registration and defaults (a device digest, `nccl`'s buckets for the broadcast it
falls back to), the endpoint its receivers read as NCCL groups, a receiver refused on a
device that is not a GPU, and the walk's backend test (`_is_nccl`: a gloo group posts
tagged messages one by one). The NCCL run itself: tests/gpu/test_shard_direct_gpu.py."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import enginehooks.transports.shard_direct as sd
from enginehooks.core.errors import TransportError
from enginehooks.plugins import get_transport


def test_shard_nccl_is_registered_with_the_gpu_defaults() -> None:
    t = get_transport("shard_nccl")
    assert isinstance(t, sd.ShardNcclTransport)
    assert t.schedules and t.several_senders
    assert t.default_checksum == "sum64"  # digested on the device
    assert t.default_bucket_bytes == get_transport("nccl").default_bucket_bytes
    assert get_transport("shard").default_checksum == "xxh3"  # gloo's unchanged


def test_its_endpoint_is_read_as_nccl_groups_and_the_shard_ones_as_gloo() -> None:
    ep = {"transport": "shard_nccl", "host": "h", "senders": [
        {"transport": "shard_nccl", "host": "h"}, {"transport": "shard_nccl", "host": "h"}]}
    inner = sd._inner_endpoint(ep)
    assert inner["transport"] == "nccl"
    assert {e["transport"] for e in inner["senders"]} == {"nccl"}
    assert sd._inner_endpoint({**ep, "transport": "shard"})["transport"] == "gloo"


def test_a_receiver_on_a_device_that_is_no_gpu_is_refused() -> None:
    ep = {"transport": "shard_nccl", "host": "127.0.0.1", "port": 1, "group": "g",
          "world_size": 2, "timeout_s": 5}
    with pytest.raises(TransportError, match="receives on a CUDA device, not cpu"):
        get_transport("shard_nccl").receiver(ep, 1, torch.device("cpu"))


def test_a_gloo_group_is_not_taken_for_nccl(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    pg = dist.ProcessGroupGloo(store, 0, 1, _dt.timedelta(seconds=10))
    assert sd._is_nccl(pg) is False

"""`transports/shard_direct.py` (issue 40): a range's buffer that is not its bytes is
refused before anything is posted. The sends and receives themselves, and the digests
per range, run between processes in tests/multihost/test_shard_direct.py."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from enginehooks.core.errors import TransportError
from enginehooks.core.schedule import Transfer
from enginehooks.transports.shard_direct import receive_shards, send_shards


@pytest.fixture
def group(tmp_path: Path) -> Iterator[object]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    pg = dist.ProcessGroupGloo(store, 0, 1, _dt.timedelta(seconds=10))
    yield pg


@pytest.mark.parametrize("buf", [torch.zeros(8, dtype=torch.uint8),
                                 torch.zeros(4, dtype=torch.float32),
                                 torch.zeros(32, dtype=torch.uint8)[::2]])
def test_a_buffer_that_is_not_the_ranges_bytes_is_refused(group: object,
                                                          buf: torch.Tensor) -> None:
    ts = [Transfer(0, 0, "w", 0, 16)]
    with pytest.raises(TransportError, match="not its 16 contiguous bytes"):
        send_shards(group, ts, 0, lambda t: buf, senders=1, mid=1)
    with pytest.raises(TransportError, match="not 16 contiguous bytes"):
        receive_shards(group, ts, 0, lambda t: buf, senders=1, mid=1)

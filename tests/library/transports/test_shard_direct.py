"""`transports/shard_direct.py` (issue 40): ranges sent point to point over gloo (two
ranks of one process here; between processes in tests/multihost/test_shard_direct.py),
each checked by its digest, keyed and bound to the update with a secret; a range's
buffer that is not its bytes is refused before anything is posted."""

from __future__ import annotations

import datetime as _dt
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import enginehooks.transports.shard_direct as sd
from enginehooks.core.errors import ChecksumError, TransportError
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


def _pair(tmp_path: Path) -> tuple[object, object]:
    store = dist.FileStore(str(tmp_path / "pair"), 2)
    out: list[object] = [None, None]

    def make(rank: int) -> None:
        out[rank] = dist.ProcessGroupGloo(store, rank, 2, _dt.timedelta(seconds=20))

    t = threading.Thread(target=make, args=(1,))
    t.start()
    make(0)
    t.join()
    return out[0], out[1]


@pytest.mark.parametrize(("secret", "mid_seen", "flip", "ok"), [
    (None, 7, False, True), (b"k" * 32, 7, False, True),
    (None, 7, True, False),            # a changed byte: the digest differs
    (b"k" * 32, 7, True, False),
    (b"k" * 32, 8, False, False),       # keyed: bound to the update (another update's id)
])
@pytest.mark.parametrize("pack_below", [0, 1 << 18])  # each range a message; all packed
def test_ranges_arrive_and_each_is_checked_by_its_digest(
        tmp_path: Path, secret: bytes | None, mid_seen: int, flip: bool, ok: bool,
        pack_below: int) -> None:
    sender, receiver = _pair(tmp_path)
    data = torch.arange(64, dtype=torch.uint8)
    ts = [Transfer(0, 0, "w", 0, 16), Transfer(0, 0, "w", 32, 64)]
    got = torch.zeros(64, dtype=torch.uint8)
    seal = sd._seal

    def corrupting(key: bytes | None, mid: int, index: int, buf: torch.Tensor,
                   checksum: str | None) -> tuple[int, int]:
        out = seal(key, mid, index, buf, checksum)
        if flip and index == 1:
            buf[3] ^= 1  # after its digest was taken
        return out

    def send() -> None:
        send_shards(sender, ts, 0, lambda t: data[t.start:t.stop].clone(), senders=1, mid=7,
                    secret=secret, timeout_s=20, pack_below=pack_below)

    sd._seal = corrupting  # type: ignore[assignment]
    try:
        th = threading.Thread(target=send)
        th.start()
        try:
            if ok:
                n = receive_shards(receiver, ts, 0, lambda t: got[t.start:t.stop], senders=1,
                                   mid=mid_seen, secret=secret, timeout_s=20,
                                   pack_below=pack_below)
                assert n == 48
                assert torch.equal(got[:16], data[:16]) and torch.equal(got[32:], data[32:])
            else:
                with pytest.raises(ChecksumError, match=r"bytes \[32, 64\) of 'w' from trainer "
                                   r"rank 0" if flip else r"bytes \[0, 16\)"):
                    receive_shards(receiver, ts, 0, lambda t: got[t.start:t.stop], senders=1,
                                   mid=mid_seen, secret=secret, timeout_s=20,
                                   pack_below=pack_below)
        finally:
            th.join()
    finally:
        sd._seal = seal  # type: ignore[assignment]

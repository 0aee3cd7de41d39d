"""Corrupted bytes on the wire and on disk are refused before they are applied.

Issue 26 found that deleting the gloo receiver's digest check or the disk transport's
shard checksum left every test green. These tests corrupt bytes after the sender
computed their digest and assert the refusal; each was checked to fail with the
protective line removed (named in each test).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from enginehooks import WeightSync
from enginehooks.core.errors import ChecksumError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.transports import broadcast
from enginehooks.transports.base import Abort, Target
from enginehooks.transports.disk import DiskReceiver, DiskSender, shard_name


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 8))


def corrupting_pack(real: Callable[..., Iterator[tuple[int, torch.Tensor]]], bucket: int
                    ) -> Callable[..., Iterator[tuple[int, torch.Tensor]]]:
    """`core.buckets.pack`, then one payload byte of `bucket` flipped after it was sealed
    (its digest and trailer MAC computed): bytes torn on the wire, as the receiver sees
    them. Test-only fault injection into the real sender, not a stand-in for it."""

    def pack(manifest: Manifest, stream: Iterable[tuple[str, torch.Tensor]],
             next_buffer: Callable[[int], torch.Tensor], secret: bytes | None = None
             ) -> Iterator[tuple[int, torch.Tensor]]:
        for index, buf in real(manifest, stream, next_buffer, secret):
            if index == bucket:
                buf[3] ^= 0x5A
            yield index, buf

    return pack


@pytest.mark.parametrize("checksum", ["xxh3", "crc32", "sum64"])
def test_a_corrupting_gloo_sender_is_refused_and_the_trainer_hears_why(
        monkeypatch: pytest.MonkeyPatch, checksum: str) -> None:
    """Protective line: `unpacker.verify_digest(index, buf)` in
    `BroadcastReceiver.stream` (transports/broadcast.py); without it the corrupted
    bucket is applied, the push succeeds and the engine ends `current` on wrong bytes."""
    monkeypatch.setattr(broadcast, "pack", corrupting_pack(broadcast.pack, bucket=1))
    engine = LocalEngine(net(0), name="r0")
    trainer = net(1)
    with WeightSync("gloo", timeout_s=10, bucket_bytes=4096, checksum=checksum) as sync:
        sync.add_replica(engine)
        # The trainer hears why, as the engine's ChecksumError (issue 19: it arrived as
        # a ReplicaError), naming the replica, the bucket and both digests.
        with pytest.raises(ChecksumError,
                           match=rf"r0.*bucket 1: {checksum} 0x[0-9a-f]+ != sender's 0x") as got:
            sync.push(trainer, version=1)
        assert got.value.replica == "r0"
    assert engine.side.state == "torn" and engine.side.version is None
    assert "ChecksumError" in (engine.side.last_error or "")


class Keep(Target):
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.got = {n: t.clone() for n, t in tensors}


def _disk_push(root: Path, version: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
    ws = {f"w{i}": torch.randn(32, 32) for i in range(4)}
    m = plan([TensorSpec(n, "float32", (32, 32)) for n in ws], weight_version=version,
             bucket_bytes=8192, checksum="crc32")
    stats = DiskSender(root=root).send(m, iter(ws.items()), Abort())
    assert stats.manifest is not None
    return stats.manifest, ws


@pytest.mark.parametrize("how", ["flip a byte", "truncate", "swap shards"])
def test_a_tampered_disk_shard_is_refused_before_loading(tmp_path: Path, how: str) -> None:
    """Protective line: `if got != b.checksum: raise ChecksumError(...)` in
    `DiskReceiver.verify`; without it the receiver loads the tampered shard."""
    m, _ws = _disk_push(tmp_path, 1)
    folder = tmp_path / "v1"
    total = len(m.buckets)
    assert total > 1
    shard = folder / shard_name(1, total)
    if how == "flip a byte":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0x01  # in the tensor data, past the safetensors header
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard.write_bytes(shard.read_bytes()[:-4])
    else:  # two valid shards exchanged: each file is intact, neither is where it belongs
        other = folder / shard_name(0, total)
        a, b = shard.read_bytes(), other.read_bytes()
        shard.write_bytes(b)
        other.write_bytes(a)
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    receiver.connect()
    target = Keep()
    with pytest.raises(ChecksumError, match=r"model-0000[12]-of-.*crc32:.* != crc32:"):
        receiver.deliver(m, target)
    assert target.got == {}  # nothing was loaded


def test_an_untampered_disk_push_loads_bit_exact(tmp_path: Path) -> None:
    m, ws = _disk_push(tmp_path, 2)
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    target = Keep()
    receiver.deliver(m, target)
    assert all(torch.equal(target.got[n], t) for n, t in ws.items())


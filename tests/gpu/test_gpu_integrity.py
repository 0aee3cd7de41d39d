"""Corrupted bytes on NCCL are refused before they are applied (issue 26).

The gloo version of this test is `tests/library/transports/test_integrity.py`; NCCL
shares the receiver (`BroadcastReceiver.stream`, whose `unpacker.verify_digest` is the
protective line) but moves device buffers, so it gets its own run on two GPUs. The
sender is the real one with one payload byte flipped after its bucket was sealed
(`corrupting_pack`): test-only fault injection, not a stand-in.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from enginehooks import WeightSync
from enginehooks.core.errors import ChecksumError
from enginehooks.engine.local import LocalEngine
from enginehooks.transports import broadcast
from tests.library.transports.test_integrity import corrupting_pack

pytestmark = pytest.mark.gpu

two_gpus = pytest.mark.skipif(
    (torch.cuda.device_count() if torch.cuda.is_available() else 0) < 2,
    reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU)")


def net(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 8)).to(device)


@two_gpus
@pytest.mark.parametrize("checksum", ["sum64", "crc32"])
def test_a_corrupting_nccl_sender_is_refused_and_the_next_push_is_exact(
        monkeypatch: pytest.MonkeyPatch, checksum: str) -> None:
    """Without `unpacker.verify_digest` the flipped byte is applied and the engine ends
    `current` on wrong bytes; with it the push fails with the engine's ChecksumError,
    the engine is `torn`, and a clean push afterwards lands bit for bit."""
    sender_dev, engine_dev = torch.device("cuda", 0), torch.device("cuda", 1)
    replica = net(0, engine_dev)
    engine = LocalEngine(replica, name="r0", device=engine_dev)
    trainer = net(1, sender_dev)
    real = broadcast.pack
    monkeypatch.setattr(broadcast, "pack", corrupting_pack(real, bucket=1))
    with WeightSync("nccl", timeout_s=60, bucket_bytes=4096, checksum=checksum,
                    device=sender_dev) as sync:
        sync.add_replica(engine)
        with pytest.raises(ChecksumError, match=rf"r0.*bucket 1: {checksum} 0x"):
            sync.push(trainer, version=1)
        assert engine.side.state == "torn" and engine.side.version is None
        monkeypatch.setattr(broadcast, "pack", real)
        sync.push(trainer, version=2)
        torch.cuda.synchronize()
    assert engine.side.state == "current" and engine.side.version == 2
    for (name, a), b in zip(trainer.state_dict().items(), replica.state_dict().values(),
                            strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name

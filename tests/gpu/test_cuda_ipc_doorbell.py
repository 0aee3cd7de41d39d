"""cuda_ipc single copy as one doorbell per push (issue 37 item 4), on one GPU.

The trainer hands every piece of the update over in one signed ready message; the
engine copies them in one launch and acks once; the trainer's digest is compared after
that ack. In process (`WeightSync` + `LocalEngine`, the real sender and receiver).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from enginehooks import WeightSync
from enginehooks.core.errors import ChecksumError
from enginehooks.engine.local import LocalEngine
from enginehooks.transports.cuda_ipc import CudaIpcSender

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def model(dev: torch.device) -> nn.Module:
    return nn.Sequential(nn.Linear(300, 517), nn.ReLU(), nn.Linear(517, 33),
                         nn.LayerNorm(33)).to(dev)


def pair(**options: Any) -> tuple[nn.Module, nn.Module, WeightSync, LocalEngine]:
    dev = torch.device("cuda", 0)
    torch.manual_seed(3)
    trainer, replica = model(dev), model(dev)
    with torch.no_grad():
        for p in replica.parameters():
            p.zero_()
    sync = WeightSync(transport="cuda_ipc", checksum="sum64", bucket_bytes=1 << 16,
                      timeout_s=60, device=dev, transport_options=options)
    engine = LocalEngine(replica, name="r0", device=dev)
    sync.add_replica(engine)
    return trainer, replica, sync, engine


def same(a: nn.Module, b: nn.Module) -> None:
    for (n, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), n


@pytest.mark.parametrize("options", [{}, {"window_bytes": 1 << 17}, {"window_tensors": 2}],
                         ids=["default", "bytes", "tensors"])
def test_one_doorbell_per_push_lands_bit_exact(monkeypatch: pytest.MonkeyPatch,
                                               options: dict[str, int]) -> None:
    """Acks the sender waits for per push: one per doorbell plus the final digest ack;
    the whole update is one doorbell unless `window_bytes` or `window_tensors` cuts it
    (a model of 6 tensors is below the default's count). Cut, the engine resolves the
    later windows' destinations while it waits and while a window copies (`_Dests`):
    every window still lands bit for bit."""
    waits: list[int] = []
    real = CudaIpcSender._wait_acks

    def counting(self: CudaIpcSender, seq: int, index: int, abort: Any) -> None:
        waits.append(index)
        real(self, seq, index, abort)

    monkeypatch.setattr(CudaIpcSender, "_wait_acks", counting)
    trainer, replica, sync, _ = pair(**options)
    try:
        for v in range(3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p))
            waits.clear()
            sync.push(trainer, version=v)
            torch.cuda.synchronize()
            same(trainer, replica)
            if not options:
                assert waits == [0, 1], waits
            else:
                assert len(waits) >= 3 and waits == list(range(len(waits))), waits
    finally:
        sync.close()


def test_a_byte_the_engine_reads_wrong_ends_the_update_torn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One piece's offset shifted by 4 bytes (a stale or wrong mapping, as the engine
    would read it): its copy and digest disagree with the trainer's digest, compared
    after the ack; the push fails with ChecksumError, the engine is `torn`, never
    `current`, and the next push is exact. Protective line: the comparison of the final
    `digests` message in `CudaIpcReceiver._final` (awaited beside the apply's tail:
    the apply verified what landed, and the update still ends torn)."""
    trainer, replica, sync, engine = pair()
    real = CudaIpcSender._locate_many

    def shifted(self: CudaIpcSender, src: np.ndarray, nbytes: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        aid, off = real(self, src, nbytes)
        off = off.copy()
        off[1] += 4  # inside the allocation: the caching allocator rounds segments up
        return aid, off

    try:
        monkeypatch.setattr(CudaIpcSender, "_locate_many", shifted)
        with pytest.raises(ChecksumError, match=r"sum64 0x[0-9a-f]+ != sender's 0x"):
            sync.push(trainer, version=1)
        assert engine.side.state == "torn" and engine.side.version is None
        monkeypatch.setattr(CudaIpcSender, "_locate_many", real)
        sync.push(trainer, version=2)
        torch.cuda.synchronize()
        assert engine.side.state == "current" and engine.side.version == 2
        same(trainer, replica)
    finally:
        sync.close()

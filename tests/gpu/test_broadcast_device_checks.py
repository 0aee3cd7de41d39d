"""The NCCL path without a host sync per bucket (issue 37 item 3), on two GPUs.

Trailers are written by the device and read back through pinned memory on an arrival
event, digests are compared on the device and read once per push
(`Unpacker.defer_digest` / `Unpacker.finish`), tensors that fill a bucket travel in
direct buckets. Each test drives the real sender and receiver (`WeightSync` with a
`LocalEngine` on the second GPU); faults are injected into the real sender's pack.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch
from torch import nn

from enginehooks import WeightSync
from enginehooks.core.buckets import Unpacker, buffer_bytes, pack
from enginehooks.core.checksums import sum64_tensor
from enginehooks.core.errors import ChecksumError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.engine.local import LocalEngine
from enginehooks.transports import broadcast
from tests.library.transports.test_integrity import corrupting_pack

pytestmark = pytest.mark.gpu

have = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(have < 2, reason="needs 2 CUDA GPUs")
one_gpu = pytest.mark.skipif(have < 1, reason="needs a CUDA GPU")


def net(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    # 64x48 fp32 = 12 KiB: fills 4 KiB buckets (direct); the rest is packed
    return nn.Sequential(nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 8)).to(device)


def recording(real: Callable[..., Iterator[tuple[int, torch.Tensor]]], seen: list[Manifest]
              ) -> Callable[..., Iterator[tuple[int, torch.Tensor]]]:
    def rec(manifest: Manifest, stream: Iterable[tuple[str, torch.Tensor]],
            next_buffer: Callable[[int], torch.Tensor], secret: bytes | None = None
            ) -> Iterator[tuple[int, torch.Tensor]]:
        seen.append(manifest)
        yield from real(manifest, stream, next_buffer, secret)

    return rec


def same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x.cpu(), y.cpu()), name


@two_gpus
@pytest.mark.parametrize("checksum", ["sum64", None])
def test_nccl_direct_and_packed_buckets_land_bit_exact_push_after_push(
        monkeypatch: pytest.MonkeyPatch, checksum: str | None) -> None:
    s, e = torch.device("cuda", 0), torch.device("cuda", 1)
    replica, trainer = net(0, e), net(1, s)
    engine = LocalEngine(replica, name="r0", device=e)
    seen: list[Manifest] = []
    monkeypatch.setattr(broadcast, "pack", recording(broadcast.pack, seen))
    with WeightSync("nccl", timeout_s=60, bucket_bytes=4096, checksum=checksum,
                    device=s) as sync:
        sync.add_replica(engine)
        for v in range(3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p))
            sync.push(trainer, version=v)
            torch.cuda.synchronize()
            same(trainer, replica)
            assert engine.side.state == "current" and engine.side.version == v
    kinds = {b.direct for b in seen[0].buckets}
    assert kinds == {True, False}  # both kinds of bucket travelled


@two_gpus
def test_a_corrupted_direct_bucket_ends_the_update_torn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Protective line: `u.defer_digest(k, payload, ...)` for a landed direct bucket and
    `u.finish()` in `receive_in_order`: without them the flipped byte is applied and the
    engine ends `current` on wrong bytes."""
    s, e = torch.device("cuda", 0), torch.device("cuda", 1)
    replica, trainer = net(0, e), net(1, s)
    engine = LocalEngine(replica, name="r0", device=e)
    real = broadcast.pack
    # bucket 0 is the first piece of the 12 KiB weight: a direct bucket
    monkeypatch.setattr(broadcast, "pack", corrupting_pack(real, bucket=0))
    with WeightSync("nccl", timeout_s=60, bucket_bytes=4096, checksum="sum64",
                    device=s) as sync:
        sync.add_replica(engine)
        with pytest.raises(ChecksumError, match=r"bucket 0: sum64 0x"):
            sync.push(trainer, version=1)
        assert engine.side.state == "torn" and engine.side.version is None
        monkeypatch.setattr(broadcast, "pack", real)
        sync.push(trainer, version=2)
        torch.cuda.synchronize()
    assert engine.side.state == "current" and engine.side.version == 2
    same(trainer, replica)


@two_gpus
def test_a_sender_that_fails_mid_stream_ends_the_receivers_update(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The abort notice reaches a receiver that reads trailers through pinned memory: the
    engine ends `torn` (bytes had landed) with the sender's reason, not a timeout."""
    s, e = torch.device("cuda", 0), torch.device("cuda", 1)
    replica, trainer = net(0, e), net(1, s)
    engine = LocalEngine(replica, name="r0", device=e)
    real = broadcast.pack

    def failing(manifest, stream, next_buffer, secret=None):  # type: ignore[no-untyped-def]
        for index, buf in real(manifest, stream, next_buffer, secret):
            if index == len(manifest.buckets) - 2:
                raise RuntimeError("trainer stream broke")
            yield index, buf

    monkeypatch.setattr(broadcast, "pack", failing)
    with WeightSync("nccl", timeout_s=30, bucket_bytes=4096, checksum="sum64",
                    device=s) as sync:
        sync.add_replica(engine)
        with pytest.raises(RuntimeError, match="trainer stream broke"):
            sync.push(trainer, version=1)
        # the engine's receive ends on its own thread (leaving an NCCL group takes a moment)
        deadline = time.monotonic() + 20
        while engine.side.state == "updating" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.side.state == "torn"
        assert "trainer stream broke" in (engine.side.last_error or "")  # the notice, read
        monkeypatch.setattr(broadcast, "pack", real)
        sync.push(trainer, version=2)
        torch.cuda.synchronize()
    same(trainer, replica)


@one_gpu
def test_deferred_digests_are_read_once_and_a_bad_one_raises() -> None:
    """`Unpacker.finish` compares every deferred digest at once; a bucket whose bytes
    differ from what its trailer announced raises ChecksumError naming it."""
    dev = torch.device("cuda", 0)
    specs = [TensorSpec(f"t{i}", "float32", (700,)) for i in range(6)]
    m = plan(specs, weight_version=1, bucket_bytes=4096, checksum="sum64")
    ws = {f"t{i}": torch.randn(700, device=dev) for i in range(6)}
    bufs = [torch.empty(buffer_bytes(m), dtype=torch.uint8, device=dev)
            for _ in m.buckets]
    sealed = list(pack(m, iter(ws.items()), lambda i: bufs[i]))
    for bad in (None, 2):
        u = Unpacker(m, dev)
        assert u.defer()
        for k, buf in sealed:
            nbytes, dig = u.verify_raw(k, buf[-64:].cpu().view(torch.int64).tolist())
            payload = buf[:nbytes].clone()
            if k == bad:
                payload[5] ^= 1
            u.defer_digest(k, payload, dig)
        if bad is None:
            u.finish()
        else:
            with pytest.raises(ChecksumError, match=r"bucket 2: sum64 0x"):
                u.finish()


@one_gpu
def test_pack_and_deferred_checks_make_no_host_sync_per_bucket() -> None:
    """With `sum64` and no secret, sealing a bucket (fused pack, device-written trailer)
    and checking one (fused landing, deferred digest) never synchronises the host with
    the device: torch's sync debug mode turns any such sync into an error. The one
    read per push is `finish`."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    specs = [TensorSpec(f"t{i}", "bfloat16", (1000, 30)) for i in range(40)]
    m = plan(specs, weight_version=1, bucket_bytes=1 << 18, checksum="sum64")
    ws = {s.name: torch.randn(s.shape, device=dev).to(torch.bfloat16) for s in specs}
    dst = {n: torch.zeros_like(t) for n, t in ws.items()}
    bufs = [torch.empty(buffer_bytes(m), dtype=torch.uint8, device=dev)
            for _ in m.buckets]
    list(pack(m, iter(ws.items()), lambda i: bufs[i]))  # warm-up: kernels, rings
    sum64_tensor(bufs[0])  # its one-time self-check reads a value back
    torch.cuda.synchronize()
    trailers = [b[-64:].cpu().view(torch.int64).tolist() for b in bufs]
    u = Unpacker(m, dev, into=dst.get)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sealed = list(pack(m, iter(ws.items()), lambda i: bufs[i]))
        for k, buf in sealed:
            _n, dig = u.verify_raw(k, trailers[k])
            placed = u.land(k, buf, dig)
            if placed is None:
                u.defer_digest(k, buf[: m.buckets[k].nbytes], dig)
            for name, t in u.unpack(k, buf, verified=True, placed=placed):
                if t.data_ptr() != dst[name].data_ptr():
                    dst[name].copy_(t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    u.finish()
    for n, t in ws.items():
        assert torch.equal(dst[n], t), n

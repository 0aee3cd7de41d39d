"""The fused copy+digest kernel (core/fused_copy.py) against the library's sum64, and
cuda_ipc's single-copy path end to end in one process (WeightSync + LocalEngine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginehooks.core.checksums import _sum64, sum64_tensor
from enginehooks.core.errors import ChecksumError

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _padded_bucket(runs: list[tuple[torch.Tensor, int]], device: torch.device) -> torch.Tensor:
    """The bucket the runs would form when packed at their word offsets, padding zero."""
    end = max(wb * 4 + r.numel() for r, wb in runs)
    buf = torch.zeros(end, dtype=torch.uint8, device=device)
    for r, wb in runs:
        buf[wb * 4: wb * 4 + r.numel()] = r
    return buf


@needs_gpu
def test_fused_copy_digest_equals_sum64_of_the_padded_bucket() -> None:
    from enginehooks.core import fused_copy

    dev = torch.device("cuda", 0)
    assert fused_copy.available(dev), fused_copy._state_reason
    g = torch.Generator().manual_seed(11)
    for trial in range(6):
        sizes = [int(s) for s in torch.randint(1, 3 * fused_copy.CHUNK_BYTES, (5,), generator=g)]
        sizes += [1, 2, 3, 4, 5, 64, 4 * 2048 + 3]
        runs, wb = [], 7 * trial
        for s in sizes:
            runs.append((torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g).to(dev), wb))
            wb += (s + 63) // 64 * 16  # 64-byte aligned offsets, as a manifest lays pieces
        dsts = [torch.full_like(r, 0xA5) for r, _ in runs]  # poisoned: every byte must be written
        src = np.array([r.data_ptr() for r, _ in runs], dtype=np.int64)
        dst = np.array([d.data_ptr() for d in dsts], dtype=np.int64)
        nb = np.array([r.numel() for r, _ in runs], dtype=np.int64)
        w = np.array([b for _, b in runs], dtype=np.int64)
        # two buckets: the first three runs in bucket 0, the rest in bucket 1
        bk = np.array([0] * 3 + [1] * (len(runs) - 3), dtype=np.int64)
        digests = torch.zeros(2, dtype=torch.int64, device=dev)
        fused_copy.launch(fused_copy.build(src, dst, nb, w, bk, dev), digests, copy=True)
        only = torch.zeros(2, dtype=torch.int64, device=dev)
        fused_copy.launch(fused_copy.build(src, dst * 0, nb, w, bk, dev), only, copy=False)
        torch.cuda.synchronize()
        for (r, _), d in zip(runs, dsts, strict=True):
            assert torch.equal(r, d)
        want = [int(sum64_tensor(_padded_bucket(runs[:3], dev))),
                int(sum64_tensor(_padded_bucket(runs[3:], dev)))]
        assert digests.tolist() == want == only.tolist()


@needs_gpu
def test_fused_single_run_matches_cpu_sum64() -> None:
    from enginehooks.core import fused_copy

    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 4, 4099, (1 << 20) + 5, (16 << 20) + 2):
        cpu = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        src, dst = cpu.to(dev), torch.zeros(n, dtype=torch.uint8, device=dev)
        v = int(fused_copy.copy_digest(dst, src)) & ((1 << 64) - 1)
        assert (v ^ (n << 40)) & ((1 << 64) - 1) == _sum64(cpu), n
        assert torch.equal(dst.cpu(), cpu)


@needs_gpu
@pytest.mark.parametrize("checksum", [None, "sum64"])
def test_weightsync_cuda_ipc_in_process_single_copy_bit_exact(checksum: str | None) -> None:
    from torch import nn

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(300, 517), nn.ReLU(), nn.Linear(517, 33)).to(dev)

    trainer, replica = model(), model()
    with torch.no_grad():
        for p in replica.parameters():
            p.zero_()
    sync = WeightSync(transport="cuda_ipc", checksum=checksum, bucket_bytes=1 << 18,
                      timeout_s=60, device=dev)
    sync.add_replica(LocalEngine(replica, device=dev))
    try:
        for v in range(3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p))
            report = sync.push(trainer, version=v)
            torch.cuda.synchronize()
            for (n, a), b in zip(trainer.state_dict().items(), replica.state_dict().values(),
                                 strict=True):
                assert torch.equal(a, b), (v, n)
        assert report is not None
    finally:
        sync.close()


def _pair(checksum: str | None) -> tuple[torch.nn.Module, torch.nn.Module, object, object]:
    from torch import nn

    from enginehooks import WeightSync
    from enginehooks.engine.local import LocalEngine

    dev = torch.device("cuda", 0)
    torch.manual_seed(1)

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(300, 517), nn.ReLU(), nn.Linear(517, 33)).to(dev)

    trainer, replica = model(), model()
    with torch.no_grad():
        for p in replica.parameters():
            p.zero_()
    sync = WeightSync(transport="cuda_ipc", checksum=checksum, bucket_bytes=1 << 18,
                      timeout_s=60, device=dev)
    engine = LocalEngine(replica, device=dev)
    sync.add_replica(engine)
    return trainer, replica, sync, engine


@needs_gpu
def test_single_copy_digest_mismatch_fails_the_push_naming_the_bucket(monkeypatch) -> None:
    """The trainer's digest of a bucket disagrees with what the engine copied: the push
    fails with the engine's ChecksumError, and the next push (fresh group) is exact."""
    from enginehooks.core import fused_copy

    trainer, replica, sync, _ = _pair("sum64")
    real = fused_copy.launch

    def bad(batch, digests, copy=True):  # the trainer's digest-only pass, off by one
        real(batch, digests, copy)
        if not copy:
            digests.add_(1)

    try:
        monkeypatch.setattr(fused_copy, "launch", bad)
        # The engine's own ChecksumError reaches the trainer as itself (issue 19).
        with pytest.raises(ChecksumError, match=r"sum64 0x[0-9a-f]+ != sender's 0x"):
            sync.push(trainer, version=1)
        monkeypatch.setattr(fused_copy, "launch", real)
        sync.push(trainer, version=2)
        torch.cuda.synchronize()
        for a, b in zip(trainer.state_dict().values(), replica.state_dict().values(),
                        strict=True):
            assert torch.equal(a, b)
    finally:
        sync.close()


@needs_gpu
@pytest.mark.parametrize("checksum", [None, "sum64"])
def test_single_copy_trainer_stream_failure_ends_the_update_on_both_sides(
        checksum: str | None) -> None:
    """The trainer's stream raises after some buckets were handed over: the push fails
    with that error, the engine is not left waiting, and the next push is exact."""
    from enginehooks.trainer_side.module import ModuleAdapter

    trainer, replica, sync, _ = _pair(checksum)

    class Broken(ModuleAdapter):
        def stream(self, *a, **k):  # type: ignore[no-untyped-def]
            for i, item in enumerate(super().stream(*a, **k)):
                if i == 3:
                    raise RuntimeError("trainer stream broke")
                yield item

    try:
        with pytest.raises(RuntimeError, match="trainer stream broke") as got:
            sync.push(Broken(trainer), version=1)
        # the trainer's own exception, not a wrapper naming it
        assert type(got.value) is RuntimeError
        sync.push(trainer, version=2)
        torch.cuda.synchronize()
        for a, b in zip(trainer.state_dict().values(), replica.state_dict().values(),
                        strict=True):
            assert torch.equal(a, b)
    finally:
        sync.close()


@needs_gpu
def test_fused_pack_trailer_digest_is_plain_sum64_of_the_poisoned_bucket() -> None:
    """pack() on a CUDA buffer with sum64 copies and digests in one launch per bucket and
    zeroes the padding: the trailer's digest equals the plain sum64 of the payload (what
    every receiver checks), on buffers poisoned before each bucket, with pieces the kernel
    cannot take (a CPU tensor, an unaligned view) copied the ordinary way."""
    from enginehooks.core.buckets import Unpacker, buffer_bytes, pack, read_trailer
    from enginehooks.core.checksums import digest
    from enginehooks.core.manifest import TensorSpec, plan

    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(9)
    base = torch.randint(0, 255, (3_000_001,), dtype=torch.uint8, generator=g).to(dev)
    tensors = {
        "a": torch.randn(1024, 1000, generator=g).to(torch.bfloat16).to(dev),  # split
        "odd": torch.randn(777, 333, generator=g).to(torch.float16).to(dev),  # ends mid-word
        "cpu": torch.randn(4099, generator=g),  # stays on the CPU: copy_ path
        "unaligned": base[1:2_000_000],  # an odd address: copy_ path
        "b": torch.randn(3, 5, generator=g).to(dev),
    }
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
             for n, t in tensors.items()]
    m = plan(specs, weight_version=1, bucket_bytes=1 << 20, checksum="sum64")
    size = buffer_bytes(m)
    bufs = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(2)]

    def next_buffer(i: int) -> torch.Tensor:
        b = bufs[i % 2]
        b.fill_(0xA5)  # garbage where padding must be zeroed
        return b

    unpacker = Unpacker(m, dev)
    got: dict[str, torch.Tensor] = {}
    for i, buf in pack(m, iter(tensors.items()), next_buffer):
        _status, _mid, index, nbytes, dig, _mac = read_trailer(buf)
        assert index == i and dig == digest("sum64", buf[:nbytes]), i
        for name, t in unpacker.unpack(i, buf):  # verifies the digest the receivers' way
            got[name] = t.clone()
    for name, t in tensors.items():
        assert torch.equal(got[name].cpu(), t.cpu()), name


@needs_gpu
def test_a_replayed_reread_reads_the_memory_as_it_is_now() -> None:
    """`fused_copy.Replay` (verification's re-read of the same landings, push after
    push): launched the first time, captured as a CUDA graph the second and replayed
    from then on, it gives the digests of the bytes as they are at each call: equal to
    the launched digests while nothing changed, a changed byte named by its bucket at
    the next replay, and equal again once restored. Protective line: the replay itself
    (a replay that gave back the last digests, or a graph captured over a copy of the
    memory, would miss the flipped byte)."""
    from enginehooks.core import fused_copy

    dev = torch.device("cuda", 0)
    assert fused_copy.available(dev), fused_copy._state_reason
    g = torch.Generator().manual_seed(3)
    runs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev)
            for n in (3 * fused_copy.CHUNK_BYTES + 8, 4096, 777)]
    ptr = np.array([r.data_ptr() for r in runs], dtype=np.int64)
    nb = np.array([r.numel() for r in runs], dtype=np.int64)
    w = np.array([0, 0, 1024], dtype=np.int64)
    bk = np.array([0, 1, 1], dtype=np.int64)
    want = torch.zeros(2, dtype=torch.int64, device=dev)
    fused_copy.launch(fused_copy.build(ptr, ptr, nb, w, bk, dev), want, copy=False)
    replay = fused_copy.Replay(fused_copy.build(ptr, ptr, nb, w, bk, dev), 2, dev)
    for _ in range(3):  # launched, captured (and replayed), replayed
        assert replay.differs(want).tolist() == [False, False]
    assert replay.captured, replay.failed
    runs[1][100] ^= 1  # bucket 1
    assert replay.differs(want).tolist() == [False, True]
    runs[1][100] ^= 1
    runs[0][fused_copy.CHUNK_BYTES * 2 + 5] ^= 0x80  # bucket 0, the third program's chunk
    assert replay.differs(want).tolist() == [True, False]
    runs[0][fused_copy.CHUNK_BYTES * 2 + 5] ^= 0x80
    assert replay.differs(want).tolist() == [False, False]

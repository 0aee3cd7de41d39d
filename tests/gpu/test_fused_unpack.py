"""The receiver's fused verify-and-copy (`Unpacker.land`, used by `nccl` and the colocated
two-buffer path): packed buckets copied into the target's tensors while their digest is
computed, against the plain path, on one GPU in one process (no transport: the buckets
are packed by `pack()` into GPU buffers, as a receiver holds them after a broadcast)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from enginehooks.core.buckets import Unpacker, buffer_bytes, pack
from enginehooks.core.errors import ChecksumError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.engine.targets import ModuleTarget

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = torch.device("cuda", 0)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(1024, 700, generator=g).to(torch.bfloat16),  # split over buckets
        "odd": torch.randn(7, 3, generator=g).to(torch.bfloat16),  # 42 bytes: ends mid-word
        "w": torch.randn(300, 211, generator=g),
        "cast": torch.randn(64, 33, generator=g),  # fp32 on the wire, bf16 in the target
        "b": torch.randn(5, generator=g),
    }


def _packed(m: Manifest, tensors: dict[str, torch.Tensor], poison: bool
            ) -> Iterator[tuple[int, torch.Tensor]]:
    """Each bucket as the receiver holds it: a fresh GPU buffer (poisoned first, so that
    stale padding from a packer that leaves it is seen)."""
    size = buffer_bytes(m)

    def next_buffer(_i: int) -> torch.Tensor:
        b = torch.empty(size, dtype=torch.uint8, device=DEV)
        if poison:
            b.fill_(0xA5)
        return b

    for i, buf in pack(m, iter((n, t.to(DEV)) for n, t in tensors.items()), next_buffer):
        yield i, buf.clone()


def _manifest(tensors: dict[str, torch.Tensor]) -> Manifest:
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
             for n, t in tensors.items()]
    return plan(specs, weight_version=1, bucket_bytes=1 << 19, checksum="sum64")


def _target() -> tuple[dict[str, torch.Tensor], ModuleTarget]:
    dest = {n: torch.zeros_like(t, device=DEV) for n, t in _model(0).items()}
    dest["cast"] = dest["cast"].to(torch.bfloat16)
    return dest, ModuleTarget(dest)


def _receive(m: Manifest, buckets: list[tuple[int, torch.Tensor]], target: ModuleTarget
             ) -> list[dict[int, torch.Tensor] | None]:
    """What `BroadcastReceiver.stream` does with each packed bucket."""
    unpacker = Unpacker(m, DEV, target.destination)
    placed_per_bucket: list[dict[int, torch.Tensor] | None] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for i, buf in buckets:
            unpacker.verify(i, buf, check_digest=False)
            placed = unpacker.land(i, buf)
            placed_per_bucket.append(placed)
            if placed is None:
                unpacker.verify_digest(i, buf)
            yield from unpacker.unpack(i, buf, verified=True, placed=placed)

    target.apply(stream())
    return placed_per_bucket


@needs_gpu
@pytest.mark.parametrize("fused_pack", ["1", "0"])
def test_fused_unpack_lands_every_tensor_bit_exact(monkeypatch, fused_pack: str) -> None:
    """Every piece with a destination lands through the fused copy (the big tensor's
    pieces rejoined in place, across buckets); the 42-byte tensor and the cast one go
    the plain way; with the plain packer (`ENGINEHOOKS_FUSED_PACK=0`) the padding holds
    stale bytes, which the digest counts as the sender did: no false mismatch."""
    monkeypatch.setenv("ENGINEHOOKS_FUSED_PACK", fused_pack)
    monkeypatch.setenv("ENGINEHOOKS_FUSED_UNPACK", "1")  # these buckets hold few pieces
    src = _model(1)
    m = _manifest(src)
    assert len(m.buckets) >= 3
    dest, target = _target()
    ptrs = {n: t.data_ptr() for n, t in dest.items()}
    placed = _receive(m, list(_packed(m, src, poison=True)), target)
    assert all(p for p in placed), placed  # every bucket had something to place
    names = {e.name for i, p in enumerate(placed) for pos, (e, _) in
             enumerate(m.by_bucket()[i]) if pos in p}
    assert names == {"big", "w", "b"}, names
    for n, t in src.items():
        want = t.to(torch.bfloat16) if n == "cast" else t
        assert torch.equal(dest[n].cpu(), want), n
        assert dest[n].data_ptr() == ptrs[n]
    assert target.received == list(src)


@needs_gpu
@pytest.mark.parametrize("where", ["placed", "read"])
def test_fused_unpack_refuses_a_corrupt_bucket(monkeypatch, where: str) -> None:
    """A byte changed on the way, in a piece that is copied or in one only read for the
    digest (the tensor the target casts), fails the bucket with ChecksumError."""
    monkeypatch.setenv("ENGINEHOOKS_FUSED_UNPACK", "1")
    src = _model(2)
    m = _manifest(src)
    buckets = list(_packed(m, src, poison=False))
    by = m.by_bucket()
    name = "w" if where == "placed" else "cast"
    i, off = next((i, p.offset) for i, pairs in enumerate(by) for e, p in pairs
                  if e.name == name)
    buckets[i][1][off + 5] ^= 0x10
    _dest, target = _target()
    with pytest.raises(ChecksumError, match="checked while copying"):
        _receive(m, buckets, target)


@needs_gpu
def test_fused_unpack_steps_aside_for_overlapping_destinations(monkeypatch) -> None:
    """Two names with one tensor (tied aliases): the fused copies could reorder their
    writes, so the bucket goes the plain way and the stream's last write wins; and
    `ENGINEHOOKS_FUSED_UNPACK=0` turns the path off."""
    monkeypatch.setenv("ENGINEHOOKS_FUSED_UNPACK", "1")
    g = torch.Generator().manual_seed(3)
    src = {"embed": torch.randn(64, 32, generator=g), "head": torch.randn(64, 32, generator=g)}
    m = _manifest(src)
    shared = torch.zeros(64, 32, device=DEV)
    target = ModuleTarget({"embed": shared, "head": shared})
    placed = _receive(m, list(_packed(m, src, poison=False)), target)
    assert placed == [None]
    assert torch.equal(shared.cpu(), src["head"])

    monkeypatch.setenv("ENGINEHOOKS_FUSED_UNPACK", "0")
    src = _model(4)
    m = _manifest(src)
    dest, target = _target()
    assert _receive(m, list(_packed(m, src, poison=False)), target) == [None] * len(m.buckets)
    assert torch.equal(dest["w"].cpu(), src["w"])


@needs_gpu
def test_fused_unpack_by_default_only_for_buckets_of_many_pieces(monkeypatch) -> None:
    """`auto` (the default, `fused_landing_pays`): a bucket under 512 MiB of a few tensors
    over 16 MiB goes the plain way (measured faster there); one of
    `FUSED_UNPACK_MIN_PIECES` tensors or more (MoE experts) is landed fused, bit-exact."""
    from enginehooks.core.buckets import FUSED_UNPACK_MIN_PIECES

    monkeypatch.delenv("ENGINEHOOKS_FUSED_UNPACK", raising=False)
    g = torch.Generator().manual_seed(5)
    src = {f"w{i}": torch.randn(3072, 4096, generator=g).to(torch.bfloat16) for i in range(2)}
    specs = [TensorSpec(n, "bfloat16", tuple(t.shape)) for n, t in src.items()]
    m = plan(specs, weight_version=1, bucket_bytes=64 << 20, checksum="sum64")
    assert len(m.buckets) == 1  # two 24 MiB tensors in one 64 MiB bucket
    target = ModuleTarget({n: torch.zeros_like(t, device=DEV) for n, t in src.items()})
    assert _receive(m, list(_packed(m, src, poison=False)), target) == [None] * len(m.buckets)
    g = torch.Generator().manual_seed(6)
    experts = {f"e{i}": torch.randn(8, 16, generator=g).to(torch.bfloat16)
               for i in range(FUSED_UNPACK_MIN_PIECES)}
    m = _manifest(experts)
    assert len(m.buckets) == 1
    dest = {n: torch.zeros_like(t, device=DEV) for n, t in experts.items()}
    target = ModuleTarget(dest)
    (placed,) = _receive(m, list(_packed(m, experts, poison=False)), target)
    assert placed is not None and len(placed) == FUSED_UNPACK_MIN_PIECES
    for n, t in experts.items():
        assert torch.equal(dest[n].cpu(), t), n

"""Packing and unpacking: bit-exact round trips for any mix of dtypes and sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from enginehooks.core.buckets import Unpacker, message_bytes, pack
from enginehooks.core.errors import ChecksumError, ManifestError, TransportError
from enginehooks.core.manifest import TensorSpec, plan

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).view(shape)
    return raw.view(dtype).view(shape)  # arbitrary bit patterns, NaNs included


def round_trip(tensors: dict[str, torch.Tensor], bucket_bytes: int, checksum: str | None = "crc32"):
    m = plan([TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
              for n, t in tensors.items()], weight_version=1, bucket_bytes=bucket_bytes,
             checksum=checksum)
    bufs = [torch.empty(message_bytes(m.bucket_bytes), dtype=torch.uint8) for _ in range(2)]
    sizes = [message_bytes(b.nbytes) for b in m.buckets]
    un = Unpacker(m)
    out: dict[str, torch.Tensor] = {}
    for index, buf in pack(m, tensors.items(), lambda i: bufs[i % 2][: sizes[i]]):
        for name, t in un.unpack(index, buf):
            out[name] = t.clone()
    if not m.buckets:
        out.update(un.empties())
    return m, out


shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 10**6)),
                   min_size=0, max_size=12),
    bucket_bytes=st.sampled_from([64, 128, 1000, 4096, 1 << 20]),
)
def test_round_trip_is_bit_exact(items, bucket_bytes: int) -> None:
    tensors = {f"t{i}": random_tensor(dt, shape, seed) for i, (dt, shape, seed) in enumerate(items)}
    m, out = round_trip(tensors, bucket_bytes)
    assert list(out) == list(tensors) or set(out) == set(tensors)
    for name, t in tensors.items():
        got = out[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else got,
                           t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t), name
    assert all(b.nbytes <= bucket_bytes for b in m.buckets)


def test_corrupted_bucket_is_detected() -> None:
    tensors = {"w": torch.randn(100), "b": torch.randn(7)}
    m = plan([TensorSpec(n, "float32", tuple(t.shape)) for n, t in tensors.items()],
             weight_version=1, bucket_bytes=4096)
    buf = torch.empty(message_bytes(4096), dtype=torch.uint8)
    index, sealed = next(pack(m, tensors.items(), lambda i: buf[: message_bytes(m.buckets[i].nbytes)]))
    sealed[17] ^= 0x40  # one flipped bit in the payload
    with pytest.raises(ChecksumError, match="bucket 0"):
        list(Unpacker(m).unpack(index, sealed))


def test_bucket_from_another_update_is_refused() -> None:
    t = {"w": torch.randn(10)}
    m1 = plan([TensorSpec("w", "float32", (10,))], weight_version=1, bucket_bytes=4096)
    m2 = plan([TensorSpec("w", "float32", (10,))], weight_version=2, bucket_bytes=4096)
    buf = torch.empty(message_bytes(4096), dtype=torch.uint8)
    _, sealed = next(pack(m1, t.items(), lambda i: buf[: message_bytes(m1.buckets[i].nbytes)]))
    with pytest.raises(TransportError, match="another update"):
        list(Unpacker(m2).unpack(0, sealed))


def test_stream_that_disagrees_with_plan_is_refused() -> None:
    m = plan([TensorSpec("w", "float32", (10,))], weight_version=1, bucket_bytes=4096)
    buf = torch.empty(message_bytes(4096), dtype=torch.uint8)
    with pytest.raises(ManifestError, match="tensor 'w': stream yielded float32\\[11\\]"):
        list(pack(m, [("w", torch.zeros(11))], lambda i: buf))
    with pytest.raises(ManifestError, match="yielded 'v' where the manifest expects 'w'"):
        list(pack(m, [("v", torch.zeros(10))], lambda i: buf))
    with pytest.raises(ManifestError, match="does not plan"):
        list(pack(m, [("w", torch.zeros(10)), ("x", torch.zeros(1))], lambda i: buf))


def test_sum64_digest_catches_swapped_words() -> None:
    from enginehooks.core.checksums import digest

    a = torch.arange(64, dtype=torch.uint8)
    b = a.clone()
    b[:4], b[4:8] = a[4:8].clone(), a[:4].clone()
    assert digest("sum64", a) != digest("sum64", b)
    assert digest("crc32", a) != digest("crc32", b)

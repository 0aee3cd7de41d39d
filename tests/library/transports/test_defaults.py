"""Per-transport defaults chosen by measurement (issue 37 item 6) and the host-side
trailer checks the GPU receive loop uses (`Unpacker.verify_raw`, `check_header_raw`),
which must refuse exactly what `verify` / `check_header` refuse."""

from __future__ import annotations

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.core.auth import AuthError
from enginehooks.core.buckets import (
    Unpacker,
    buffer_bytes,
    pack,
    read_trailer_raw,
    write_abort,
)
from enginehooks.core.errors import TransportError
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.plugins import get_transport


def test_gpu_transports_default_to_the_measured_bucket_size() -> None:
    assert get_transport("nccl").default_bucket_bytes == 1 << 30
    assert get_transport("cuda_ipc").default_bucket_bytes == 1 << 30
    assert get_transport("gloo").default_bucket_bytes == 256 << 20
    assert get_transport("nccl").direct_min is not None  # tensors that fill a bucket


@pytest.mark.parametrize("transport,want", [("gloo", 256 << 20), ("nccl", 1 << 30)])
def test_weightsync_takes_the_transports_default_unless_told(transport: str, want: int) -> None:
    with WeightSync(transport, timeout_s=5) as sync:
        assert sync.bucket_bytes == want
    with WeightSync(transport, timeout_s=5, bucket_bytes=4096) as sync:
        assert sync.bucket_bytes == 4096


def sealed(secret: bytes | None = None) -> tuple[object, list[torch.Tensor]]:
    specs = [TensorSpec(f"t{i}", "float32", (300,)) for i in range(4)]
    m = plan(specs, weight_version=1, bucket_bytes=2048, checksum="sum64")
    ws = {s.name: torch.randn(300) for s in specs}
    bufs = [torch.zeros(buffer_bytes(m), dtype=torch.uint8) for _ in m.buckets]
    list(pack(m, iter(ws.items()), lambda i: bufs[i], secret))
    return m, bufs


def test_verify_raw_accepts_and_refuses_as_verify_does() -> None:
    m, bufs = sealed(b"k" * 32)
    u = Unpacker(m, secret=b"k" * 32)
    nbytes, dig = u.verify_raw(0, read_trailer_raw(bufs[0]))
    assert nbytes == u.verify(0, bufs[0]) and dig == read_trailer_raw(bufs[0])[5] & (2**64 - 1)
    with pytest.raises(TransportError, match="expected bucket 1"):
        u.verify_raw(1, read_trailer_raw(bufs[0]))  # bucket 0 where 1 was expected
    with pytest.raises(AuthError):
        Unpacker(m, secret=b"x" * 32).verify_raw(0, read_trailer_raw(bufs[0]))
    raw = read_trailer_raw(bufs[0])
    raw[0] ^= 1
    with pytest.raises(TransportError, match="bad magic"):
        u.verify_raw(0, raw)
    assert u.check_header_raw(0, read_trailer_raw(bufs[0]))[0] == -1


def test_verify_raw_reports_an_abort_notice_with_its_reason_length() -> None:
    m, bufs = sealed()
    u = Unpacker(m)
    write_abort(bufs[1], u.mid, 1, "trainer stream broke")
    nbytes, _dig = u.verify_raw(1, read_trailer_raw(bufs[1]))
    assert nbytes < 0 and -1 - nbytes == len("trainer stream broke")
    assert not u.defer()  # host buffers: digests are checked bucket by bucket
    u.finish()  # nothing deferred: nothing to compare

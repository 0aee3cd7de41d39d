"""The bucket receiver's protective checks (`core/buckets.py`: `Unpacker`, the trailer),
pinned where mutation testing found them loose (issue 26 item 2; docs/testing.md, third
run): the trailer's magic and fields, the MAC before anything else is believed, abort
notices and their bounds, the digest, and the order of those checks."""

from __future__ import annotations

import pytest
import torch

from enginehooks.core.auth import AuthError
from enginehooks.core.buckets import (
    MAX_REASON_BYTES,
    STATUS_ABORT,
    TRAILER_BYTES,
    Unpacker,
    direct_abort,
    manifest_id,
    message_bytes,
    pack,
    read_trailer,
    write_abort,
    write_trailer,
)
from enginehooks.core.checksums import digest
from enginehooks.core.errors import ChecksumError, ManifestError, SenderAborted, TransportError
from enginehooks.core.manifest import TensorSpec, plan

KEY = b"k" * 32


def manifest(checksum: str | None = "crc32", version: int = 1):
    return plan([TensorSpec("a", "float32", (40,)), TensorSpec("b", "float32", (30,))],
                weight_version=version, bucket_bytes=128, checksum=checksum)


def sealed(m, secret: bytes | None = None) -> list[torch.Tensor]:
    """Every bucket of `m`, packed from fixed tensors, each in a buffer of its own."""
    ws = {"a": torch.arange(40, dtype=torch.float32), "b": -torch.arange(30, dtype=torch.float32)}
    out = []
    for _, buf in pack(m, ws.items(),
                       lambda i: torch.zeros(message_bytes(m.buckets[i].nbytes),
                                             dtype=torch.uint8), secret):
        out.append(buf.clone())
    assert len(out) == len(m.buckets) >= 2
    return out


def retrailer(buf: torch.Tensor, **fields) -> torch.Tensor:
    """`buf` with its trailer rewritten: the fields it had, changed by `fields`."""
    status, mid, index, nbytes, dig, _mac = read_trailer(buf)
    kw = dict(mid=mid, index=index, nbytes=nbytes, dig=dig, status=status, secret=None)
    kw.update(fields)
    out = buf.clone()
    write_trailer(out, **kw)
    return out


# -- the trailer -------------------------------------------------------------------------
def test_a_buffer_without_the_magic_is_refused() -> None:
    m = manifest()
    buf = sealed(m)[0]
    buf[-TRAILER_BYTES] ^= 1
    with pytest.raises(TransportError) as e:
        Unpacker(m).verify(0, buf)
    assert str(e.value) == "received a bucket without an enginehooks trailer (bad magic)"


def test_the_trailer_reads_back_what_was_written_digest_unsigned() -> None:
    buf = torch.zeros(TRAILER_BYTES + 8, dtype=torch.uint8)
    write_trailer(buf, mid=5, index=2, nbytes=8, dig=(1 << 64) - 3, secret=KEY)
    status, mid, index, nbytes, dig, mac = read_trailer(buf)
    assert (status, mid, index, nbytes, dig) == (0, 5, 2, 8, (1 << 64) - 3)
    from enginehooks.core.auth import bucket_mac

    assert mac == bucket_mac(KEY, 5, 2, 8, (1 << 64) - 3) and mac != (0, 0)
    write_trailer(buf, mid=5, index=2, nbytes=8, dig=7)
    assert read_trailer(buf)[5] == (0, 0)


# -- fields -------------------------------------------------------------------------------
def test_verify_returns_the_payload_size_and_accepts_the_right_bucket() -> None:
    m = manifest()
    bufs = sealed(m)
    un = Unpacker(m)
    for i, buf in enumerate(bufs):
        assert un.verify(i, buf) == m.buckets[i].nbytes
        assert un.verify(i, buf, check_digest=False) == m.buckets[i].nbytes


def test_a_bucket_of_another_update_is_refused_naming_both_ids() -> None:
    m, other = manifest(version=1), manifest(version=2)
    buf = sealed(other)[0]
    with pytest.raises(TransportError) as e:
        Unpacker(m).verify(0, buf)
    assert str(e.value) == (f"bucket 0 belongs to another update (manifest id "
                            f"{manifest_id(other):#x}, expected {manifest_id(m):#x})")


def test_a_bucket_in_the_wrong_place_or_of_the_wrong_size_is_refused() -> None:
    m = manifest()
    bufs = sealed(m)
    un = Unpacker(m)
    with pytest.raises(TransportError) as e:
        un.verify(1, bufs[0])  # bucket 0 where bucket 1 was expected
    assert str(e.value) == (f"expected bucket 1 of {m.buckets[1].nbytes} bytes, got bucket 0 "
                            f"of {m.buckets[0].nbytes} bytes")
    resized = retrailer(bufs[0], nbytes=m.buckets[0].nbytes - 4)
    with pytest.raises(TransportError) as e:
        un.verify(0, resized, check_digest=False)
    assert str(e.value) == (f"expected bucket 0 of {m.buckets[0].nbytes} bytes, got bucket 0 "
                            f"of {m.buckets[0].nbytes - 4} bytes")
    with pytest.raises(TransportError, match="expected bucket 0"):
        un.check_header(0, resized[-TRAILER_BYTES:])
    with pytest.raises(TransportError, match="expected bucket 1"):
        un.check_header(1, bufs[0][-TRAILER_BYTES:])
    assert un.check_header(0, bufs[0][-TRAILER_BYTES:]) == -1


# -- the digest ------------------------------------------------------------------------------
@pytest.mark.parametrize("checksum", ["crc32", "xxh3", "sum64"])
def test_a_flipped_payload_byte_is_refused_with_both_digests(checksum: str) -> None:
    m = manifest(checksum)
    buf = sealed(m)[1]
    n = m.buckets[1].nbytes
    buf[n - 1] ^= 0x80  # the payload's last byte
    mine = digest(checksum, buf[:n])
    theirs = read_trailer(buf)[4]
    un = Unpacker(m)
    with pytest.raises(ChecksumError) as e:
        un.verify(1, buf)
    assert str(e.value) == (f"bucket 1: {checksum} {mine:#x} != sender's {theirs:#x}; "
                            f"tensors {[e.name for e, _ in m.by_bucket()[1]][:4]}...")
    # the trailer alone still checks out: the digest is what catches it
    assert un.verify(1, buf, check_digest=False) == n
    with pytest.raises(ChecksumError, match="bucket 1"):
        un.verify_digest(1, buf)
    # a direct bucket's trailer travels apart from its payload: the same check
    with pytest.raises(ChecksumError, match="bucket 1"):
        un.verify_digest(1, buf[:n].clone(), buf[-TRAILER_BYTES:].clone())
    # bytes past the payload (padding) are not part of the digest
    good = sealed(m)[1]
    good[n: len(good) - TRAILER_BYTES] = 0xFF
    un.verify(1, good)
    un.verify_digest(1, good[:n].clone(), good[-TRAILER_BYTES:].clone())


def test_verify_digest_reads_the_digest_of_the_trailer_it_is_given() -> None:
    m = manifest()
    bufs = sealed(m)
    n = m.buckets[0].nbytes
    un = Unpacker(m)
    # bucket 0's payload with bucket 1's trailer: another digest, refused
    with pytest.raises(ChecksumError):
        un.verify_digest(0, bufs[0][:n].clone(), bufs[1][-TRAILER_BYTES:].clone())
    un.verify_digest(0, bufs[0][:n].clone(), bufs[0][-TRAILER_BYTES:].clone())


def test_without_a_checksum_no_digest_is_checked() -> None:
    m = manifest(None)
    buf = sealed(m)[0]
    buf[0] ^= 1
    assert Unpacker(m).verify(0, buf) == m.buckets[0].nbytes
    Unpacker(m).verify_digest(0, buf)


# -- the MAC --------------------------------------------------------------------------------
def test_a_signed_bucket_verifies_only_with_the_same_secret() -> None:
    m = manifest()
    bufs = sealed(m, secret=KEY)
    assert Unpacker(m, secret=KEY).verify(0, bufs[0]) == m.buckets[0].nbytes
    for secret in (b"x" * 32, KEY[:-1]):
        with pytest.raises(AuthError) as e:
            Unpacker(m, secret=secret).verify(0, bufs[0])
        assert str(e.value) == ("bucket 0 is not signed with the shared secret: it did not "
                                "come from this update's trainer")
    # an unsigned bucket is refused by a receiver with a secret, read by one without
    plain = sealed(m)
    with pytest.raises(AuthError):
        Unpacker(m, secret=KEY).verify(0, plain[0])
    assert Unpacker(m).verify(0, bufs[0]) == m.buckets[0].nbytes


@pytest.mark.parametrize("field", ["mid", "index", "nbytes", "dig"])
def test_the_mac_covers_every_field_of_the_trailer(field: str) -> None:
    m = manifest()
    buf = sealed(m, secret=KEY)[0]
    status, mid, index, nbytes, dig, mac = read_trailer(buf)
    changed = dict(mid=mid, index=index, nbytes=nbytes, dig=dig)
    changed[field] += 1
    forged = buf.clone()
    write_trailer(forged, status=status, **changed)  # unsigned rewrite ...
    forged[-16:] = buf[-16:]  # ... keeping the genuine MAC
    assert read_trailer(forged)[5] == mac
    with pytest.raises(AuthError, match="bucket 0 is not signed"):
        Unpacker(m, secret=KEY).verify(0, forged, check_digest=False)
    with pytest.raises(AuthError, match="bucket 0 is not signed"):
        Unpacker(m, secret=KEY).check_header(0, forged[-TRAILER_BYTES:])


def test_the_mac_is_checked_before_an_abort_notice_is_believed() -> None:
    m = manifest()
    buf = torch.zeros(message_bytes(m.buckets[0].nbytes), dtype=torch.uint8)
    write_abort(buf, manifest_id(m), 0, "forged: stop")  # unsigned
    with pytest.raises(AuthError):
        Unpacker(m, secret=KEY).verify(0, buf)
    head = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    direct_abort(head, manifest_id(m), 0, "forged: stop")
    with pytest.raises(AuthError):
        Unpacker(m, secret=KEY).check_header(0, head)


# -- abort notices ---------------------------------------------------------------------------
def test_an_abort_notice_raises_the_senders_reason_exactly() -> None:
    m = manifest()
    buf = torch.full((message_bytes(m.buckets[0].nbytes),), ord("z"), dtype=torch.uint8)
    write_abort(buf, manifest_id(m), 0, "rank 3 lost its shard", secret=KEY)
    assert read_trailer(buf)[0] == STATUS_ABORT
    with pytest.raises(SenderAborted) as e:
        Unpacker(m, secret=KEY).verify(0, buf)
    # the reason's own bytes, none of the buffer's bytes after it
    assert str(e.value) == "the sender aborted the update: rank 3 lost its shard"
    # an abort is answered before the fields: an abort of this update's bucket 0 read
    # where bucket 1 was expected still says why the update ended
    with pytest.raises(SenderAborted):
        Unpacker(m, secret=KEY).verify(1, buf)


def test_an_abort_reason_cut_inside_a_character_still_reads() -> None:
    m = manifest()
    reason = torch.tensor([0xC3, 0xFF], dtype=torch.uint8)  # the first byte of "é", then junk
    with pytest.raises(SenderAborted) as e:
        Unpacker(m).aborted(reason)
    assert str(e.value) == "the sender aborted the update: \ufffd\ufffd"


@pytest.mark.parametrize("size", [0, 1, MAX_REASON_BYTES])
def test_a_direct_abort_announces_its_reason_up_to_the_bound(size: int) -> None:
    m = manifest()
    head = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    text = direct_abort(head, manifest_id(m), 1, "r" * size, secret=KEY)
    assert text.numel() == size and text.dtype == torch.uint8
    # an abort notice is answered before its index and size are compared
    assert Unpacker(m, secret=KEY).check_header(1, head) == size
    assert Unpacker(m, secret=KEY).check_header(0, head) == size


def test_a_direct_abort_announcing_more_than_the_bound_is_refused() -> None:
    m = manifest()
    head = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    write_trailer(head, mid=manifest_id(m), index=1, nbytes=MAX_REASON_BYTES + 1, dig=0,
                  status=STATUS_ABORT, secret=KEY)
    with pytest.raises(TransportError) as e:
        Unpacker(m, secret=KEY).check_header(1, head)
    assert str(e.value) == (f"abort notice of bucket 1 announces a reason of "
                            f"{MAX_REASON_BYTES + 1} bytes (at most {MAX_REASON_BYTES})")
    # direct_abort itself never announces more than the bound
    text = direct_abort(head, manifest_id(m), 1, "r" * (MAX_REASON_BYTES + 10))
    assert text.numel() == MAX_REASON_BYTES == read_trailer(head)[3]


# -- unpack ----------------------------------------------------------------------------------
def test_a_landed_bucket_must_have_been_verified() -> None:
    m = manifest()
    buf = sealed(m)[0]
    with pytest.raises(TransportError) as e:
        list(Unpacker(m).unpack(0, buf, verified=False, landed=True))
    assert str(e.value) == "a landed direct bucket must be verified by its receiver"


def test_unpack_verifies_unless_told_it_was() -> None:
    m = plan([TensorSpec("w", "float32", (4,))], weight_version=1, bucket_bytes=64,
             checksum="crc32")
    buf = torch.zeros(message_bytes(64), dtype=torch.uint8)
    ((_, sealed_buf),) = pack(m, [("w", torch.ones(4))], lambda i: buf[: message_bytes(16)])
    sealed_buf[0] ^= 1
    with pytest.raises(ChecksumError):
        list(Unpacker(m).unpack(0, sealed_buf))
    # the caller that verified it (the broadcast receiver) is believed
    assert [n for n, _ in Unpacker(m).unpack(0, sealed_buf, verified=True)] == ["w"]


# -- the stream against the plan -----------------------------------------------------------------
def test_a_stream_that_ends_early_or_runs_on_is_refused_by_name() -> None:
    m = plan([TensorSpec("w", "float32", (4,)), TensorSpec("v", "float32", (0,))],
             weight_version=1, bucket_bytes=64)
    buf = torch.zeros(message_bytes(64), dtype=torch.uint8)
    with pytest.raises(ManifestError) as e:
        list(pack(m, [("w", torch.zeros(4))], lambda i: buf))
    assert str(e.value) == "stream ended before tensor 'v' of the manifest"
    with pytest.raises(ManifestError) as e:
        list(pack(m, [("w", torch.zeros(4)), ("v", torch.zeros(0)), ("x", torch.zeros(1))],
                  lambda i: buf))
    assert str(e.value) == "stream yielded 'x', which the manifest does not plan"
    only_empty = plan([TensorSpec("v", "float32", (0,))], weight_version=1, bucket_bytes=64)
    with pytest.raises(ManifestError, match="stream ended before tensor 'v'"):
        list(pack(only_empty, [], lambda i: buf))
    with pytest.raises(ManifestError, match="stream yielded 'y', which the manifest"):
        list(pack(only_empty, [("v", torch.zeros(0)), ("y", torch.zeros(0))], lambda i: buf))


def test_a_tensor_of_another_dtype_or_shape_is_refused_naming_both() -> None:
    m = plan([TensorSpec("w", "float32", (2, 3))], weight_version=1, bucket_bytes=64)
    buf = torch.zeros(message_bytes(64), dtype=torch.uint8)
    with pytest.raises(ManifestError) as e:
        list(pack(m, [("w", torch.zeros(2, 3, dtype=torch.float16))], lambda i: buf))
    assert str(e.value) == "tensor 'w': stream yielded float16[2, 3], manifest expects float32[2, 3]"
    with pytest.raises(ManifestError) as e:
        list(pack(m, [("w", torch.zeros(3, 2))], lambda i: buf))
    assert str(e.value) == "tensor 'w': stream yielded float32[3, 2], manifest expects float32[2, 3]"
    with pytest.raises(ManifestError) as e:
        list(pack(m, [("u", torch.zeros(2, 3))], lambda i: buf))
    assert str(e.value) == "stream yielded 'u' where the manifest expects 'w'"


# -- where a direct bucket's payload lands ---------------------------------------------------
def direct_manifest():
    """'big' split into two direct buckets, 'whole' filling one direct bucket, and two
    small tensors packed together."""
    m = plan([TensorSpec("big", "float32", (32,)), TensorSpec("whole", "float32", (16,)),
              TensorSpec("s1", "float32", (2,)), TensorSpec("s2", "float32", (3,))],
             weight_version=1, bucket_bytes=64, direct_min=64)
    kinds = {t.name: [m.buckets[p.bucket].direct for p in t.pieces] for t in m.tensors}
    assert kinds == {"big": [True, True], "whole": [True], "s1": [False], "s2": [False]}
    return m


def bucket_of(m, name: str, piece: int = 0) -> int:
    return next(t for t in m.tensors if t.name == name).pieces[piece].bucket


def test_without_destinations_split_tensors_land_in_one_rejoin_tensor_and_the_rest_nowhere(
        ) -> None:
    m = direct_manifest()
    un = Unpacker(m)
    assert un.landing(bucket_of(m, "s1")) is None  # packed: the transport's buffer
    assert un.landing(bucket_of(m, "whole")) is None  # nowhere of its own to land
    first, second = un.landing(bucket_of(m, "big", 0)), un.landing(bucket_of(m, "big", 1))
    assert first is not None and second is not None
    assert first.numel() == second.numel() == 64 and first.dtype == torch.uint8
    # the two halves of one fresh tensor, in order
    assert second.data_ptr() == first.data_ptr() + 64
    assert un.landing(bucket_of(m, "big", 0)).data_ptr() == first.data_ptr()


def test_with_destinations_direct_buckets_land_in_the_targets_tensors() -> None:
    m = direct_manifest()
    dest = {"big": torch.zeros(32), "whole": torch.zeros(16)}
    un = Unpacker(m, into=dest.get)
    whole = un.landing(bucket_of(m, "whole"))
    assert whole is not None and whole.data_ptr() == dest["whole"].data_ptr()
    assert whole.numel() == 64
    big1 = un.landing(bucket_of(m, "big", 1))
    assert big1 is not None and big1.data_ptr() == dest["big"].data_ptr() + 64


@pytest.mark.parametrize("bad", [
    torch.zeros(16, dtype=torch.float16),        # another dtype: the target casts
    torch.zeros(4, 4),                           # another shape
    torch.zeros(32)[::2],                        # not contiguous
])
def test_a_destination_the_bytes_cannot_land_in_is_not_used(bad: torch.Tensor) -> None:
    m = direct_manifest()
    un = Unpacker(m, into=lambda name: bad if name == "whole" else None)
    assert un.landing(bucket_of(m, "whole")) is None


def test_a_destination_on_another_device_is_not_landed_in() -> None:
    m = direct_manifest()
    elsewhere = {"big": torch.empty(32, device="meta"), "whole": torch.empty(16, device="meta")}
    un = Unpacker(m, device="cpu", into=elsewhere.get)
    assert un.landing(bucket_of(m, "whole")) is None
    assert un.landing(bucket_of(m, "big", 0)) is None
    assert un.landing(bucket_of(m, "big", 1)) is None


def test_what_the_unpacker_makes_itself_is_made_on_its_device() -> None:
    """The meta device stands in for a second device: zero-size tensors and the rejoin
    tensor of a split direct tensor are made where the receiver asked (`device`)."""
    m = plan([TensorSpec("big", "float32", (32,)), TensorSpec("none", "float32", (0, 3))],
             weight_version=1, bucket_bytes=64, direct_min=64)
    un = Unpacker(m, device="meta")
    ((name, t),) = list(un.empties())
    assert name == "none" and t.device.type == "meta" and t.shape == (0, 3)
    assert t.dtype == torch.float32
    region = un.landing(0)
    assert region is not None and region.device.type == "meta" and region.numel() == 64


def test_a_torn_bucket_of_many_tensors_names_its_first_four() -> None:
    names = [f"t{i}" for i in range(6)]
    m = plan([TensorSpec(n, "float32", (2,)) for n in names], weight_version=1,
             bucket_bytes=4096, checksum="crc32")
    assert len(m.buckets) == 1
    buf = torch.zeros(message_bytes(m.buckets[0].nbytes), dtype=torch.uint8)
    ((_, sealed_buf),) = pack(m, [(n, torch.ones(2)) for n in names], lambda i: buf)
    sealed_buf[0] ^= 1
    with pytest.raises(ChecksumError) as e:
        Unpacker(m).verify(0, sealed_buf)
    assert str(e.value).endswith("; tensors ['t0', 't1', 't2', 't3']...")


def test_zero_size_tensors_come_out_once_with_bucket_0() -> None:
    m = plan([TensorSpec("a", "float32", (40,)), TensorSpec("e", "float32", (0,)),
              TensorSpec("b", "float32", (30,))], weight_version=1, bucket_bytes=128,
             checksum="crc32")
    ws = {"a": torch.ones(40), "e": torch.ones(0), "b": torch.ones(30)}
    un = Unpacker(m)
    per_bucket = [[n for n, _ in un.unpack(i, buf)]
                  for i, buf in pack(m, ws.items(),
                                     lambda i: torch.zeros(message_bytes(m.buckets[i].nbytes),
                                                           dtype=torch.uint8))]
    assert len(per_bucket) >= 3
    assert per_bucket[0][0] == "e"
    assert sum(names.count("e") for names in per_bucket) == 1


def test_a_split_packed_tensor_is_rejoined_in_the_targets_own_tensor() -> None:
    m = manifest()
    assert len(next(t for t in m.tensors if t.name == "a").pieces) > 1
    dest = {"a": torch.zeros(40), "b": torch.zeros(30)}
    un = Unpacker(m, into=dest.get)
    out = {}
    for i, buf in enumerate(sealed(m)):
        for name, t in un.unpack(i, buf):
            out[name] = t
    assert out["a"].data_ptr() == dest["a"].data_ptr()  # the destination itself
    assert torch.equal(dest["a"], torch.arange(40, dtype=torch.float32))
    # a destination of another dtype is left alone: a fresh tensor is yielded instead
    other = {"a": torch.zeros(40, dtype=torch.float64)}
    un = Unpacker(m, into=other.get)
    out = {name: t for i, buf in enumerate(sealed(m)) for name, t in un.unpack(i, buf)}
    assert out["a"].data_ptr() != other["a"].data_ptr()
    assert torch.equal(out["a"], torch.arange(40, dtype=torch.float32))
    assert not other["a"].any()

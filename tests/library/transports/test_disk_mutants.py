"""The disk transport's protective paths, pinned where mutation testing found them loose
(issue 26 item 2; docs/testing.md, third run): the shard digest (`file_crc32`), the
receiver's checks before anything loads (`DiskReceiver.verify`), and the version names
that may become folders (`version_dir`, `is_version_folder`)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from enginehooks.core.errors import ChecksumError, ManifestError, TransportError
from enginehooks.core.manifest import BucketEntry, Manifest, TensorSpec, plan
from enginehooks.transports.base import Abort, Target
from enginehooks.transports.disk import (
    MANIFEST_FILE,
    DiskReceiver,
    DiskSender,
    file_crc32,
    is_version_folder,
    shard_name,
    version_dir,
)


class Keep(Target):
    device = torch.device("cpu")

    def __init__(self, path_loads: bool = False) -> None:
        self.got: dict[str, torch.Tensor] = {}
        self.paths: list[str] = []
        self.path_loads = path_loads

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.got = {n: t.clone() for n, t in tensors}

    def load_path(self, path: str) -> bool:
        self.paths.append(path)
        return self.path_loads


def _push(root: Path, version: int | str, checksum: str | None = "crc32"
          ) -> tuple[Manifest, dict[str, torch.Tensor]]:
    ws = {f"w{i}": torch.randn(16, 16) for i in range(3)}
    m = plan([TensorSpec(n, "float32", (16, 16)) for n in ws], weight_version=version,
             bucket_bytes=1024, checksum=checksum)
    stats = DiskSender(root=root).send(m, iter(ws.items()), Abort())
    assert stats.manifest is not None
    return stats.manifest, ws


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # tensor bytes, past the safetensors header
    path.write_bytes(bytes(data))


# -- file_crc32 ----------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 5, 4096, 10_000])
def test_file_crc32_is_zlib_crc32_of_the_whole_file_in_any_chunk_size(tmp_path: Path,
                                                                      size: int) -> None:
    data = bytes((i * 37 + 11) % 256 for i in range(size))
    path = tmp_path / "f"
    path.write_bytes(data)
    want = f"crc32:{zlib.crc32(data):08x}"
    assert file_crc32(path) == want
    # chunked reads must carry the running crc across chunks (a restart per chunk, or a
    # read that stops after the first chunk, gives another value)
    assert file_crc32(path, chunk=3) == want
    assert file_crc32(path, chunk=4096) == want


def test_file_crc32_keeps_leading_zeros(tmp_path: Path) -> None:
    # a file whose crc32 is below 0x10000000 prints 8 hex digits all the same
    for i in range(4096):
        data = i.to_bytes(2, "little")
        if zlib.crc32(data) < 0x10000000:
            break
    path = tmp_path / "small"
    path.write_bytes(data)
    got = file_crc32(path)
    assert got == f"crc32:{zlib.crc32(data):08x}" and len(got) == len("crc32:") + 8
    assert got.startswith("crc32:0")


# -- DiskReceiver.verify ---------------------------------------------------------------------
def test_verify_returns_the_version_folder_of_an_intact_push(tmp_path: Path) -> None:
    m, _ = _push(tmp_path, 7)
    assert DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu")).verify(m) == (
        tmp_path / "v7")


@pytest.mark.parametrize("bucket", ["first", "last"])
def test_every_shard_is_checked_not_only_one(tmp_path: Path, bucket: str) -> None:
    m, _ = _push(tmp_path, 3)
    total = len(m.buckets)
    assert total >= 3
    index = 0 if bucket == "first" else total - 1
    shard = tmp_path / "v3" / shard_name(index, total)
    _flip(shard)
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    with pytest.raises(ChecksumError) as e:
        receiver.verify(m)
    assert str(e.value) == (f"{shard}: {file_crc32(shard)} != {m.buckets[index].checksum} "
                            "written by the sender")


def test_a_missing_version_folder_is_refused_naming_it(tmp_path: Path) -> None:
    m, _ = _push(tmp_path, 1)
    gone = plan([TensorSpec("w0", "float32", (16, 16))], weight_version=9, bucket_bytes=1024,
                checksum="crc32")
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    with pytest.raises(TransportError) as e:
        receiver.verify(gone)
    assert str(e.value) == f"{tmp_path / 'v9'} does not exist: the sender has not written it"
    # a plain file under the version's name is not a folder either
    (tmp_path / "v10").write_text("x")
    with pytest.raises(TransportError, match="does not exist"):
        receiver.verify(plan([TensorSpec("w0", "float32", (16, 16))], weight_version=10,
                             bucket_bytes=1024, checksum="crc32"))
    assert receiver.verify(m).name == "v1"


def test_a_shard_without_a_digest_is_refused_when_the_manifest_has_a_checksum(
        tmp_path: Path) -> None:
    m, _ = _push(tmp_path, 4)
    total = len(m.buckets)
    # the last shard's digest dropped from the manifest: nothing vouches for that file
    stripped = Manifest(weight_version=m.weight_version, bucket_bytes=m.bucket_bytes,
                        tensors=m.tensors,
                        buckets=tuple(BucketEntry(b.index, b.nbytes,
                                                  None if b.index == total - 1 else b.checksum)
                                      for b in m.buckets),
                        checksum=m.checksum, meta=m.meta)
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    with pytest.raises(ChecksumError) as e:
        receiver.verify(stripped)
    assert str(e.value) == f"manifest has no digest for shard {shard_name(total - 1, total)}"


def test_without_a_checksum_the_shards_are_not_read(tmp_path: Path) -> None:
    m, ws = _push(tmp_path, 5, checksum=None)
    assert all(b.checksum is None for b in m.buckets)
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    assert receiver.verify(m).name == "v5"  # no digests, no refusal
    target = Keep()
    stats = receiver.deliver(m, target)
    assert set(target.got) == set(ws)
    assert all(torch.equal(target.got[n], t) for n, t in ws.items())
    assert stats["bytes"] == m.total_bytes and stats["path"].endswith("v5")


def test_deliver_verifies_before_it_hands_the_folder_to_the_engines_loader(
        tmp_path: Path) -> None:
    m, _ = _push(tmp_path, 6)
    total = len(m.buckets)
    _flip(tmp_path / "v6" / shard_name(total - 1, total))
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    target = Keep(path_loads=True)
    with pytest.raises(ChecksumError):
        receiver.deliver(m, target)
    assert target.paths == [] and target.got == {}


def test_deliver_uses_the_engines_loader_when_it_has_one_and_streams_otherwise(
        tmp_path: Path) -> None:
    m, ws = _push(tmp_path, 8)
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    by_path = Keep(path_loads=True)
    stats = receiver.deliver(m, by_path)
    assert by_path.paths == [stats["path"]] and stats["path"].endswith("v8")
    assert by_path.got == {}  # the engine loaded the folder itself: nothing streamed
    assert stats["bytes"] == m.total_bytes and 0 <= stats["seconds"] < 60
    streamed = Keep(path_loads=False)
    receiver.deliver(m, streamed)
    assert list(streamed.got) == list(ws)
    assert all(torch.equal(streamed.got[n], t) for n, t in ws.items())


def test_a_receiver_needs_a_root_and_a_visible_folder(tmp_path: Path) -> None:
    with pytest.raises(TransportError) as e:
        DiskReceiver({"transport": "disk"}, 1, torch.device("cpu"))
    assert str(e.value) == "bad disk endpoint {'transport': 'disk'}: no root"
    missing = tmp_path / "nowhere"
    with pytest.raises(TransportError) as e:
        DiskReceiver({"root": str(missing)}, 1, torch.device("cpu")).connect()
    assert str(e.value) == f"disk transport folder {missing} is not visible here"
    DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu")).connect()  # no refusal


# -- version names -----------------------------------------------------------------------
@pytest.mark.parametrize("version", ["a" * 128, "1", "v1.0_rc-2", "...", "a..b"])
def test_versions_of_1_to_128_plain_characters_name_a_folder(tmp_path: Path,
                                                             version: str) -> None:
    assert version_dir(tmp_path, version) == tmp_path / f"v{version}"


@pytest.mark.parametrize("version", ["a" * 129, "", ".", "..", "x\n", "a/b", "a b", "é"])
def test_versions_that_cannot_name_a_folder_are_refused_with_the_rule(tmp_path: Path,
                                                                      version: str) -> None:
    with pytest.raises(ManifestError) as e:
        version_dir(tmp_path, version)
    assert str(e.value) == (
        f"weight_version {version!r} cannot name a folder: the disk transport needs 1 to "
        "128 of the characters A-Z a-z 0-9 . _ - (no whitespace, newline or slash), "
        "not '.' or '..'")


def test_is_version_folder_needs_the_name_the_folder_and_the_marker(tmp_path: Path) -> None:
    def folder(name: str, marker: bool = True, as_dir: bool = True) -> Path:
        p = tmp_path / name
        if as_dir:
            p.mkdir()
            if marker:
                (p / MANIFEST_FILE).write_text("{}")
        else:
            p.write_text("x")
        return p

    assert is_version_folder(folder("v12"))
    assert is_version_folder(folder("v" + "b" * 128))
    assert not is_version_folder(folder("v" + "c" * 129))
    assert not is_version_folder(folder("w12"))
    assert not is_version_folder(folder("v13", marker=False))
    assert not is_version_folder(folder("v14", as_dir=False))
    assert not is_version_folder(folder("v"))
    assert not is_version_folder(folder("v..")) and not is_version_folder(folder("v."))
    odd = tmp_path / "v15"
    odd.mkdir()
    (odd / MANIFEST_FILE).mkdir()  # the marker must be a file
    assert not is_version_folder(odd)


@pytest.mark.parametrize("checksum", ["crc32", None])
def test_a_missing_shard_is_refused_before_anything_loads(tmp_path: Path,
                                                          checksum: str | None) -> None:
    """A shard deleted after the sender wrote the folder is named before any tensor is
    handed over, with or without digests (before: a bare FileNotFoundError from
    `file_crc32`, or, without digests, from the loader half-way through the update)."""
    m, _ = _push(tmp_path, 5, checksum=checksum)
    total = len(m.buckets)
    shard = tmp_path / "v5" / shard_name(total - 1, total)
    shard.unlink()
    target = Keep()
    receiver = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu"))
    with pytest.raises(TransportError) as e:
        receiver.deliver(m, target)
    assert type(e.value) is TransportError
    assert str(e.value) == (f"{shard} is missing: version 5 has {total} shards; the folder "
                            "was changed after the sender wrote it (push again)")
    assert target.got == {} and target.paths == []

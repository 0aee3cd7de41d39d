"""The disk transport's housekeeping: pruning touches only its own version folders,
versions that cannot name a folder are refused, and a killed writer's temporary folder
is reclaimed by the next sender (never one a live writer still holds)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.transports.base import Abort
from enginehooks.transports.disk import (
    MANIFEST_FILE,
    STALE_TMP_S,
    WRITER_LOCK,
    DiskReceiver,
    DiskSender,
    reclaim_tmp,
    version_dir,
)


def manifest(version: int | str) -> Manifest:
    return plan([TensorSpec("w", "float32", (8, 8))], weight_version=version,
                bucket_bytes=4096, checksum="crc32")


def push(sender: DiskSender, version: int | str) -> Manifest:
    """Write `version`; the manifest the sender completed (with the shard digests)."""
    stats = sender.send(manifest(version),
                        iter([("w", torch.full((8, 8), float(len(str(version)))))]), Abort())
    assert stats.manifest is not None
    return stats.manifest


def test_prune_keeps_unrelated_folders_in_the_root(tmp_path: Path) -> None:
    """`venv/` starts with a `v` and `env` is a valid version name: the old prune deleted
    it (issue 19). Only folders with the manifest marker are versions."""
    for name in ("venv", "vault", "v0", "data"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text("not the transport's")
    (tmp_path / "vnotes.txt").write_text("a file")
    sender = DiskSender(root=tmp_path, keep=2)
    for version in (1, 2, 3, 4):
        push(sender, version)
        time.sleep(0.01)  # distinct mtimes: prune orders by them
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["data", "v0", "v3", "v4", "vault", "venv", "vnotes.txt"]
    for name in ("venv", "vault", "v0", "data"):
        assert (tmp_path / name / "keep.txt").read_text() == "not the transport's"
    assert all((tmp_path / v / MANIFEST_FILE).is_file() for v in ("v3", "v4"))


@pytest.mark.parametrize("version", ["x\n", "x\r", " x", "x y", "a/b", "..", ".", "", "v" * 129,
                                     "x\n\n", "\nx"])
def test_a_version_that_cannot_name_a_folder_is_refused_before_writing(
        tmp_path: Path, version: str) -> None:
    sender = DiskSender(root=tmp_path)
    with pytest.raises(ManifestError, match="cannot name a folder: the disk transport needs"):
        push(sender, version)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary folder


def test_plain_versions_still_name_folders(tmp_path: Path) -> None:
    for v in (7, "step-12", "1.0_rc", "v" * 128):
        assert version_dir(tmp_path, v) == tmp_path / f"v{v}"


def _tmp_folder(root: Path, name: str, *, lock: bool, age_s: float = 0.0) -> Path:
    p = root / name
    p.mkdir()
    (p / "model-00001-of-00001.safetensors").write_bytes(b"half written")
    if lock:
        (p / WRITER_LOCK).touch()
    t = time.time() - age_s
    os.utime(p, (t, t))
    return p


def test_reclaim_removes_only_folders_of_dead_writers(tmp_path: Path) -> None:
    dead = _tmp_folder(tmp_path, ".tmp-v7-deadbeef", lock=True)
    live = _tmp_folder(tmp_path, ".tmp-v8-cafebabe", lock=True)
    old_lockless = _tmp_folder(tmp_path, ".tmp-v9-0badf00d", lock=False, age_s=STALE_TMP_S + 5)
    new_lockless = _tmp_folder(tmp_path, ".tmp-v10-00c0ffee", lock=False)  # maybe mid-mkdir
    other = _tmp_folder(tmp_path, ".tmp-notours", lock=False, age_s=STALE_TMP_S + 5)
    fd = os.open(live / WRITER_LOCK, os.O_RDWR)  # a live writer holds its lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert sorted(reclaim_tmp(tmp_path)) == sorted([dead, old_lockless])
    finally:
        os.close(fd)
    assert live.is_dir() and new_lockless.is_dir() and other.is_dir()
    assert not dead.exists() and not old_lockless.exists()


WRITER = r"""
import sys, time, torch
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.transports.base import Abort
from enginehooks.transports.disk import DiskSender
m = plan([TensorSpec(f"w{i}", "float32", (8, 8)) for i in range(3)], weight_version=5,
         bucket_bytes=256, checksum="crc32")
def stream():
    yield "w0", torch.zeros(8, 8)
    yield "w1", torch.zeros(8, 8)
    print("writing", flush=True)
    time.sleep(600)  # killed here, mid-update
    yield "w2", torch.zeros(8, 8)
DiskSender(root=sys.argv[1]).send(m, stream(), Abort())
"""


def test_a_killed_writers_folder_is_reclaimed_by_the_next_sender(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "writing"
        (left,) = tmp_path.glob(".tmp-v5-*")
        assert DiskSender(root=tmp_path) and left.is_dir()  # a live writer's folder stays
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert left.is_dir()  # what a killed writer leaves
        sender = DiskSender(root=tmp_path)  # the next sender reclaims it...
        assert not left.exists()
        done = push(sender, 5)  # ...and the version can be written
        got = DiskReceiver({"root": str(tmp_path)}, 1, torch.device("cpu")).verify(done)
        assert got == tmp_path / "v5"
        assert not (got / WRITER_LOCK).exists()  # no lock file in a finished version
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_long_lived_sender_reclaims_folders_left_after_it_started(tmp_path: Path) -> None:
    """Another trainer writing to the same root died after this sender was created."""
    sender = DiskSender(root=tmp_path)
    dead = _tmp_folder(tmp_path, ".tmp-v3-0000dead", lock=True)
    push(sender, 1)
    assert not dead.exists() and (tmp_path / "v1").is_dir()

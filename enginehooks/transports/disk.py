"""Safetensors shards in a versioned folder, loaded by the engine's own reload-from-path.

The slowest transport and the most forgiving one: it needs no group, survives an
engine restart, and leaves an inspectable checkpoint behind. Each version is written
into a hidden temporary folder, fsynced, and renamed into place (`v<version>`), so an
engine can never read a half-written update. Every shard's digest goes into
`enginehooks-manifest.json` beside the shards, and receivers verify the files before
they load them.

The root may hold other things (a `venv/`, notes, another tool's checkpoints): the
sender only ever deletes what it made. Pruning (`keep`, the newest versions kept)
removes only folders named `v<version>` that hold `enginehooks-manifest.json`, the
marker every version folder gets. A writer killed mid-update leaves its hidden
`.tmp-v<version>-<hex>` folder; engines never read those, and the next sender on that
root reclaims it: each writer holds an exclusive `flock` on `.writer.lock` inside its
folder while it writes, so a folder whose lock can be taken has no live writer (on NFS,
Linux maps `flock` to NFS locks, which other hosts see too). A folder without that lock
file (a writer killed in the microseconds between `mkdir` and taking the lock, or one
from before this rule) is reclaimed once it is `STALE_TMP_S` old.

Versions name folders, so they are 1 to 128 of `A-Z a-z 0-9 . _ -` (not `.` or `..`);
anything else, a trailing newline included, is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from enginehooks.core.buckets import check_tensor
from enginehooks.core.errors import ChecksumError, ManifestError, TransportError
from enginehooks.core.manifest import BucketEntry, Manifest
from enginehooks.transports.base import (
    Abort,
    Receiver,
    Sender,
    SendStats,
    Stream,
    Target,
    Transport,
)

MANIFEST_FILE = "enginehooks-manifest.json"
#: The lock a writer holds inside its temporary folder while it writes.
WRITER_LOCK = ".writer.lock"
#: A temporary folder without a writer lock is reclaimed once it is this old.
STALE_TMP_S = 600.0
_VERSION = r"[A-Za-z0-9._-]{1,128}"
_VERSION_RE = re.compile(_VERSION)
_TMP_RE = re.compile(rf"\.tmp-v{_VERSION}-[0-9a-f]{{8}}")


def version_dir(root: str | os.PathLike[str], version: int | str) -> Path:
    """The folder of `version` under `root`; refuses a version that is not a plain
    folder name (`fullmatch`: `re.match` with `$` let `"x\n"` through)."""
    v = str(version)
    if not _VERSION_RE.fullmatch(v) or v in {".", ".."}:
        raise ManifestError(
            f"weight_version {version!r} cannot name a folder: the disk transport needs 1 to "
            f"128 of the characters A-Z a-z 0-9 . _ - (no whitespace, newline or slash), "
            f"not '.' or '..'")
    return Path(root) / f"v{v}"


def is_version_folder(path: Path) -> bool:
    """A folder this transport wrote: `v<version>` with the manifest marker inside."""
    return (path.name.startswith("v") and _VERSION_RE.fullmatch(path.name[1:]) is not None
            and path.name[1:] not in {".", ".."} and path.is_dir()
            and (path / MANIFEST_FILE).is_file())


def _writer_alive(folder: Path) -> bool | None:
    """True if a writer holds `folder`'s lock, False if none does, None if it has no
    lock file (see the module docstring)."""
    try:
        fd = os.open(folder / WRITER_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: leave it alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def reclaim_tmp(root: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary folders of writers that died mid-update; return them."""
    now = time.time() if now is None else now
    removed = []
    with contextlib.suppress(OSError):
        for p in root.iterdir():
            if not _TMP_RE.fullmatch(p.name) or not p.is_dir() or p.is_symlink():
                continue
            alive = _writer_alive(p)
            if alive is None:
                try:
                    alive = now - p.stat().st_mtime < STALE_TMP_S
                except FileNotFoundError:
                    continue
            if not alive:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def shard_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def file_crc32(path: Path, chunk: int = 16 << 20) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"crc32:{crc:08x}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskSender(Sender):
    def __init__(self, *, root: str | os.PathLike[str] | None = None, keep: int = 2,
                 **_: Any) -> None:
        if root is None:
            raise TransportError("the disk transport needs transport_options={'root': FOLDER}")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        reclaim_tmp(self.root)

    def endpoint(self) -> dict[str, Any]:
        return {"transport": "disk", "root": str(self.root)}

    def connect(self, world_size: int) -> None:
        """No group: every engine reads the shared folder."""

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        t0 = time.perf_counter()
        final = version_dir(self.root, manifest.weight_version)
        if final.exists():
            raise TransportError(f"{final} already exists: weight versions must not be reused")
        reclaim_tmp(self.root)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        # Held until the rename: while it is, no other sender reclaims this folder.
        lock = os.open(tmp / WRITER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            digests, weight_map = self._write_shards(manifest, stream, tmp, abort)
            done = Manifest(
                weight_version=manifest.weight_version,
                bucket_bytes=manifest.bucket_bytes,
                tensors=manifest.tensors,
                buckets=tuple(
                    BucketEntry(b.index, b.nbytes, d) for b, d in zip(manifest.buckets, digests)
                ),
                checksum=manifest.checksum,
                meta=manifest.meta,
            )
            index = {"metadata": {"total_size": manifest.total_bytes}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
            (tmp / MANIFEST_FILE).write_text(done.to_json())
            (tmp / WRITER_LOCK).unlink()  # the fd keeps the lock; the folder gets no clutter
            for p in tmp.iterdir():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            os.close(lock)
        self._prune(final)
        return SendStats(
            bytes=manifest.total_bytes, buckets=len(manifest.buckets),
            seconds=time.perf_counter() - t0, manifest=done, extra={"path": str(final)},
        )

    def _write_shards(
        self, manifest: Manifest, stream: Stream, tmp: Path, abort: Abort
    ) -> tuple[list[str | None], dict[str, str]]:
        it = iter(stream)
        total = len(manifest.buckets)
        shard: dict[str, torch.Tensor] = {}
        current = 0
        digests: list[str | None] = []
        weight_map: dict[str, str] = {}

        def flush(index: int) -> None:
            path = tmp / shard_name(index, total)
            save_file(shard, str(path), metadata={"format": "pt"})
            digests.append(file_crc32(path) if manifest.checksum else None)
            shard.clear()
            abort.wait_for(lambda: True, 0)  # raises if a replica already failed

        for entry in manifest.tensors:
            name, t = next(it, (None, None))
            if name is None or t is None:
                raise ManifestError(f"stream ended before tensor {entry.name!r}")
            check_tensor(entry, name, t)
            bucket = entry.pieces[0].bucket if entry.pieces else current
            while bucket > current:
                flush(current)
                current += 1
            shard[name] = t.detach().contiguous().cpu()
            weight_map[name] = shard_name(bucket, total)
        if next(it, None) is not None:
            raise ManifestError("stream yielded more tensors than the manifest plans")
        while current < total:
            flush(current)
            current += 1
        return digests, weight_map

    def _prune(self, newest: Path) -> None:
        """Keep the newest `keep` version folders this transport wrote; never touch
        anything else in the root (module docstring)."""
        if self.keep <= 0:
            return
        versions = sorted(
            (p for p in self.root.iterdir() if not p.is_symlink() and is_version_folder(p)),
            key=lambda p: p.stat().st_mtime,
        )
        for old in versions[: -self.keep]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)


class DiskReceiver(Receiver):
    def __init__(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> None:
        try:
            self.root = Path(str(endpoint["root"]))
        except KeyError:
            raise TransportError(f"bad disk endpoint {endpoint!r}: no root") from None
        self.device = device

    def connect(self) -> None:
        if not self.root.is_dir():
            raise TransportError(f"disk transport folder {self.root} is not visible here")

    def verify(self, manifest: Manifest) -> Path:
        folder = version_dir(self.root, manifest.weight_version)
        if not folder.is_dir():
            raise TransportError(f"{folder} does not exist: the sender has not written it")
        total = len(manifest.buckets)
        for b in manifest.buckets:
            path = folder / shard_name(b.index, total)
            # Every shard is there before any loads, digest or not: a shard missing
            # half-way through the load would leave the engine torn.
            if not path.is_file():
                raise TransportError(
                    f"{path} is missing: version {manifest.weight_version!r} has {total} "
                    "shards; the folder was changed after the sender wrote it (push again)")
            if manifest.checksum is None:
                continue
            if b.checksum is None:
                raise ChecksumError(f"manifest has no digest for shard {path.name}")
            got = file_crc32(path)
            if got != b.checksum:
                raise ChecksumError(f"{path}: {got} != {b.checksum} written by the sender")
        return folder

    def stream(self, manifest: Manifest, folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
        total = len(manifest.buckets)
        for b, pairs in enumerate(manifest.by_bucket()):
            with safe_open(str(folder / shard_name(b, total)), framework="pt",
                           device=str(self.device)) as f:
                for entry, _piece in pairs:
                    yield entry.name, f.get_tensor(entry.name)

    def deliver(self, manifest: Manifest, target: Target) -> dict[str, Any]:
        t0 = time.perf_counter()
        folder = self.verify(manifest)
        if not target.load_path(str(folder)):
            target.apply(self.stream(manifest, folder))
        return {"bytes": manifest.total_bytes, "seconds": time.perf_counter() - t0,
                "path": str(folder)}


class DiskTransport(Transport):
    name = "disk"
    streaming = False
    split = False

    def sender(self, **options: Any) -> Sender:
        return DiskSender(**options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return DiskReceiver(endpoint, rank, device)

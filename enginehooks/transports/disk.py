"""Safetensors shards in a versioned folder, loaded by the engine's own reload-from-path.

The slowest transport and the most forgiving one: it needs no group, survives an
engine restart, and leaves an inspectable checkpoint behind. Each version is written
into a hidden temporary folder, fsynced, and renamed into place (`v<version>`), so an
engine can never read a half-written update. Every shard's digest goes into
`enginehooks-manifest.json` beside the shards, and receivers verify the files before
they load them.
"""

from __future__ import annotations

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
_VERSION_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def version_dir(root: str | os.PathLike[str], version: int | str) -> Path:
    v = str(version)
    if not _VERSION_RE.match(v) or v in {".", ".."}:
        raise ManifestError(f"weight_version {version!r} cannot name a folder")
    return Path(root) / f"v{v}"


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

    def endpoint(self) -> dict[str, Any]:
        return {"transport": "disk", "root": str(self.root)}

    def connect(self, world_size: int) -> None:
        """No group: every engine reads the shared folder."""

    def send(self, manifest: Manifest, stream: Stream, abort: Abort) -> SendStats:
        t0 = time.perf_counter()
        final = version_dir(self.root, manifest.weight_version)
        if final.exists():
            raise TransportError(f"{final} already exists: weight versions must not be reused")
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
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
            for p in tmp.iterdir():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
        if self.keep <= 0:
            return
        versions = sorted(
            (p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("v")),
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

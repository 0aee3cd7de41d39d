"""`shm`: the colocated transport on CPU, through POSIX shared memory.

For a trainer and an engine on one host without a GPU between them (CI runs the real
vLLM on CPU through it), and as the CPU twin of `cuda_ipc`: the protocol is
`colocated.py`'s; only the buffers differ. They are files in `/dev/shm` (what
`shm_open` creates on Linux), created exclusively with mode 0600, with their pages
reserved up front (`posix_fallocate`, so a full `/dev/shm` is an error now rather than
a SIGBUS mid-update), and mapped with `torch.from_file(shared=True)` on both sides.

No leak: the files are unlinked as soon as every receiver has mapped them (the first
ack of a generation proves it), and at close otherwise; the mappings live on until
each side drops them. Until the unlink, `multiprocessing`'s resource tracker holds
each name, so even a sender killed by SIGKILL has its files removed. When the tracker
dies too (the trainer's whole process group killed, a container stopped), the files
stay until the next `ShmSender` on the host reclaims them: each file's name ends in
its owner's PID namespace and PID (`enginehooks-<group>-<gen>-<slot>-<ns>-<pid>`), and
a sender removes the files of owners in its own PID namespace that are no longer
alive and belong to its own user. A live owner, another namespace's files (whose PIDs
mean nothing here) and other users' files are never touched; a reused PID only keeps
a dead owner's files a while longer. Those files are never needed again: a receiver
maps a generation when its first bucket is ready, and a dead sender sends none.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import torch

from enginehooks.core.errors import TransportError
from enginehooks.transports.base import Receiver, Sender, Transport
from enginehooks.transports.colocated import ColocatedReceiver, ColocatedSender

SHM_DIR = Path("/dev/shm")
_OWNED = re.compile(r"enginehooks-[0-9a-f]{12}-\d+-[01]-(\d+)-(\d+)")


def pid_namespace() -> int | None:
    """This process's PID namespace (the inode of `/proc/self/ns/pid`), or None where
    that cannot be read: then no file's owner can be judged, and none is reclaimed."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def reclaim_orphans(folder: Path = SHM_DIR) -> list[Path]:
    """Unlink segments whose sender died with its resource tracker (module docstring);
    return them."""
    ns = pid_namespace()
    if ns is None:
        return []
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    for path in entries:
        m = _OWNED.fullmatch(path.name)
        if m is None or int(m.group(1)) != ns or _alive(int(m.group(2))):
            continue
        try:
            if path.lstat().st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def _track(name: str, register: bool) -> None:
    """Hand a segment to (or take it back from) the resource tracker, best effort."""
    try:
        from multiprocessing import resource_tracker

        if register:
            resource_tracker.register(f"/{name}", "shared_memory")
        else:
            resource_tracker.unregister(f"/{name}", "shared_memory")
    except Exception:
        pass


class ShmSender(ColocatedSender):
    transport_name = "shm"

    def __init__(self, *, shm_dir: str | os.PathLike[str] | None = None, **options: Any) -> None:
        device = options.pop("device", None)
        if device is not None and torch.device(device).type != "cpu":
            # The trainer's stream may live on a GPU; shm buffers are host memory anyway.
            device = None
        super().__init__(device=device, **options)
        self.shm_dir = Path(shm_dir) if shm_dir is not None else SHM_DIR
        self._linked: list[Path] = []  # files not unlinked yet
        self._files: dict[int, list[Path]] = {}
        self._owner = f"{pid_namespace() or 0}-{os.getpid()}"
        if self.shm_dir.is_dir():
            reclaim_orphans(self.shm_dir)

    def _allocate(self, nbytes: int, gen: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
        if not self.shm_dir.is_dir():
            raise TransportError(f"shm transport: {self.shm_dir} does not exist on this host")
        st = os.statvfs(self.shm_dir)
        free = st.f_bavail * st.f_frsize
        if free < 2 * nbytes:
            raise TransportError(
                f"shm transport needs 2 x {nbytes} bytes in {self.shm_dir} but only {free} are "
                f"free (containers: raise --shm-size, or use smaller buckets)"
            )
        bufs, names = [], []
        for slot in (0, 1):
            name = f"enginehooks-{self.group_id}-{gen}-{slot}-{self._owner}"
            path = self.shm_dir / name
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            self._linked.append(path)
            if self.shm_dir == SHM_DIR:
                _track(name, True)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                os.close(fd)
                self._unlink_all()
                raise TransportError(f"shm transport cannot reserve {nbytes} bytes: {e}") from e
            os.close(fd)
            bufs.append(torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8))
            names.append(name)
        self._files[gen] = [self.shm_dir / n for n in names]
        return bufs, {"dir": str(self.shm_dir), "files": names, "nbytes": nbytes}

    def _unlink(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if path in self._linked:
            self._linked.remove(path)
            if self.shm_dir == SHM_DIR:
                _track(path.name, False)

    def _unlink_all(self) -> None:
        for path in list(self._linked):
            self._unlink(path)

    def _all_mapped(self, gen: int) -> None:
        for path in self._files.pop(gen, []):
            self._unlink(path)

    def _release(self) -> None:
        self.bufs = []
        self._unlink_all()
        self._files.clear()


class ShmReceiver(ColocatedReceiver):
    def _map(self, desc: dict[str, Any]) -> list[torch.Tensor]:
        try:
            folder, files, nbytes = Path(desc["dir"]), list(desc["files"]), int(desc["nbytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransportError(f"bad shm buffer descriptor {desc!r}: {e}") from None
        out = []
        for name in files:
            if "/" in name or name.startswith("."):
                raise TransportError(f"shm buffer name {name!r} is not a plain file name")
            path = folder / name
            if not path.exists():
                raise TransportError(
                    f"shm buffer {path} is not visible here: is the engine on the trainer's "
                    f"host and in the same /dev/shm (containers need a shared IPC namespace)?"
                )
            out.append(torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8))
        return out

    def _unmap(self) -> None:
        self.bufs = []  # the mapping goes with the last tensor that views it


class ShmTransport(Transport):
    """Colocated transport on CPU: two POSIX shared-memory buffers, acks through the store."""

    name = "shm"

    def sender(self, **options: Any) -> Sender:
        return ShmSender(**options)

    def receiver(self, endpoint: dict[str, Any], rank: int, device: torch.device) -> Receiver:
        return ShmReceiver(endpoint, rank, device)

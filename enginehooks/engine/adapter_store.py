"""Where a server keeps the LoRA adapter versions a trainer pushed: one folder per version,
holding exactly the files PEFT's `save_pretrained` writes, so the engine loads them with
its own adapter loader (the owner of the adapter's names and layout) from a path, as it
would from a checkpoint on disk.

The root is private to the server process (mode 0700, removed at exit); a version is
written to a temporary folder and renamed into place, so the engine never sees half of
one; a version already stored is refused (versions name what was trained: push a new
one); a version the engine refused is removed again by the handle (`remove`).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path

from enginehooks.core.errors import ConfigError
from enginehooks.wire.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterUpload, check_part


class AdapterStore:
    """Adapter versions on this host, under `root` (a new private folder by default)."""

    def __init__(self, root: str | Path | None = None) -> None:
        if root is None:
            root = tempfile.mkdtemp(prefix="enginehooks-adapters-")
            atexit.register(shutil.rmtree, root, True)
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def folder(self, name: str, version: str) -> Path:
        return self.root / check_part("name", name) / check_part("version", version)

    def put(self, upload: AdapterUpload) -> Path:
        """Store a checked upload; its folder (what the engine's loader reads)."""
        final = self.folder(upload.name, upload.version)
        with self._lock:
            if final.exists():
                raise ConfigError(f"adapter {upload.name} version {upload.version} was already "
                                  "pushed to this server: push it under a new version")
            final.parent.mkdir(mode=0o700, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=final.parent))
            try:
                (staging / CONFIG_FILE).write_bytes(upload.config)
                (staging / WEIGHTS_FILE).write_bytes(upload.weights)
                staging.rename(final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        return final

    def remove(self, name: str, version: str) -> bool:
        """Forget a version (after the engine refused or unloaded it); False if absent."""
        folder = self.folder(name, version)
        with self._lock:
            if not folder.is_dir():
                return False
            shutil.rmtree(folder)
            return True

    def versions(self, name: str) -> list[str]:
        parent = self.root / check_part("name", name)
        return sorted(p.name for p in parent.iterdir()
                      if p.is_dir() and not p.name.startswith(".")) if parent.is_dir() else []

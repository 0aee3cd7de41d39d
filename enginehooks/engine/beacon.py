"""A worker's update state, published in a small private file that anyone on the host
may read without asking the worker.

An RPC to a worker queues behind the update it is applying, so "are you updating?"
cannot be asked that way. Every state change of the worker's `EngineSide` is written
here instead (atomically: write, then rename): vLLM's front ends (`vllm_ext/fail_closed.py`)
read it per request, a few microseconds, never blocked by an update; SGLang workers
publish theirs too, for watchdogs and tests on the same host. `info` names the file
(`"beacon"`). The folder is private to the engine's user (mode 0700), holds JSON only,
and is removed when the worker's process exits normally (a killed one leaves it).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def _remove_if_mine(folder: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the exit handler
        shutil.rmtree(folder, ignore_errors=True)


class Beacon:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str) -> Beacon:
        folder = Path(tempfile.mkdtemp(prefix="enginehooks-state-"))  # 0700
        atexit.register(_remove_if_mine, folder, os.getpid())
        # No file yet: the worker's EngineSide publishes its state as it starts, and
        # readers skip a worker whose file is missing.
        return cls(folder / f"{name}.json")

    def publish(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)

    @staticmethod
    def read(path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The published state, or None if the file is gone (the worker exited)."""
        try:
            state: dict[str, Any] = json.loads(Path(path).read_text())
            return state
        except (OSError, ValueError):
            return None

"""A worker's update state, published in a small private file that vLLM's front end reads.

vLLM serves generation from a front end (the API server, or `LLM.generate` in the
trainer's process) that is not the worker applying updates, and an RPC to the worker
would queue behind a running update. So every state change of the worker's
`EngineSide` is written here (atomically: write, then rename), and the front-end guards
(`fail_closed.py`) read it per request: a few microseconds, never blocked by an update.
The folder is private to the engine's user (mode 0700); the file holds JSON only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


class Beacon:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str) -> Beacon:
        folder = Path(tempfile.mkdtemp(prefix="enginehooks-state-"))  # 0700
        beacon = cls(folder / f"{name}.json")
        beacon.publish({"state": "initial", "version": None, "updating_to": None,
                        "failed_version": None, "reason": None, "on_torn": "refuse"})
        return beacon

    def publish(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)

    @staticmethod
    def read(path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The published state, or None if the file is gone (the worker exited)."""
        try:
            return json.loads(Path(path).read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None

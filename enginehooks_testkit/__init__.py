"""The test kit: what the tests and benchmarks share, and not part of the library (not in
the wheel; nothing under `enginehooks/` imports it). Tiny models (`tiny`), in-process
engine drivers (`engines`) and server launchers (`servers`) with the exact oracle's
generations (`generation`), a trainer that stalls mid-push (`stalling_trainer`), Megatron
ranks on CPU (`megatron_cpu`), hosts made of network namespaces (`netns`) and the
package's import graph (`import_graph`).

It lives beside the package in the checkout, and no environment installs it: pytest puts
the checkout on its path (`pythonpath` in pyproject.toml), benchmarks put it there
themselves. Processes a test or benchmark starts need it too (a fresh engine driver, a
stalling trainer, Megatron ranks, Ray workers), so importing the kit puts the checkout
first on this process's `PYTHONPATH`, which those children inherit.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

#: The checkout that holds the kit (and the enginehooks package it tests).
ROOT = Path(__file__).resolve().parents[1]


def export_path(env: MutableMapping[str, str] = os.environ) -> None:
    """Put the checkout first on `env`'s PYTHONPATH (once), so that children started
    with `env` import the kit."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not parts or parts[0] != str(ROOT):
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(ROOT), *parts]))


export_path()

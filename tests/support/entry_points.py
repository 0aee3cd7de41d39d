"""This checkout's entry points, visible to `importlib.metadata` without reinstalling.

The test environments hold enginehooks installed in editable mode from one checkout;
the entry points a checkout declares in `pyproject.toml` exist only once it is
(re)installed. vLLM finds its plugins through entry points alone, so where the
installed metadata lacks one of this checkout's, the checkout's own declaration is
written as a minimal distribution (`*.dist-info` with `entry_points.txt`) into a
temporary folder put on `sys.path` and `PYTHONPATH` (engine processes started later
inherit it). Nothing is imported or registered by hand: the engines' own plugin
loading finds the declaration exactly as it would an installed package's.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def declared(group: str, root: Path = ROOT) -> dict[str, str]:
    """`{name: object reference}` this checkout declares in entry-point `group`."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return dict(project.get("entry-points", {}).get(group, {}))


def expose_entry_points(group: str, root: Path = ROOT) -> Path | None:
    """Make the checkout's entry points of `group` discoverable in this process and
    its children; returns the folder added to the path, or None when the installed
    metadata already declares them all."""
    want = declared(group, root)
    have = {(ep.name, ep.value) for ep in importlib.metadata.entry_points(group=group)}
    missing = {n: v for n, v in want.items() if (n, v) not in have}
    if not missing:
        return None
    folder = Path(tempfile.mkdtemp(prefix="enginehooks-entry-points-"))
    dist = folder / "enginehooks_checkout-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: enginehooks-checkout\n"
                                   "Version: 0.0.0\n")
    lines = [f"[{group}]"] + [f"{n} = {v}" for n, v in missing.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, str(folder))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), *parts])
    return folder

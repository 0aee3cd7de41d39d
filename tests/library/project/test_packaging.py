"""What the wheel ships: the library, its type marker and the demo (with the CPU stand-in
for SGLang's kernels the demo puts on a path), and not the test kit, which lives beside
the package in the checkout (`enginehooks_testkit/`). Built for real, by pip, from a copy
of the checkout's packaging inputs (pip builds in place: the checkout stays clean)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_wheel_ships_the_library_and_demo_but_not_the_test_kit(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("enginehooks", "enginehooks_testkit"):
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("enginehooks-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "enginehooks/py.typed" in names
    assert {"enginehooks/cli.py", "enginehooks/demo/__init__.py", "enginehooks/demo/tiny.py",
            "enginehooks/demo/servers.py",
            "enginehooks/demo/sgl_kernel_stub/sgl_kernel/__init__.py"} <= names
    assert not [n for n in names if n.startswith("enginehooks_testkit")]
    shipped = {n for n in names if n.startswith("enginehooks/") and n.endswith(".py")}
    in_checkout = {p.relative_to(ROOT).as_posix() for p in (ROOT / "enginehooks").rglob("*.py")}
    assert shipped == in_checkout, sorted(shipped ^ in_checkout)

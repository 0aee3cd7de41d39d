"""A conformance cell with no result in time (`matrix.timed_out`) is reclassified as the
engine cannot run the family only while the engine was still starting from the
untouched checkpoint, as for a cell process that died (`died`); anywhere else it fails,
naming the phase."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.conformance.matrix import PHASES, Cell, phase, timed_out

CELL = Cell("gen:Llama4ForConditionalGeneration", "vllm", "plain", "bfloat16")


def test_no_result_while_the_engine_starts_means_it_cannot_run(tmp_path: Path) -> None:
    phase(tmp_path, "start")
    got = timed_out(CELL, tmp_path, 300.0)
    assert got["status"] == "cannot run"
    assert "within 300.0s, before any push" in got["detail"]


@pytest.mark.parametrize("where", [p for p in PHASES if p != "start"] + [None])
def test_no_result_anywhere_else_fails_naming_the_phase(tmp_path: Path, where: str | None) -> None:
    if where is not None:
        phase(tmp_path, where)
    got = timed_out(CELL, tmp_path, 300.0)
    assert got["status"] == "fail"
    assert got["detail"] == f"no result within 300.0s (phase {where or 'before the cell began'!r})"

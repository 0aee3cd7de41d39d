"""The conformance report's header (tests/engines/conformance/report.py) when results
files from both engines' environments are rendered together: each pins its own torch,
and the header must name both, not whichever file came last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engines.conformance.report import main


def test_a_package_seen_with_two_versions_lists_both(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    files = []
    for engine, torch_version in (("vllm", "2.13.0+cpu"), ("sglang", "2.9.1")):
        p = tmp_path / f"{engine}.json"
        p.write_text(json.dumps({"versions": {"torch": torch_version, "transformers": "5.19.0",
                                              engine: "1.0"}, "results": []}))
        files.append(str(p))
    main(["--generated", *files])
    header = capsys.readouterr().out
    assert "torch 2.13.0+cpu / 2.9.1" in header
    assert "transformers 5.19.0," in header and "5.19.0 / 5.19.0" not in header

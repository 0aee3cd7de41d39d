"""The conformance matrix's reclassifications as "engine cannot run"
(tests/engines/conformance/matrix.py, used by cell.py), each narrow:

- a failed oracle (`undefined_by_the_checkpoint`), only where the engine reports
  parameters no checkpoint tensor loads AND it verified the judged push equal to a fresh
  load of every tensor the push carries;
- a cell process that died without a result (`died`), only where it died while the
  engine started from the untouched checkpoint, before any push.

Anything less stays a failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engines.conformance.matrix import (
    PHASES,
    Cell,
    died,
    engine_error,
    phase,
    undefined_by_the_checkpoint,
)

PROBLEMS = ["the push did not change the outputs",
            "after the push != freshly loaded: prompt 0: tokens [0] vs [56]"]
FAILED = {"status": "fail", "detail": "; ".join(PROBLEMS), "problems": PROBLEMS}


def info(unloaded: list[str], verified: int, ok: Any) -> dict[str, Any]:
    return {"unloaded": unloaded, "verification": {"verified": verified, "last": {"ok": ok}}}


def test_a_verified_push_into_an_engine_with_unloaded_parameters_cannot_run() -> None:
    got = undefined_by_the_checkpoint(FAILED, info(["lm_head.weight"], 2, True))
    assert got["status"] == "cannot run"
    assert got["detail"].startswith("the engine loads no checkpoint tensor into "
                                    "['lm_head.weight']")
    assert FAILED["detail"] in got["detail"]


def test_a_push_that_changes_nothing_through_an_unloaded_head_cannot_run() -> None:
    # An uninitialised head that makes every output the same token: the push, verified
    # equal to a fresh load, cannot change the outputs (SGLang GLM-4-MoE, tied, bf16).
    same = {"status": "fail", "detail": "the push did not change the outputs",
            "problems": ["the push did not change the outputs"]}
    got = undefined_by_the_checkpoint(same, info(["lm_head.weight"], 2, True))
    assert got["status"] == "cannot run"
    assert got["detail"].endswith("the push did not change the outputs")


def test_anything_less_stays_a_failure() -> None:
    for i in (info([], 2, True),                    # every parameter is loaded
              info(["lm_head.weight"], 1, True),    # the judged push was not verified
              info(["lm_head.weight"], 2, False),   # verification found a mismatch
              info(["lm_head.weight"], 2, None)):   # it could not verify
        assert undefined_by_the_checkpoint(FAILED, i) == FAILED
    # an oracle finding beside a problem of the push's own (a bad update accepted)
    mixed = {"status": "fail", "problems": [PROBLEMS[1], "extra: the update was accepted"],
             "detail": PROBLEMS[1] + "; extra: the update was accepted"}
    assert undefined_by_the_checkpoint(mixed, info(["lm_head.weight"], 2, True)) == mixed
    other = {"status": "fail", "detail": "extra tensor accepted",
             "problems": ["extra tensor accepted"]}
    assert undefined_by_the_checkpoint(other, info(["x"], 2, True)) == other
    passed = {"status": "pass", "detail": ""}
    assert undefined_by_the_checkpoint(passed, info(["x"], 2, True)) == passed


CELL = Cell("gen:AfmoeForCausalLM", "sglang", "plain", "float32")
# What SGLang's scheduler leaves on stderr when its first batch fails (trimmed): the
# exception line sits between the traceback and the dispatcher's long tail.
STDERR = """[2026-11-26 00:54:07] Scheduler hit an exception: Traceback (most recent call last):
  File "sglang/srt/layers/moe/fused_moe.py", line 334, in fused_experts
    inplace_fused_experts(
NotImplementedError: Could not run 'sglang::inplace_fused_experts' with arguments from the 'CPU' backend.
FuncTorchBatched: registered at aten/src/ATen/functorch/LegacyBatchingRegistrations.cpp:730 [backend fallback]
PythonDispatcher: registered at aten/src/ATen/core/PythonFallbackKernel.cpp:196 [backend fallback]
[2026-11-26 00:54:07] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
"""


def test_the_engines_exception_line_is_quoted_first() -> None:
    got = engine_error(STDERR)
    assert got.startswith("NotImplementedError: Could not run 'sglang::inplace_fused_experts'")
    assert got.endswith("It usually means one child failed.")
    assert engine_error("") == ""


def test_a_bare_exception_is_quoted_with_its_source_line() -> None:
    stderr = """Traceback (most recent call last):
  File "sglang/srt/layers/attention/torch_native_backend.py", line 90, in forward_extend
    assert layer.qk_head_dim == layer.v_head_dim
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
AssertionError
[2026-11-26 01:01:03] Received sigquit from a child process. It usually means the child failed.
"""
    got = engine_error(stderr)
    assert got.startswith("AssertionError at `assert layer.qk_head_dim == layer.v_head_dim` | ")
    assert "^^^" not in got


def test_a_process_that_died_while_the_engine_started_cannot_run(tmp_path: Path) -> None:
    phase(tmp_path, "start")
    got = died(CELL, tmp_path, -9, STDERR)
    assert got["status"] == "cannot run"
    assert got["detail"].startswith("the engine process died starting from the checkpoint, "
                                    "before any push (exit -9): NotImplementedError: ")


@pytest.mark.parametrize("where", [p for p in PHASES if p != "start"] + [None])
def test_a_process_that_died_anywhere_else_fails_naming_the_phase(tmp_path: Path,
                                                                  where: str | None) -> None:
    if where is not None:
        phase(tmp_path, where)
    got = died(CELL, tmp_path, -9, STDERR)
    assert got["status"] == "fail"
    named = where or "before the cell began"
    assert got["detail"].startswith(f"the process died in phase {named!r} (exit -9): "
                                    "NotImplementedError: ")

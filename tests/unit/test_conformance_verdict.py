"""The conformance cell's one reclassification of a failed oracle
(`undefined_by_the_checkpoint` in tests/conformance/matrix.py, used by cell.py): "engine
cannot run" only where the engine reports parameters no checkpoint tensor loads AND it
verified the judged push equal to a fresh load of every tensor the push carries.
Anything less stays a failure."""

from __future__ import annotations

from typing import Any

from tests.conformance.matrix import undefined_by_the_checkpoint

FAILED = {"status": "fail", "detail": "the push did not change the outputs; after the push "
                                      "!= freshly loaded: prompt 0: tokens [0] vs [56]"}


def info(unloaded: list[str], verified: int, ok: Any) -> dict[str, Any]:
    return {"unloaded": unloaded, "verification": {"verified": verified, "last": {"ok": ok}}}


def test_a_verified_push_into_an_engine_with_unloaded_parameters_cannot_run() -> None:
    got = undefined_by_the_checkpoint(FAILED, info(["lm_head.weight"], 2, True))
    assert got["status"] == "cannot run"
    assert got["detail"].startswith("the engine loads no checkpoint tensor into "
                                    "['lm_head.weight']")
    assert FAILED["detail"] in got["detail"]


def test_anything_less_stays_a_failure() -> None:
    for i in (info([], 2, True),                    # every parameter is loaded
              info(["lm_head.weight"], 1, True),    # the judged push was not verified
              info(["lm_head.weight"], 2, False),   # verification found a mismatch
              info(["lm_head.weight"], 2, None)):   # it could not verify
        assert undefined_by_the_checkpoint(FAILED, i) == FAILED
    other = {"status": "fail", "detail": "extra tensor accepted"}
    assert undefined_by_the_checkpoint(other, info(["x"], 2, True)) == other
    passed = {"status": "pass", "detail": ""}
    assert undefined_by_the_checkpoint(passed, info(["x"], 2, True)) == passed

"""SGLang answers are labelled by every version that produced their tokens."""

from __future__ import annotations

from enginehooks.sglang_ext import answer_version


def test_one_version_is_the_answer_version() -> None:
    meta = {"weight_version": "v7", "weight_versions": [{"version": "v7", "start": 0, "end": 8}]}
    assert answer_version(meta) == "v7"


def test_an_answer_spanning_an_update_is_mixed() -> None:
    # What SGLang reports for a request retracted by a pause and finished after the update.
    meta = {"weight_version": "v7", "weight_versions": [
        {"version": "v6", "start": 0, "end": 5}, {"version": "v7", "start": 5, "end": 8}]}
    assert answer_version(meta) == "mixed:v6->v7"


def test_older_sglang_without_spans_and_torn_labels_pass_through() -> None:
    assert answer_version({"weight_version": "torn:v3"}) == "torn:v3"
    assert answer_version({}) is None

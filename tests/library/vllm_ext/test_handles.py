"""`vllm_ext/handles.py`'s prefix-cache reset, the branches no real engine here reaches.

The first two cases run for real in `tests/vllm/test_engine_caches.py` (a request in
flight makes vLLM's plain reset answer False; the preempting reset then succeeds). vLLM
refuses even the preempting reset only while a request waits for a remote KV transfer
(a KV connector across hosts), which no test here can set up, so those answers are
stood in for by the callables below; the test says what the handle must then do: fail
the push with the fix, never report a flush that did not happen.
"""

from __future__ import annotations

import pytest

from enginehooks.core.errors import ReplicaError
from enginehooks.vllm_ext.handles import _prefix_cache_reset


def test_a_reset_that_succeeds_asks_nothing_more() -> None:
    calls: list[str] = []
    _prefix_cache_reset("r", lambda: calls.append("plain") or True,
                        lambda: calls.append("preempting") or True)
    assert calls == ["plain"]


def test_a_refused_reset_is_asked_again_preempting() -> None:
    calls: list[str] = []
    _prefix_cache_reset("r", lambda: calls.append("plain") or False,
                        lambda: calls.append("preempting") or True)
    assert calls == ["plain", "preempting"]


def test_a_reset_refused_even_preempting_fails_the_push_with_the_fix() -> None:
    with pytest.raises(ReplicaError, match=r"could not be reset.*pause with mode"):
        _prefix_cache_reset("r", lambda: False, lambda: False)


def test_a_preempting_reset_that_raises_fails_the_push_with_the_fix() -> None:
    def boom() -> bool:
        raise RuntimeError("Failed to reset KV cache even when all the running requests "
                           "are preempted")

    with pytest.raises(ReplicaError, match=r"could not be reset.*RuntimeError.*push again"):
        _prefix_cache_reset("r", lambda: False, boom)

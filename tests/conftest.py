"""Fixtures shared by every suite. Engine tests start the real engines (vLLM CPU,
SGLang CPU) on tiny models built here: no model hub is reachable.

Layout: `unit/` (no engine), `contract/` (one replica-contract suite, run against
every engine installed in the environment), `conformance/` (model families x engines
x trainers), `vllm/` and `sglang/` (engine-specific: servers, async, mixed fleets),
`gpu/` (device machines only). Each engine pins its own torch, so `scripts/test.sh`
runs each environment's share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The test kit (not in the wheel): importing it also puts this checkout on PYTHONPATH,
# for the engine drivers, trainers and ranks that tests start (its docstring says why).
import enginehooks_testkit  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: fast start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints: a Llama (untied) and a Qwen2 with qkv bias and tied embeddings."""
    from enginehooks_testkit.tiny import make_test_models

    return make_test_models(tmp_path_factory.mktemp("models"))


@pytest.fixture
def plugin() -> Iterator[Callable[..., Any]]:
    """`plugin(obj, name=...)` registers `obj` with the plugin manager for this test
    only; it is unregistered afterwards even when the test fails."""
    from enginehooks.plugins import get_plugin_manager, register_plugin, unregister_plugin

    added: list[Any] = []

    def register(obj: Any, name: str | None = None) -> Any:
        register_plugin(obj, name=name)
        added.append(obj)
        return obj

    yield register
    for obj in reversed(added):
        if get_plugin_manager().is_registered(obj):
            unregister_plugin(obj)


# -- leaving the test process without tearing down gloo's threads --------------------
# Process groups parked after a failed collective (`transports.broadcast._GRAVEYARD`)
# used to abort the interpreter's finalisation after the last test (gloo's I/O thread
# throwing `gloo::IoException` out of C++: SIGABRT, exit status 134, every test passed).
# The library now releases them at exit (`broadcast._release_parked`; tested by
# `test_a_process_with_parked_groups_exits_with_its_own_status`), and tests/library
# finalises cleanly (ENGINEHOOKS_TEST_FINALIZE=1: exit 0). The engine
# suites run vLLM and gloo groups of the engines' own in this interpreter and have not
# been run that way yet, so the test process still ends with pytest's own exit status,
# skipping finalisation, unless ENGINEHOOKS_TEST_FINALIZE=1. This hides nothing a test
# asserts: it runs after the last test, the summary and every report are written. Not
# under mutmut, which runs pytest inside its own (forked) worker and must get control
# back to report.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if (_EXIT_STATUS and os.environ.get("ENGINEHOOKS_TEST_FINALIZE") != "1"
            and "MUTANT_UNDER_TEST" not in os.environ):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])

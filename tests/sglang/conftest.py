"""Fixtures for the SGLang suites: the real SGLang 0.5.23 on CPU as an HTTP server, on
tiny models built here (no model hub is reachable).

Run in the SGLang environment (`scripts/run.sh sglang python -m pytest tests/sglang`).
SGLang spawns its scheduler processes, which inherit the environment set below; the
test-only `sgl_kernel` stand-in (`enginehooks/demo/sgl_kernel_stub`) must be
importable there too (it raises if any kernel is ever called, so a real kernel
dependency fails a test instead of passing silently). Servers start in 30-40 s, so
they are shared by the session: every test pushes the weights it then checks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import have

if not have("sglang"):
    pytest.skip("SGLang runs in its own environment (scripts/test.sh runs this there)",
                allow_module_level=True)

from enginehooks_testkit.servers import cpu_env
from tests.sglang.helpers import SGLangServerProcess

os.environ.update(cpu_env())
os.environ["SGLANG_PLUGINS"] = "enginehooks"  # only our plugin: no third-party hooks

#: Files in the order they run: those that start their own engines first, then the
#: users of the shared server, before the suites that start engines of their own (the
#: contract and conformance cells): the shared server, idle through those, did not
#: survive them in CI (its port refused connections, its log silent), so nothing uses
#: it after them.
FILE_ORDER = ["test_plugin_and_demo.py", "test_mixed.py", "test_copy_plan.py",
              "test_engine_caches.py", "test_layout_sglang.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def key(item: pytest.Item) -> int:
        name = Path(str(item.fspath)).name
        return FILE_ORDER.index(name) if name in FILE_ORDER else len(FILE_ORDER)

    items.sort(key=key)  # stable: order inside a file is kept


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def sglang_server(model_dirs: dict[str, Path], logs_dir: Path) -> Iterator[SGLangServerProcess]:
    with SGLangServerProcess(model_dirs["llama"], logs_dir / "sglang-server.log") as srv:
        yield srv

"""The architecture holds: no import cycle, every module imports on its own in a fresh
interpreter in any order, the library imports neither the tests nor the test kit, the
documented public names import from their documented paths, docs/architecture.md's file
tree names every module and nothing else, every engine implements every verb of the
engine contract, and the tests follow their layout (by environment, then by module)."""

from __future__ import annotations

import importlib
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import enginehooks_testkit
from enginehooks.engine.contract import VERBS, method_name
from enginehooks_testkit.import_graph import LAYERS, cycles, edges, layer_of, modules, upward
from enginehooks_testkit.import_graph import ROOT as PACKAGE_DIR

#: The test kit's own modules (they import on their own too).
KIT_DIR = Path(enginehooks_testkit.__file__).resolve().parent

#: documented import path -> public names (README, docs/*.md)
PUBLIC: dict[str, list[str]] = {
    "enginehooks": ["WeightSync", "EngineHandle", "PushReport", "Manifest", "TensorSpec", "plan",
                    "hookimpl", "get_plugin_manager", "EngineHooksError", "ConfigError",
                    "ManifestError", "TransportError", "ChecksumError", "SenderAborted",
                    "PushTimeout", "ReplicaError", "PluginError"],
    "enginehooks.vllm_ext": ["WorkerExtension", "VLLMEngine", "VLLMAsyncEngine", "VLLMServer"],
    "enginehooks.sglang_ext": ["SGLangEngine", "SGLangServer", "register"],
    "enginehooks.trainer_side": ["TrainerAdapter", "CheckpointAdapter", "CheckpointFormat",
                                 "ModuleAdapter", "StateDictAdapter", "PeftAdapter",
                                 "FSDP1Adapter", "FSDP2Adapter", "MegatronBridgeAdapter",
                                 "LockstepAdapter", "LockstepError", "PushAborted", "adapter_for",
                                 "follow", "push", "hf_name"],
    "enginehooks.transports": ["Transport", "Sender", "Receiver", "Target", "GroupRequest",
                               "GlooTransport", "NcclTransport", "CudaIpcTransport", "ShmTransport",
                               "DiskTransport"],
    "enginehooks.engine.contract": ["VERBS", "EngineBinding", "method_name", "dispatch"],
    "enginehooks.engine.local": ["LocalEngine"],
    "enginehooks.engine.apply": ["ApplyTarget", "ApplyBinding"],
    "enginehooks.engine.expectations": ["Expectations", "LoaderExpectations"],
    "enginehooks.plugins": ["get_plugin_manager", "register_plugin", "unregister_plugin",
                            "transports", "get_transport", "trainer_adapters", "DEFAULT_PLUGINS"],
    "enginehooks.markers": ["hookimpl", "hookspec"],
}


@pytest.mark.parametrize("type_checking", [False, True])
def test_the_import_graph_has_no_cycle(type_checking: bool) -> None:
    """No import circle, imports for type checking included (a circle through them
    still ties the modules' meanings together, and breaks the day one turns real)."""
    graph = edges(type_checking)
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100, "the graph was not read"
    assert cycles(graph) == []


@pytest.mark.parametrize("type_checking", [False, True])
def test_no_import_goes_up_a_layer(type_checking: bool) -> None:
    """Every module imports only its own layer and the layers below (`LAYERS`): in
    particular nothing below `control/` (core, transports, trainer_side, the plugin
    core, metrics) imports it, not even for types."""
    graph = edges(type_checking)
    assert upward(graph) == []
    below = {m for m in graph if layer_of(m) < layer_of("enginehooks.control.sync")}
    assert {"enginehooks.core.manifest", "enginehooks.transports.multisender",
            "enginehooks.trainer_side.channel", "enginehooks.hookspecs"} <= below
    into_control = sorted((m, d) for m in below for d in graph[m]
                          if d.startswith("enginehooks.control"))
    assert into_control == []


def test_the_layer_check_sees_an_arrow_up() -> None:
    """The check itself: an import from a lower layer into control/ is reported."""
    graph = {"enginehooks.transports.x": {"enginehooks.control.sync"},
             "enginehooks.control.sync": {"enginehooks.core.manifest"},
             "enginehooks.core.manifest": set()}
    assert upward(graph) == [("enginehooks.transports.x", "enginehooks.control.sync")]
    assert all(layer_of(m) < len(LAYERS) for m in modules())  # every module has a layer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_module_imports_in_any_order_in_a_fresh_interpreter(seed: int) -> None:
    names = sorted(modules()) + sorted(modules(KIT_DIR))
    random.Random(seed).shuffle(names)
    script = f"import importlib\nfor m in {names!r}:\n    importlib.import_module(m)\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_library_never_imports_the_tests() -> None:
    for mod, deps in edges().items():
        assert not any(d.startswith("tests") for d in deps), mod
    for path in modules().values():
        assert "from tests" not in path.read_text() and "import tests" not in path.read_text(), path


def test_the_library_never_imports_the_test_kit() -> None:
    """The kit is not in the wheel: an import of it from the library would fail there."""
    assert KIT_DIR.name == "enginehooks_testkit" and KIT_DIR.parent == PACKAGE_DIR.parent
    for path in modules().values():
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) enginehooks_testkit\b", text, re.M), path


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_names_import_from_their_documented_path(path: str) -> None:
    module = importlib.import_module(path)
    missing = [n for n in PUBLIC[path] if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"


def test_every_engine_implements_every_verb() -> None:
    from enginehooks.engine.side import EngineSide
    from enginehooks.sglang_ext.scheduler import METHODS
    from enginehooks.vllm_ext import WorkerExtension

    for verb in VERBS:
        assert callable(getattr(EngineSide, verb, None)), f"EngineSide lacks {verb}"
        assert callable(getattr(WorkerExtension, method_name(verb), None)), verb
    assert set(METHODS) == {method_name(v) for v in VERBS}


def architecture_tree() -> dict[str, set[str]]:
    """docs/architecture.md's file tree of the package: folder (relative to `enginehooks/`;
    "" for the package's top) -> the names the tree gives in it, files `x.py` and
    sub-folders `x/`. A line `  name/ ...` opens a folder, any other line at that indent
    the top, deeper lines continue the one above; lines at column 0 are beside the package."""
    doc = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    found = re.search(r"^```\nenginehooks/\n(.*?)^```", doc, re.M | re.S)
    assert found, "docs/architecture.md has no file tree of enginehooks/"
    tree: dict[str, set[str]] = {}
    folder: str | None = None
    for line in found.group(1).splitlines():
        if not line.strip():
            continue
        rest = line
        if not line.startswith(" "):
            folder = None
        elif head := re.match(r"^  (\w+)/", line):
            folder, rest = head.group(1), line[head.end():]
        elif re.match(r"^  \S", line):
            folder = ""
        if folder is not None:  # `x.py` and `x/`, not "go/no-go" nor a dotted path
            names = re.findall(r"(?<![\w/.])(\w+(?:\.py|/))(?![\w-])", rest)
            tree.setdefault(folder, set()).update(names)
    return tree


def test_the_architecture_tree_names_every_module_and_nothing_else() -> None:
    tree = architecture_tree()
    assert len(tree) > 8 and "" in tree, f"the tree was not read: {sorted(tree)}"
    for folder, names in tree.items():
        assert (PACKAGE_DIR / folder).is_dir(), f"the tree names {folder}/, which is not there"
        for name in names:
            assert (PACKAGE_DIR / folder / name).exists(), \
                f"the tree names {folder}/{name}, which is not there"
    packages = {p.parent.relative_to(PACKAGE_DIR).as_posix()
                for p in PACKAGE_DIR.glob("*/__init__.py")}
    assert packages <= set(tree), f"the tree lacks the folders {sorted(packages - set(tree))}"
    for path in modules().values():
        parts = path.relative_to(PACKAGE_DIR).parts
        if len(parts) == 1:
            assert parts[0] in tree[""], f"the tree lacks {parts[0]} at the package's top"
        elif len(parts) == 2:
            assert parts[1] == "__init__.py" or parts[1] in tree[parts[0]], \
                f"the tree lacks {parts[0]}/{parts[1]}"
        else:
            assert f"{parts[1]}/" in tree[parts[0]], f"the tree lacks {parts[0]}/{parts[1]}/"


#: The tests' top folders: what a test needs to run (docs/testing.md), plus shared helpers.
TEST_ENVIRONMENTS = {"library", "engines", "vllm", "sglang", "megatron", "gpu", "multihost"}
TEST_HELPERS = {"support", "plugins"}


def _layout_errors(tests_dir: Path, package_dir: Path) -> list[str]:
    """Every place a test file breaks the layout: a test outside an environment folder, a
    folder of `tests/library` that names no package of the library, a mutation test
    (`test_<x>_mutants.py`) with neither the module `<x>` nor `test_<x>.py` beside it."""
    errors = []
    packages = {p.name for p in package_dir.iterdir() if (p / "__init__.py").is_file()}
    for path in sorted(tests_dir.rglob("test_*.py")):
        rel = path.relative_to(tests_dir)
        top = rel.parts[0]
        if len(rel.parts) == 1 or top not in TEST_ENVIRONMENTS | TEST_HELPERS:
            errors.append(f"{rel}: not under a folder that says what it needs "
                          f"({', '.join(sorted(TEST_ENVIRONMENTS))})")
            continue
        if top != "library" or len(rel.parts) == 2:
            continue
        folder = rel.parts[1]
        if folder != "project" and folder not in packages:
            errors.append(f"{rel}: tests/library/{folder} names no package of the library")
        stem = path.stem.removeprefix("test_")
        if stem.endswith("_mutants"):
            module = stem.removesuffix("_mutants")
            if not ((package_dir / folder / f"{module}.py").is_file()
                    or (path.parent / f"test_{module}.py").is_file()):
                errors.append(f"{rel}: a mutation test beside neither the module {module} "
                              f"nor test_{module}.py")
    return errors


def test_tests_are_organised_by_environment_then_module() -> None:
    tests_dir = Path(__file__).resolve().parents[2]
    assert _layout_errors(tests_dir, PACKAGE_DIR) == []


def test_the_layout_check_sees_a_misplaced_test(tmp_path: Path) -> None:
    """The check above can fail: a test at the top, a folder for no package, and an orphaned
    mutation test are each named."""
    package = tmp_path / "pkg"
    (package / "core").mkdir(parents=True)
    (package / "core" / "__init__.py").touch()
    (package / "core" / "auth.py").touch()
    tests = tmp_path / "tests"
    for rel in ["test_top.py", "unit/test_x.py", "library/nowhere/test_y.py",
                "library/core/test_ghost_mutants.py", "library/core/test_auth_mutants.py",
                "vllm/test_fine.py"]:
        (tests / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests / rel).touch()
    errors = _layout_errors(tests, package)
    assert [e.split(":")[0] for e in errors] == [
        "library/core/test_ghost_mutants.py", "library/nowhere/test_y.py", "test_top.py",
        "unit/test_x.py"]

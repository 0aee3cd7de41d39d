"""The architecture holds: no import cycle, every module imports on its own in a fresh
interpreter in any order, the documented public names import from their documented
paths, and every engine implements every verb of the engine contract."""

from __future__ import annotations

import importlib
import random
import subprocess
import sys

import pytest

from enginehooks.engine.contract import VERBS, method_name
from enginehooks.testing.import_graph import cycles, edges, modules

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


def test_the_import_graph_has_no_cycle() -> None:
    graph = edges()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100, "the graph was not read"
    assert cycles(graph) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_module_imports_in_any_order_in_a_fresh_interpreter(seed: int) -> None:
    names = sorted(modules())
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

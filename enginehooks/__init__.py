"""enginehooks: move fresh weights from an RL trainer into running inference engines.

    from enginehooks import WeightSync
    from enginehooks.vllm_ext import VLLMEngine

    sync = WeightSync(transport="gloo")
    sync.add_replica(VLLMEngine(llm))
    report = sync.push(model, version=1)
"""

from __future__ import annotations

from enginehooks.errors import (
    ChecksumError,
    EngineHooksError,
    ManifestError,
    PluginError,
    PushTimeout,
    ReplicaError,
    SenderAborted,
    TransportError,
)
from enginehooks.handles import EngineHandle
from enginehooks.manifest import Manifest, TensorSpec, plan
from enginehooks.plugins import get_plugin_manager, hookimpl
from enginehooks.report import PushReport
from enginehooks.sync import WeightSync

__version__ = "0.1.0"

__all__ = [
    "ChecksumError",
    "EngineHandle",
    "EngineHooksError",
    "Manifest",
    "ManifestError",
    "PluginError",
    "PushReport",
    "PushTimeout",
    "ReplicaError",
    "SenderAborted",
    "TensorSpec",
    "TransportError",
    "WeightSync",
    "get_plugin_manager",
    "hookimpl",
    "plan",
]

"""enginehooks: move fresh weights from an RL trainer into running inference engines.

    from enginehooks import WeightSync
    from enginehooks.vllm_ext import VLLMEngine

    sync = WeightSync(transport="gloo")
    sync.add_replica(VLLMEngine(llm))
    report = sync.push(model, version=1)
"""

from __future__ import annotations

from enginehooks.control.handles import EngineHandle
from enginehooks.control.sync import WeightSync
from enginehooks.core.errors import (
    ChecksumError,
    ConfigError,
    EngineHooksError,
    EngineTorn,
    ManifestError,
    PluginError,
    PushTimeout,
    ReplicaError,
    SenderAborted,
    TransportError,
)
from enginehooks.core.manifest import Manifest, TensorSpec, plan
from enginehooks.core.report import PushReport
from enginehooks.markers import hookimpl
from enginehooks.plugins import get_plugin_manager

__version__ = "0.1.0"

__all__ = [
    "ChecksumError",
    "ConfigError",
    "EngineHandle",
    "EngineHooksError",
    "EngineTorn",
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

"""LoRA adapters pushed as adapters, not merged: only the adapter's bytes move, and each
engine loads them with its own adapter loader, beside the base weights, under a model name
per version (`name@version`), so several versions serve at once (rollouts pinned to the
version that produced them, for off-policy staleness) and the oldest beyond `keep` are
unloaded.

Names, layout and config are PEFT's: the upload is exactly what `save_pretrained` writes
for the adapter (read back from a temporary folder), which is also what the exact oracle
loads (`tests/vllm/test_lora_adapters.py`: a push equals the same server loading the
adapter from `save_pretrained`'s folder).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enginehooks.control.handles import EngineHandle
from enginehooks.core.errors import ConfigError, EngineHooksError
from enginehooks.wire.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterUpload, served_name


def adapter_upload(model: Any, version: int | str, *, adapter: str = "default",
                   name: str | None = None) -> AdapterUpload:
    """The upload of PEFT model `model`'s adapter `adapter` as `name` (default: the
    adapter's own name) version `version`: the files PEFT writes for it."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ConfigError("push_adapter needs peft installed (pip install peft)") from None
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(model, PeftModel) or not isinstance(peft_config, dict):
        raise ConfigError(f"push_adapter needs a PEFT model (peft.PeftModel); got "
                          f"{type(model).__name__}")
    if adapter not in peft_config:
        raise ConfigError(f"the model has no adapter {adapter!r}; it has "
                          f"{', '.join(sorted(peft_config)) or 'none'}")
    with tempfile.TemporaryDirectory(prefix="enginehooks-adapter-") as tmp:
        model.save_pretrained(tmp, selected_adapters=[adapter], safe_serialization=True)
        # PEFT writes the adapter named "default" at the top, any other in its own folder
        folder = Path(tmp) if adapter == "default" else Path(tmp) / adapter
        try:
            config = (folder / CONFIG_FILE).read_bytes()
            weights = (folder / WEIGHTS_FILE).read_bytes()
        except FileNotFoundError as e:
            raise ConfigError(f"PEFT's save_pretrained wrote no {Path(e.filename).name} for "
                              f"adapter {adapter!r}") from None
    return AdapterUpload.of_files(name or adapter, str(version), config, weights)


@dataclass
class AdapterReport:
    """What one adapter push did: the model name to generate with, the bytes moved per
    replica, and the versions unloaded to keep `keep` live."""

    name: str
    version: str
    served: str
    bytes_per_replica: int
    replicas: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    seconds: float = 0.0


class AdapterVersions:
    """The versions of each adapter this trainer loaded, oldest first."""

    def __init__(self) -> None:
        self._live: dict[str, list[str]] = {}

    def push(self, replicas: Sequence[EngineHandle], upload: AdapterUpload, keep: int,
             timeout_s: float) -> AdapterReport:
        """Load `upload` on every replica, or on none: a replica that refuses it has the
        others unload it again, and the error says why. Then unload the versions beyond
        the newest `keep`."""
        if keep < 1:
            raise ConfigError(f"keep={keep}: at least the version just pushed stays loaded")
        start = time.perf_counter()
        loaded: list[EngineHandle] = []
        try:
            for replica in replicas:
                replica.load_adapter(upload, timeout_s)
                loaded.append(replica)
        except BaseException:
            for replica in loaded:
                with contextlib.suppress(EngineHooksError):
                    replica.unload_adapter(upload.name, upload.version, timeout_s)
            raise
        live = self._live.setdefault(upload.name, [])
        live.append(upload.version)
        unloaded = []
        while len(live) > keep:
            old = live.pop(0)
            for replica in replicas:
                replica.unload_adapter(upload.name, old, timeout_s)
            unloaded.append(served_name(upload.name, old))
        return AdapterReport(upload.name, upload.version, served_name(upload.name, upload.version),
                             len(upload.weights) + len(upload.config),
                             [r.name for r in replicas], unloaded,
                             time.perf_counter() - start)

    def live(self, name: str) -> list[str]:
        return list(self._live.get(name, []))

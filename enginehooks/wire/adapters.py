"""A LoRA adapter on the wire: the two files PEFT's `save_pretrained` writes
(`adapter_config.json`, `adapter_model.safetensors`), named by adapter and version, with
the digest of the weights. The trainer builds one (`AdapterUpload.of_files`), the server
decodes and checks it (`AdapterUpload.from_body`) before anything is written: a name that
cannot name a folder, a digest that does not match, weights that are not safetensors or a
config that is not a PEFT LoRA config are refused with the reason, and nothing changes.

The body is JSON (the weights base64-encoded: adapters are megabytes, not gigabytes), so
the route token that signs control routes signs it whole; never pickle.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from enginehooks.core.errors import ConfigError, ManifestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: adapter names and versions become folder names and served model names
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: bytes of weights one upload may carry (an adapter of a 70B model at rank 64 is ~1.7 GB
#: in bf16; a larger one belongs on the weights path, not in one HTTP body)
MAX_WEIGHT_BYTES = 4 << 30


def check_part(what: str, value: str) -> str:
    """`value` as a folder and model-name part, or `ConfigError` saying what fits."""
    if not isinstance(value, str) or not _SAFE.fullmatch(value) or ".." in value:
        raise ConfigError(f"adapter {what} {value!r}: use 1-128 letters, digits, '.', '_' "
                          "or '-', starting with a letter or digit")
    return value


def served_name(name: str, version: str) -> str:
    """The model name requests use to generate with one version of an adapter."""
    return f"{check_part('name', name)}@{check_part('version', version)}"


def _check_config(config: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(config)
    except ValueError as e:
        raise ManifestError(f"{CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(parsed, dict) or str(parsed.get("peft_type", "")).upper() != "LORA":
        raise ManifestError(f"{CONFIG_FILE} is not a PEFT LoRA config (peft_type must be "
                            "\"LORA\")")
    return parsed


def _check_weights(weights: bytes) -> None:
    """The safetensors header parses and its offsets stay inside the file (the format's
    own rules, read without loading any tensor)."""
    if len(weights) < 8:
        raise ManifestError(f"{WEIGHTS_FILE} is too short to be safetensors")
    size = int.from_bytes(weights[:8], "little")
    if size > len(weights) - 8:
        raise ManifestError(f"{WEIGHTS_FILE}: header of {size} bytes in a file of "
                            f"{len(weights)}")
    try:
        header = json.loads(weights[8:8 + size])
    except ValueError as e:
        raise ManifestError(f"{WEIGHTS_FILE}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ManifestError(f"{WEIGHTS_FILE}: header is not an object")
    data = len(weights) - 8 - size
    tensors = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            raise ManifestError(f"{WEIGHTS_FILE}: tensor {key!r} lies outside the file")
        tensors += 1
    if tensors == 0:
        raise ManifestError(f"{WEIGHTS_FILE} holds no tensor")


@dataclass(frozen=True)
class AdapterUpload:
    """One version of one adapter, as sent: its files' bytes and the weights' digest."""

    name: str
    version: str
    config: bytes
    weights: bytes
    sha256: str

    @classmethod
    def of_files(cls, name: str, version: str, config: bytes, weights: bytes) -> AdapterUpload:
        served_name(name, version)
        return cls(name, version, config, weights, hashlib.sha256(weights).hexdigest())

    def body(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version,
                "config": self.config.decode(), "sha256": self.sha256,
                "weights": base64.b64encode(self.weights).decode()}

    @classmethod
    def from_body(cls, raw: Any) -> AdapterUpload:
        """Decode and check a body; `ConfigError` / `ManifestError` naming what is wrong."""
        if not isinstance(raw, dict):
            raise ManifestError("an adapter upload is a JSON object")
        missing = sorted({"name", "version", "config", "sha256", "weights"} - set(raw))
        if missing:
            raise ManifestError(f"an adapter upload without {', '.join(missing)}")
        name, version = str(raw["name"]), str(raw["version"])
        served_name(name, version)
        text = raw["weights"]
        if not isinstance(text, str) or len(text) > (MAX_WEIGHT_BYTES // 3 + 1) * 4:
            raise ManifestError(f"adapter weights over {MAX_WEIGHT_BYTES >> 30} GiB, or not "
                                "base64 text")
        try:
            weights = base64.b64decode(text, validate=True)
        except ValueError:
            raise ManifestError("adapter weights are not base64") from None
        digest = hashlib.sha256(weights).hexdigest()
        if digest != raw["sha256"]:
            raise ManifestError(f"adapter {name}@{version}: the weights' sha256 is {digest}, "
                                f"the sender's {raw['sha256']!r} (changed in transit)")
        config = str(raw["config"]).encode()
        _check_config(config)
        _check_weights(weights)
        return cls(name, version, config, weights, digest)

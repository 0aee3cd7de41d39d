"""`engine/adapter_store.py`: each version in a folder of its own, written whole or not at
all, never overwritten, removable; the root private to the server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from enginehooks.core.errors import ConfigError
from enginehooks.engine.adapter_store import AdapterStore
from enginehooks.wire.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterUpload

CONFIG = json.dumps({"peft_type": "LORA", "r": 4}).encode()
TENSORS = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.arange(32.0).reshape(4, 8)}


def upload(version: str = "1") -> AdapterUpload:
    return AdapterUpload.of_files("policy", version, CONFIG, save(TENSORS))


def test_a_version_lands_as_peft_writes_it_in_a_private_root(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "root")
    folder = store.put(upload())
    assert folder == tmp_path / "root" / "policy" / "1"
    assert (folder / CONFIG_FILE).read_bytes() == CONFIG
    assert torch.equal(load_file(folder / WEIGHTS_FILE)[next(iter(TENSORS))],
                       next(iter(TENSORS.values())))
    assert (tmp_path / "root").stat().st_mode & 0o077 == 0
    assert store.versions("policy") == ["1"]


def test_a_version_already_pushed_is_refused_and_kept(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    store.put(upload())
    other = AdapterUpload.of_files("policy", "1", CONFIG, save({"x": torch.zeros(2)}))
    with pytest.raises(ConfigError, match="already pushed"):
        store.put(other)
    assert (store.folder("policy", "1") / WEIGHTS_FILE).read_bytes() == upload().weights


def test_a_removed_version_can_be_pushed_again(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    store.put(upload("2"))
    assert store.remove("policy", "2") and not store.remove("policy", "2")
    assert store.versions("policy") == []
    store.put(upload("2"))
    assert store.versions("policy") == ["2"]


def test_a_failed_write_leaves_no_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = AdapterStore(tmp_path)

    def full_disk(self: Path, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(OSError):
        store.put(upload("3"))
    monkeypatch.undo()
    assert store.versions("policy") == [] and list((tmp_path / "policy").iterdir()) == []

"""`control/adapters.py`: an adapter version loads on every replica or on none, the newest
`keep` stay loaded, and the upload is exactly what PEFT's `save_pretrained` writes.

The replicas here are recording `EngineHandle`s (a stand-in: what they record is the
coordinator's decisions; loading into a real engine is tests/vllm/test_lora_adapters.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from enginehooks.control.adapters import AdapterVersions, adapter_upload
from enginehooks.control.handles import EngineHandle
from enginehooks.core.errors import ConfigError
from enginehooks.wire.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterUpload

peft = pytest.importorskip("peft")


class Recording(EngineHandle):
    def __init__(self, name: str, refuse: bool = False) -> None:
        self.name, self.refuse = name, refuse
        self.live: list[str] = []

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        raise AssertionError("an adapter push makes no worker RPC")

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        raise AssertionError("not flushed")

    def load_adapter(self, upload: AdapterUpload, timeout_s: float) -> str:
        if self.refuse:
            raise ConfigError(f"{self.name} refused")
        self.live.append(upload.version)
        return f"{upload.name}@{upload.version}"

    def unload_adapter(self, name: str, version: str, timeout_s: float) -> None:
        self.live.remove(version)


def upload(version: str) -> AdapterUpload:
    return AdapterUpload.of_files("p", version, b'{"peft_type": "LORA"}', b"w" * 10)


def test_all_replicas_or_none() -> None:
    a, b, c = Recording("a"), Recording("b", refuse=True), Recording("c")
    with pytest.raises(ConfigError, match="b refused"):
        AdapterVersions().push([a, b, c], upload("1"), keep=2, timeout_s=1)
    assert a.live == [] and c.live == []


def test_the_newest_keep_versions_stay_loaded() -> None:
    a, b = Recording("a"), Recording("b")
    versions = AdapterVersions()
    reports = [versions.push([a, b], upload(v), keep=2, timeout_s=1) for v in "1234"]
    assert a.live == b.live == ["3", "4"] and versions.live("p") == ["3", "4"]
    assert [r.unloaded for r in reports] == [[], [], ["p@1"], ["p@2"]]
    assert reports[-1].served == "p@4" and reports[-1].replicas == ["a", "b"]
    with pytest.raises(ConfigError, match="keep=0"):
        versions.push([a], upload("5"), keep=0, timeout_s=1)


def test_the_upload_is_what_peft_saves(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["v_proj"]))
    for adapter, folder in (("default", tmp_path), ("second", tmp_path / "second")):
        model.save_pretrained(tmp_path, selected_adapters=[adapter])
        up = adapter_upload(model, 7, adapter=adapter)
        assert (up.name, up.version) == (adapter, "7")
        assert up.weights == (folder / WEIGHTS_FILE).read_bytes()
        assert json.loads(up.config) == json.loads((folder / CONFIG_FILE).read_bytes())
    with pytest.raises(ConfigError, match="no adapter 'third'"):
        adapter_upload(model, 1, adapter="third")
    with pytest.raises(ConfigError, match="needs a PEFT model"):
        adapter_upload(base, 1)

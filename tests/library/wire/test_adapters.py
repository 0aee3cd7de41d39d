"""`wire/adapters.py`: an adapter upload is checked whole before anything is written: its
names (they become folders and model names), its digest, its config and its safetensors
header; each refusal names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from enginehooks.core.errors import ConfigError, ManifestError
from enginehooks.wire.adapters import AdapterUpload, served_name

CONFIG = json.dumps({"peft_type": "LORA", "r": 4}).encode()
#: a header whose one tensor needs 16 bytes of data where the file has 8
OUTSIDE = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
WEIGHTS = save({"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(4, 8)})


def body(**changes: object) -> dict[str, object]:
    return {**AdapterUpload.of_files("policy", "3", CONFIG, WEIGHTS).body(), **changes}


def test_an_upload_round_trips() -> None:
    upload = AdapterUpload.from_body(json.loads(json.dumps(body())))
    assert (upload.name, upload.version, upload.config, upload.weights) == (
        "policy", "3", CONFIG, WEIGHTS)
    assert served_name("policy", "3") == "policy@3"


@pytest.mark.parametrize("name", ["../etc", "a/b", "", ".hidden", "a..b", "x" * 129, "a b"])
def test_names_that_cannot_name_a_folder_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="adapter name"):
        AdapterUpload.from_body(body(name=name))
    with pytest.raises(ConfigError, match="adapter version"):
        AdapterUpload.from_body(body(version=name))


def test_weights_changed_in_transit_are_refused_by_digest() -> None:
    tampered = AdapterUpload("policy", "3", CONFIG, WEIGHTS[:-1] + b"\x01", "0" * 64).body()
    with pytest.raises(ManifestError, match="sha256"):
        AdapterUpload.from_body(body(weights=tampered["weights"]))


@pytest.mark.parametrize("config, words", [
    (b"not json", "not JSON"),
    (json.dumps({"peft_type": "PREFIX_TUNING"}).encode(), "not a PEFT LoRA config"),
    (json.dumps([1]).encode(), "not a PEFT LoRA config"),
])
def test_a_config_that_is_not_a_lora_config_is_refused(config: bytes, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        AdapterUpload.from_body(AdapterUpload.of_files("p", "1", config, WEIGHTS).body())


@pytest.mark.parametrize("weights, words", [
    (b"\x01", "too short"),
    ((10**6).to_bytes(8, "little") + b"{}", "header of"),
    ((4).to_bytes(8, "little") + b"nope", "not JSON"),
    ((2).to_bytes(8, "little") + b"{}", "no tensor"),
    (len(OUTSIDE).to_bytes(8, "little") + OUTSIDE + b"\0" * 8, "outside the file"),
])
def test_weights_that_are_not_safetensors_are_refused(weights: bytes, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        AdapterUpload.from_body(AdapterUpload.of_files("p", "1", CONFIG, weights).body())


def test_a_body_missing_a_field_or_not_base64_is_refused() -> None:
    raw = body()
    del raw["sha256"]
    with pytest.raises(ManifestError, match="without sha256"):
        AdapterUpload.from_body(raw)
    with pytest.raises(ManifestError, match="not base64"):
        AdapterUpload.from_body(body(weights="***"))
    with pytest.raises(ManifestError, match="JSON object"):
        AdapterUpload.from_body([1])

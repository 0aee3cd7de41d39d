"""Pushes into a real in-process `sglang.Engine` (CPU): greedy tokens must equal HF
transformers on the same new weights, and generations must carry the pushed version."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import engine_greedy, hf_reference, load_hf, perturb

from enginehooks import ManifestError, WeightSync
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.sglang_ext import SGLangEngine
from enginehooks.trainer_side import StateDictAdapter

READABLE = ["model.embed_tokens.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight"]


def assert_matches(engine: Any, handle: SGLangEngine, model: Any, version: Any) -> None:
    """The correctness bar: SGLang's greedy tokens equal HF's on the pushed weights, the
    version shows in meta_info, and weights SGLang keeps unfused are bit-exact."""
    tokens, versions = engine_greedy(engine)
    assert tokens == hf_reference(model)
    assert versions == {str(version)}
    assert handle.version() == version
    digests = handle.digests(READABLE)
    assert set(digests) == set(READABLE)
    sd = model.state_dict()
    for name, d in digests.items():
        want = sd[name].detach().contiguous()
        assert d["crc32"] == zlib.crc32(want.reshape(-1).view(torch.uint8).numpy()), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gloo_push_matches_hf(engines: dict[str, Any], model_dirs: dict[str, Path],
                              arch: str) -> None:
    engine, model = engines[arch], perturb(load_hf(model_dirs[arch]), seed=11)
    before, _ = engine_greedy(engine)
    handle = SGLangEngine(engine, name=f"sglang-{arch}")
    # Small buckets: many buckets, and the embedding is cut across several of them.
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        report = sync.push(model, version=1)
    assert report.ok and report.buckets > 4
    assert engine_greedy(engine)[0] != before, "the update did not change generation"
    assert_matches(engine, handle, model, 1)


def test_tied_embedding_moves_output_head(engines: dict[str, Any],
                                          model_dirs: dict[str, Path]) -> None:
    """Qwen2 tied: only the (tied) embedding changes; SGLang's output head must follow."""
    model = load_hf(model_dirs["qwen2"])
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.5)
    handle = SGLangEngine(engines["qwen2"], name="sglang-qwen2")
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version="tied-1")
    assert_matches(engines["qwen2"], handle, model, "tied-1")


def test_disk_push_and_second_push(engines: dict[str, Any], model_dirs: dict[str, Path],
                                   tmp_path: Path) -> None:
    engine, model = engines["llama"], load_hf(model_dirs["llama"])
    handle = SGLangEngine(engine, name="sglang-llama")
    with WeightSync("disk", bucket_bytes=64 << 10, timeout_s=60,
                    transport_options={"root": tmp_path / "ckpt"}) as sync:
        sync.add_replica(handle)
        sync.push(perturb(model, seed=31), version=7)
        assert_matches(engine, handle, model, 7)
        report = sync.push(perturb(model, seed=32), version=8)
    assert report.buckets > 1
    assert_matches(engine, handle, model, 8)


def test_pause_modes_around_push(engines: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    engine, model = engines["llama"], perturb(load_hf(model_dirs["llama"]), seed=35)
    for i, mode in enumerate(("abort", "retract", "in_place")):
        handle = SGLangEngine(engine, name=f"sglang-{mode}", pause_mode=mode)
        with WeightSync("gloo", timeout_s=60, pause=True) as sync:
            sync.add_replica(handle)
            sync.push(perturb(model, seed=36 + i), version=f"p{i}")
        assert_matches(engine, handle, model, f"p{i}")


def _bad_manifest_refused(engine: Any, model: Any, mutate: Any, expect: str) -> None:
    handle = SGLangEngine(engine, name="sglang-llama")
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version=100)
        good_tokens, _ = engine_greedy(engine)

        # A stream that disagrees with the model: what a wrong converter or a
        # mismatched checkpoint would send.
        bad = StateDictAdapter(mutate(dict(model.state_dict())))
        with pytest.raises(ManifestError) as err:
            sync.push(bad, version=101)
        assert expect in str(err.value)
        assert bad.produced == 0, "data moved before the manifest was validated"
    tokens, versions = engine_greedy(engine)
    assert tokens == good_tokens and versions == {"100"}
    assert handle.version() == 100


def test_unknown_tensor_refused(engines: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    def add_unknown(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sd["model.layers.0.mlp.not_a_weight"] = torch.zeros(4)
        return sd

    _bad_manifest_refused(engines["llama"], perturb(load_hf(model_dirs["llama"]), seed=41),
                          add_unknown, "model.layers.0.mlp.not_a_weight")


def test_wrong_shape_refused(engines: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    def reshape(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
        return sd

    _bad_manifest_refused(engines["llama"], perturb(load_hf(model_dirs["llama"]), seed=42),
                          reshape, "model.layers.1.self_attn.k_proj.weight")


def test_check_names_every_problem_and_errors_are_json(
        engines: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    model = load_hf(model_dirs["llama"])
    specs = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in model.state_dict().items()]
    specs[0] = TensorSpec(specs[0].name, "bfloat16", specs[0].shape)
    m = plan(specs[:-1], weight_version=1, bucket_bytes=1 << 20)
    handle = SGLangEngine(engines["llama"])
    problems = handle.rpc("enginehooks_check", m.to_json(), timeout_s=30)[0]
    text = "; ".join(problems)
    assert "dtype bfloat16 but the engine runs float32" in text and "missing" in text
    info = handle.info(30)[0]
    assert info["engine"] == "sglang" and info["dtype"] == "float32"
    # A failing call comes back as the scheduler's error, and the socket stays usable.
    with pytest.raises(Exception, match=r"JSONDecodeError|Expecting value"):
        handle.rpc("enginehooks_check", "not json", timeout_s=30)
    assert handle.info(30)[0]["rank"] == 0

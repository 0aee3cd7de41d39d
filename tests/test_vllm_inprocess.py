"""Pushes into a real in-process vLLM (CPU): greedy tokens must equal HF transformers
on the same new weights, and readable engine weights must match bit for bit."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NEW_TOKENS, PROMPTS, llm_greedy, load_hf, perturb, requires_vllm

from enginehooks import ManifestError, ReplicaError, WeightSync
from enginehooks.manifest import Manifest, TensorSpec, plan
from enginehooks.tiny import hf_greedy
from enginehooks.trainer_side import StateDictAdapter
from enginehooks.vllm_ext import VLLMEngine

pytestmark = [requires_vllm, pytest.mark.vllm]

READABLE = ["model.embed_tokens.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]


def assert_engine_matches(llm: Any, handle: VLLMEngine, model: Any) -> None:
    """The correctness bar: greedy tokens equal HF's; readable weights bit-exact."""
    assert llm_greedy(llm) == hf_greedy(model, PROMPTS, NEW_TOKENS)
    digests = handle.digests(READABLE)
    assert set(digests) == set(READABLE), f"engine kept fewer readable weights: {sorted(digests)}"
    sd = model.state_dict()
    for name, d in digests.items():
        want = sd[name].detach().contiguous()
        assert d["shape"] == list(want.shape)
        assert d["crc32"] == zlib.crc32(want.reshape(-1).view(torch.uint8).numpy()), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gloo_push_matches_hf(llms: dict[str, Any], model_dirs: dict[str, Path], arch: str) -> None:
    llm, model = llms[arch], perturb(load_hf(model_dirs[arch]), seed=11)
    before = llm_greedy(llm)
    handle = VLLMEngine(llm, name=arch)
    # Small buckets: many buckets, and the embedding is cut across several of them.
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        report = sync.push(model, version=1)
    assert report.ok and report.buckets > 4 and report.bytes == sum(
        t.numel() * t.element_size() for t in model.state_dict().values())
    assert llm_greedy(llm) != before, "the update did not change generation"
    assert_engine_matches(llm, handle, model)
    assert handle.version() == 1


def test_tied_embeddings_update_output_head(llms: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    """Qwen2 tied: HF ties lm_head to embed_tokens; both names travel, and vLLM's output
    head follows (a stale head would make greedy tokens differ from HF's)."""
    model = load_hf(model_dirs["qwen2"])
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.5)  # only the (tied) embedding changes
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    handle = VLLMEngine(llms["qwen2"], name="qwen2")
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        report = sync.push(model, version="tied-1")
    # state_dict() lists the tied head under both names: both must have travelled.
    assert "lm_head.weight" in model.state_dict()
    assert report.ok and report.tensors == len(model.state_dict())
    assert_engine_matches(llms["qwen2"], handle, model)


def test_two_pushes_in_a_row(llms: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    llm, model = llms["llama"], load_hf(model_dirs["llama"])
    handle = VLLMEngine(llm)
    with WeightSync("gloo", bucket_bytes=64 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(perturb(model, seed=21), version=1)
        first = llm_greedy(llm)
        assert first == hf_greedy(model, PROMPTS, NEW_TOKENS)
        r2 = sync.push(perturb(model, seed=22), version=2)
        assert r2.phases["group"] < r2.phases["transfer"] + 1.0  # group reused, not rebuilt
    assert llm_greedy(llm) != first
    assert_engine_matches(llm, handle, model)
    assert handle.version() == 2


def test_disk_push_uses_engine_reload_from_path(
    llms: dict[str, Any], model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    llm, model = llms["llama"], perturb(load_hf(model_dirs["llama"]), seed=31)
    handle = VLLMEngine(llm)
    with WeightSync("disk", bucket_bytes=64 << 10, timeout_s=60,
                    transport_options={"root": tmp_path / "ckpt"}) as sync:
        sync.add_replica(handle)
        report = sync.push(model, version=7)
    folder = tmp_path / "ckpt" / "v7"
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) == report.buckets > 1
    done = Manifest.from_json((folder / "enginehooks-manifest.json").read_text())
    assert all(b.checksum and b.checksum.startswith("crc32:") for b in done.buckets)
    assert not list((tmp_path / "ckpt").glob(".tmp-*")), "temporary folder left behind"
    assert_engine_matches(llm, handle, model)
    assert handle.version() == 7


def _bad_manifest_refused(llm: Any, model: Any, mutate: Any, expect: str) -> None:
    handle = VLLMEngine(llm)
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version=100)
        good_tokens, good_version = llm_greedy(llm), handle.version()

        # A stream that disagrees with the model: what a wrong converter or a
        # mismatched checkpoint would send.
        bad = StateDictAdapter(mutate(dict(model.state_dict())))
        with pytest.raises(ManifestError) as err:
            sync.push(bad, version=101)
        assert expect in str(err.value)
        assert bad.produced == 0, "data moved before the manifest was validated"
        assert handle.version() == good_version == 100
        assert llm_greedy(llm) == good_tokens


def test_unknown_tensor_refused_before_data_moves(llms: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    def add_unknown(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sd["model.layers.0.mlp.not_a_weight"] = torch.zeros(4)
        return sd

    _bad_manifest_refused(llms["llama"], perturb(load_hf(model_dirs["llama"]), seed=41),
                          add_unknown, "model.layers.0.mlp.not_a_weight")


def test_wrong_shape_refused_before_data_moves(llms: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    def reshape(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
        return sd

    _bad_manifest_refused(llms["llama"], perturb(load_hf(model_dirs["llama"]), seed=42),
                          reshape, "model.layers.1.self_attn.k_proj.weight")


def test_check_rpc_names_every_problem(llms: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    model = load_hf(model_dirs["llama"])
    specs = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in model.state_dict().items()]
    specs[0] = TensorSpec(specs[0].name, "bfloat16", specs[0].shape)
    specs = specs[:-1]  # drop one tensor
    m = plan(specs, weight_version=1, bucket_bytes=1 << 20)
    problems = VLLMEngine(llms["llama"]).rpc("enginehooks_check", m.to_json(), timeout_s=30)[0]
    text = "; ".join(problems)
    assert "dtype bfloat16 but the engine runs float32" in text and specs[0].name in text
    assert "missing from the update" in text


def test_stream_that_breaks_its_plan_fails_every_side(
    llms: dict[str, Any], model_dirs: dict[str, Path]
) -> None:
    """The trainer's stream fails mid-update: the sender tells the receivers through the
    bucket they wait for, the push raises with the cause, the engine reports it does
    not hold the new version, and the next push repairs it."""
    llm, model = llms["llama"], perturb(load_hf(model_dirs["llama"]), seed=51)
    handle = VLLMEngine(llm)

    class FailingAdapter:
        def specs(self) -> list[TensorSpec]:
            return [TensorSpec(n, "float32", tuple(t.shape)) for n, t in model.state_dict().items()]

        def stream(self):
            for i, item in enumerate(model.state_dict().items()):
                if i == 7:
                    raise RuntimeError("trainer rank lost its shard")
                yield item

    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=30) as sync:
        sync.add_replica(handle)
        with pytest.raises((RuntimeError, ReplicaError)) as err:
            sync.push(FailingAdapter(), version=200)
        assert "trainer rank lost its shard" in str(err.value)
        info = handle.info(30)[0]
        assert info["state"] == "torn" and handle.version() is None
        assert "trainer rank lost its shard" in info["last_error"]
        sync.push(model, version=201)
    assert handle.version() == 201
    assert_engine_matches(llm, handle, model)

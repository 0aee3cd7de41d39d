"""The replica contract, once for every engine (vLLM, SGLang, a module replica).

Correctness is judged by the exact oracle: after a push, the engine's greedy tokens
and their logprobs equal those of the same engine freshly loaded from
`save_pretrained` of the pushed weights (and differ from before the push); and, where
the engine computes like transformers would on CPU, its greedy tokens equal HF's.
A refused update changes nothing: same version, same outputs, nothing streamed.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import EngineTorn, ManifestError, ReplicaError, WeightSync
from enginehooks.core.manifest import TensorSpec, plan
from enginehooks.trainer_side import StateDictAdapter, TrainerAdapter, adapter_for
from enginehooks_testkit.engines import (
    NEW_TOKENS,
    PROMPTS,
    RunningEngine,
    first_difference,
    fresh_generate,
    save_pushed,
)
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb

READABLE = ["model.embed_tokens.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight"]


def fresh_outputs(engine: str, model: Any, like: Path, tmp: Path) -> list[Any]:
    """The oracle: `engine` freshly started from `save_pretrained(model)`."""
    return fresh_generate(engine, save_pushed(model, like, tmp / "fresh"))


def checkpoint_state(model: Any) -> dict[str, torch.Tensor]:
    """What the trainer sends: the model in checkpoint format."""
    return dict(adapter_for(model).stream())


def assert_pushed(engine: str, replica: RunningEngine, model: Any, like: Path, tmp: Path,
                  version: Any, before: list[Any] | None = None) -> None:
    got = replica.generate()
    if before is not None:
        assert first_difference(got, before) is not None, "the push did not change generation"
    diff = first_difference(got, fresh_outputs(engine, model, like, tmp))
    assert diff is None, f"{engine} after the push != {engine} freshly loaded: {diff}"
    assert [list(g.tokens) for g in got] == hf_greedy(model, PROMPTS, NEW_TOKENS)
    handle = replica.handle()
    assert handle.version() == version
    assert {g.version for g in got} == {str(version)}, "answers must carry their weight version"
    digests = handle.digests(READABLE)
    assert set(digests) == set(READABLE), f"readable weights: {sorted(digests)}"
    sent = checkpoint_state(model)
    for name, d in digests.items():
        want = sent[name].contiguous()
        assert d["crc32"] == zlib.crc32(want.reshape(-1).view(torch.uint8).numpy()), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_push_equals_fresh_load(engine: str, replicas: dict[str, RunningEngine],
                                model_dirs: dict[str, Path], arch: str, tmp_path: Path) -> None:
    replica, model = replicas[arch], perturb(load_tiny(model_dirs[arch]), seed=11)
    before = replica.generate()
    # Small buckets: many buckets, and the embedding is cut across several of them.
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(replica.handle())
        report = sync.push(model, version=1)
    assert report.ok and report.buckets > 4
    assert report.bytes == sum(t.numel() * t.element_size() for t in checkpoint_state(model).values())
    assert_pushed(engine, replica, model, model_dirs[arch], tmp_path, 1, before)


def test_tied_embedding_moves_the_output_head(engine: str, replicas: dict[str, RunningEngine],
                                              model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Qwen2 tied: the checkpoint holds the embedding once; the engine's output head must
    follow it (a stale head makes the oracle differ)."""
    model = load_tiny(model_dirs["qwen2"])
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.5)  # only the (tied) embedding changes
    assert "lm_head.weight" not in checkpoint_state(model)
    replica = replicas["qwen2"]
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(replica.handle())
        sync.push(model, version="tied-1")
    assert_pushed(engine, replica, model, model_dirs["qwen2"], tmp_path, "tied-1")


def test_pushes_in_a_row_reuse_the_group_then_disk(engine: str, replicas: dict[str, RunningEngine],
                                                   model_dirs: dict[str, Path], tmp_path: Path) -> None:
    replica, model = replicas["llama"], load_tiny(model_dirs["llama"])
    handle = replica.handle()
    with WeightSync("gloo", bucket_bytes=64 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(perturb(model, seed=21), version=1)
        first = replica.generate()
        assert [list(g.tokens) for g in first] == hf_greedy(model, PROMPTS, NEW_TOKENS)
        groups, sender = [i["group"] for i in handle.info(30)], sync._sender
        assert all(groups) and sender is not None
        sync.push(perturb(model, seed=22), version=2)
        # The group is reused, not rebuilt: the same sender, and every worker reports
        # the group it joined for the first push.
        assert sync._sender is sender
        assert [i["group"] for i in handle.info(30)] == groups
    assert first_difference(replica.generate(), first) is not None
    assert [list(g.tokens) for g in replica.generate()] == hf_greedy(model, PROMPTS, NEW_TOKENS)
    with WeightSync("disk", bucket_bytes=64 << 10, timeout_s=60,
                    transport_options={"root": tmp_path / "ckpt"}) as sync:
        sync.add_replica(handle)
        report = sync.push(perturb(model, seed=23), version=7)
    assert report.buckets > 1
    assert not list((tmp_path / "ckpt").glob(".tmp-*")), "temporary folder left behind"
    assert_pushed(engine, replica, model, model_dirs["llama"], tmp_path, 7)


def _extra(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    sd["model.layers.0.mlp.not_a_weight"] = torch.zeros(4)
    return sd, "model.layers.0.mlp.not_a_weight"


def _missing(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    del sd["model.layers.1.self_attn.o_proj.weight"]
    return sd, "model.layers.1.self_attn.o_proj.weight"


def _misshaped(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    return sd, "model.layers.1.self_attn.k_proj.weight"


@pytest.mark.parametrize("mutate", [_extra, _missing, _misshaped], ids=["extra", "missing", "misshaped"])
def test_bad_update_is_refused_before_data_moves_and_changes_nothing(
        engine: str, replicas: dict[str, RunningEngine], model_dirs: dict[str, Path],
        mutate: Any) -> None:
    replica, model = replicas["llama"], perturb(load_tiny(model_dirs["llama"]), seed=41)
    handle = replica.handle()
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        sync.push(model, version=100)
        good = replica.generate()
        # A stream that disagrees with the engine: what a wrong converter would send.
        tensors, culprit = mutate(checkpoint_state(model))
        bad = StateDictAdapter(tensors)
        with pytest.raises(ManifestError) as err:
            sync.push(bad, version=101)
        assert culprit in str(err.value)
        assert bad.produced == 0, "data moved before the update was checked"
    assert handle.version() == 100
    assert first_difference(replica.generate(), good) is None


def test_check_names_every_problem(engine: str, replicas: dict[str, RunningEngine],
                                   model_dirs: dict[str, Path]) -> None:
    model = load_tiny(model_dirs["llama"])
    specs = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in checkpoint_state(model).items()]
    shape = specs[0].shape
    specs[0] = TensorSpec(specs[0].name, "float32", (shape[0] + 1, *shape[1:]))
    m = plan(specs[:-1], weight_version=1, bucket_bytes=1 << 20)
    handle = replicas["llama"].handle()
    with pytest.raises(ManifestError) as err:
        handle.check(m.to_json(), timeout_s=30)
    text = str(err.value)
    assert specs[0].name in text and str(shape[0] + 1) in text, "the misshaped tensor is not named"
    assert specs[-1].name in text, "the missing tensor is not named"
    # A floating dtype the engine's loader casts is not a problem (an fp32 engine takes
    # bf16, as it would from a bf16 checkpoint).
    cast = [TensorSpec(s.name, "bfloat16", s.shape) for s in
            (TensorSpec(n, "float32", tuple(t.shape)) for n, t in checkpoint_state(model).items())]
    handle.check(plan(cast, weight_version=1, bucket_bytes=1 << 20).to_json(), timeout_s=30)


class BreaksMidStream(TrainerAdapter):
    """A trainer whose stream fails at its 8th tensor (a rank lost its shard)."""

    name = "breaks"

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.inner = adapter_for(model)

    @classmethod
    def accepts(cls, model: Any) -> bool:
        return False

    def specs(self) -> list[TensorSpec]:
        return self.inner.specs()

    def stream(self) -> Any:
        for i, item in enumerate(self.inner.stream()):
            if i == 7:
                raise RuntimeError("trainer rank lost its shard")
            yield item


def test_failed_stream_tears_the_engine_and_the_next_push_repairs_it(
        engine: str, replicas: dict[str, RunningEngine], model_dirs: dict[str, Path],
        tmp_path: Path) -> None:
    replica, model = replicas["llama"], perturb(load_tiny(model_dirs["llama"]), seed=51)
    handle = replica.handle()
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=30) as sync:
        sync.add_replica(handle)
        with pytest.raises((RuntimeError, ReplicaError)) as err:
            sync.push(BreaksMidStream(model), version=200)
        assert "trainer rank lost its shard" in str(err.value)
        info = handle.info(30)[0]
        assert info["state"] == "torn" and handle.version() is None
        assert "trainer rank lost its shard" in info["last_error"]
        # Fail closed: no generation from a mix of versions, and the refusal says why.
        with pytest.raises(EngineTorn) as refused:
            replica.generate()
        assert "200" in str(refused.value) and "trainer rank lost its shard" in str(refused.value)
        sync.push(model, version=201)
    assert_pushed(engine, replica, model, model_dirs["llama"], tmp_path, 201)


def test_serve_policy_marks_answers_of_a_torn_engine(engine: str, replicas: dict[str, RunningEngine],
                                                    model_dirs: dict[str, Path]) -> None:
    replica, model = replicas["llama"], perturb(load_tiny(model_dirs["llama"]), seed=52)
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=30, on_torn="serve") as sync:
        sync.add_replica(replica.handle())
        with pytest.raises((RuntimeError, ReplicaError)):
            sync.push(BreaksMidStream(model), version=300)
        served = replica.generate()  # availability chosen: served, and marked
        assert {g.version for g in served} == {"torn:300"}
    with WeightSync("gloo", timeout_s=30, on_torn="refuse") as sync:
        sync.add_replica(replica.handle())
        sync.push(model, version=301)
    assert {g.version for g in replica.generate()} == {"301"}


def test_push_with_generation_paused(engine: str, replicas: dict[str, RunningEngine],
                                     model_dirs: dict[str, Path]) -> None:
    replica, model = replicas["llama"], perturb(load_tiny(model_dirs["llama"]), seed=61)
    with WeightSync("gloo", timeout_s=60, pause=True) as sync:
        sync.add_replica(replica.handle())
        assert sync.push(model, version="paused").ok
    assert [list(g.tokens) for g in replica.generate()] == hf_greedy(model, PROMPTS, NEW_TOKENS)

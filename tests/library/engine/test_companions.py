"""Companion models updated with the main one (`engine/companions.py`), on an engine of
real transformers modules shaped as vLLM serves an MTP model: the main model's loader
skips the checkpoint's MTP layers (vLLM's `MiMoForCausalLM` maps them to nothing) and a
drafter's loader takes only them, the embedding and the output head (vLLM's `MiMoMTP`).

What a companion adds: a push must carry what the drafter loads (a push without the MTP
layers is refused before any byte moves, naming them and the drafter, and changes
nothing); a push lands in both models bit for bit, though the transport reuses its
buffers; the drafter's own verification judges it against a fresh load of the drafter,
and the reply and `info` say what the drafter took. The real engine: tests/vllm/test_mtp_heads.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from enginehooks import WeightSync
from enginehooks.control.handles import EngineHandle
from enginehooks.core.errors import ManifestError
from enginehooks.engine.apply import ApplyTarget
from enginehooks.engine.companions import CompanionBinding
from enginehooks.engine.contract import verb_of
from enginehooks.engine.expectations import skeleton_on_meta
from enginehooks.engine.side import EngineSide
from enginehooks_testkit.mtp import MTP_PREFIX, load_tiny_mimo, make_tiny_mimo, mtp_layer
from enginehooks_testkit.tiny import perturb


def main_takes(name: str) -> bool:
    return not name.startswith(MTP_PREFIX)


def drafter_takes(name: str) -> bool:
    return name.startswith((MTP_PREFIX, "model.embed_tokens.", "lm_head."))


def build_main(config: Any) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM(config)


def build_drafter(config: Any) -> torch.nn.Module:
    """The MTP layers with the embedding and output head they share, as a model."""
    m = torch.nn.Module()
    m.model = torch.nn.Module()
    m.model.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    m.model.mtp_layers = torch.nn.ModuleList([mtp_layer(config)])
    m.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return m


class Part(ApplyTarget):
    """One model of the engine: built by `build`, its loader takes the checkpoint
    tensors `takes` accepts into the parameters of their names and skips the others."""

    engine = "tiny-mtp"

    def __init__(self, folder: Path, build: Callable[[Any], torch.nn.Module],
                 takes: Callable[[str], bool]) -> None:
        from transformers import AutoConfig

        super().__init__(torch.device("cpu"))
        self.folder, self.takes = folder, takes
        self.config = AutoConfig.from_pretrained(folder)
        self._build = build
        self.module = build(self.config)
        self.load_into(self.module, iter(load_file(folder / "model.safetensors").items()))

    def load_into(self, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                if self.takes(name):
                    params[name].copy_(t)

    def model(self) -> torch.nn.Module:
        return self.module

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.load_into(self.module, weights)

    def dry_load(self, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> Any:
        return self.load_into(model, weights)

    def skeleton(self) -> torch.nn.Module:
        def build(device: torch.device) -> torch.nn.Module:
            with device:
                return self._build(self.config)

        return skeleton_on_meta(build, engine=self.engine)

    def checkpoint_dir(self) -> Path:
        return self.folder

    def fresh_load(self, weights: list[tuple[str, torch.Tensor]],
                   before_processing: Callable[[torch.nn.Module], None] | None = None
                   ) -> torch.nn.Module:
        model = self._build(self.config)
        self.load_into(model, iter(weights))
        if before_processing is not None:
            before_processing(model)
        return model


class Binding(CompanionBinding):
    engine = "tiny-mtp"

    def dtype(self) -> str:
        return "float32"


class Handle(EngineHandle):
    def __init__(self, side: EngineSide) -> None:
        self.name, self.side = "tiny-mtp", side

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return [self.side.call(verb_of(method), *args)]

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        """No prefix cache here."""


@pytest.fixture
def engine(tmp_path: Path) -> tuple[Part, Part, Handle, Path]:
    folder = make_tiny_mimo(tmp_path / "mimo", seed=3)
    main, drafter = Part(folder, build_main, main_takes), Part(folder, build_drafter, drafter_takes)
    side = EngineSide(Binding(main, [("the MTP drafter", drafter)]))
    return main, drafter, Handle(side), folder


def holds(part: Part, model: Any) -> bool:
    params = dict(part.module.named_parameters())
    state = model.state_dict()
    return all(torch.equal(p, state[n]) for n, p in params.items())


def test_a_push_lands_in_the_model_and_its_mtp_drafter(engine: tuple[Part, Part, Handle, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "always")
    main, drafter, handle, folder = engine
    model = perturb(load_tiny_mimo(folder), seed=11)
    assert not holds(drafter, model)
    # small buckets: the transport reuses its buffers while the drafter's share waits
    with WeightSync("gloo", bucket_bytes=8 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        report = sync.push(model, version=1)
        assert report.ok
        assert holds(main, model) and holds(drafter, model)
        info = handle.info(30)[0]
        assert info["version"] == 1
        took = info["companions"]["the MTP drafter"]
        assert took["tensors_last"] == 18  # 16 MTP tensors, the embedding and the output head
        assert took["verification"]["last"]["ok"] is True, took
        assert took["verification"]["verified"] == 1
        # the second push goes through the copy plan each model recorded on the first
        second = perturb(load_tiny_mimo(folder), seed=21)
        assert sync.push(second, version=2).ok
    assert holds(main, second) and holds(drafter, second)
    took = handle.info(30)[0]["companions"]["the MTP drafter"]
    assert took["verification"]["verified"] == 2 and took["verification"]["last"]["ok"] is True
    assert drafter.plan.info()["applied"] == 1, drafter.plan.info()


def test_a_push_without_the_mtp_layers_is_refused_and_moves_nothing(
        engine: tuple[Part, Part, Handle, Path]) -> None:
    main, _, handle, folder = engine
    model = perturb(load_tiny_mimo(folder), seed=12)
    without = {n: t for n, t in model.state_dict().items() if not n.startswith(MTP_PREFIX)}
    before = {n: p.clone() for n, p in main.module.named_parameters()}
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        with pytest.raises(ManifestError, match="the MTP drafter: 16 tensors") as e:
            sync.push(without, version=1)
    assert f"{MTP_PREFIX}0." in str(e.value)
    assert all(torch.equal(p, before[n]) for n, p in main.module.named_parameters())
    assert handle.info(30)[0]["version"] is None


def test_the_drafter_refuses_what_its_loader_refuses(
        engine: tuple[Part, Part, Handle, Path]) -> None:
    """A wrong shape of an MTP tensor: the drafter, whose loader takes it, refuses it by
    name (whatever the main model's check says of a tensor its loader skips)."""
    _, _, handle, folder = engine
    state = dict(load_tiny_mimo(folder).state_dict())
    name = f"{MTP_PREFIX}0.input_proj.weight"
    state[name] = torch.zeros(state[name].shape[0], state[name].shape[1] // 2)
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        with pytest.raises(ManifestError, match=f"the MTP drafter: .*{name}"):
            sync.push(state, version=1)


def test_without_a_drafter_the_mtp_layers_are_checkpoint_tensors_it_skips(tmp_path: Path) -> None:
    """An engine serving the same checkpoint without speculative decoding (no companion)
    takes a push with the MTP layers (its loader skips them, as it skips the checkpoint's
    own: not "unknown tensors") and one without them."""
    folder = make_tiny_mimo(tmp_path / "mimo", seed=4)
    main = Part(folder, build_main, main_takes)
    handle = Handle(EngineSide(Binding(main)))
    model = perturb(load_tiny_mimo(folder), seed=13)
    without = {n: t for n, t in model.state_dict().items() if not n.startswith(MTP_PREFIX)}
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        assert sync.push(model, version=1).ok
        assert sync.push(without, version=2).ok
    assert holds(main, model)
    assert "companions" not in handle.info(30)[0]

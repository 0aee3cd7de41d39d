"""MTP heads pushed with the model into SGLang's own model classes (issue 39 item 5), at
the module level: SGLang's CPU build cannot run speculative decoding here. A server
started with `--speculative-algorithm EAGLE --speculative-draft-model-path <the MiMo
checkpoint>` dies building its KV pools:

    RuntimeError: sgl_kernel.copy_all_layer_kv_cache_cpu was called, but sgl_kernel here
    is the CPU-only stub (enginehooks/demo/sgl_kernel_stub)

So the two models SGLang would serve are built here as SGLang builds them, in this
process: `MiMoForCausalLM` (its loader skips `model.mtp_layers.*`) and the drafter
`MiMoMTP` (SGLang's draft `ModelConfig` renames the architecture; its loader takes the
MTP layer, the embedding and the head), each with SGLang's own `_initialize_model`,
`load_weights` and `DefaultModelLoader`. They are bound as an engine whose drafter is a
companion (`engine/companions.py`), and a real push over gloo goes into them: afterwards
both hold what SGLang's fresh load of `save_pretrained` of the pushed model holds, and a
push without the MTP layers is refused before any byte moves, naming them. What is not
tested: SGLang's scheduler wiring of its draft worker as a companion (no CPU run of it).
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
from enginehooks.demo.servers import free_port
from enginehooks.engine.apply import ApplyTarget
from enginehooks.engine.companions import CompanionBinding
from enginehooks.engine.contract import verb_of
from enginehooks.engine.expectations import skeleton_on_meta
from enginehooks.engine.side import EngineSide
from enginehooks_testkit.engines import sglang_path_here
from enginehooks_testkit.mtp import (
    MTP_PREFIX,
    copying_head,
    load_tiny_mimo,
    make_tiny_mimo,
    mimo_config,
)
from enginehooks_testkit.tiny import perturb

CPU = torch.device("cpu")
#: SGLang's server arguments of this module's process (`mimo`)
SERVER_ARGS: list[Any] = []


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tiny MiMo checkpoint, and SGLang's process state for building its models here:
    its server arguments (speculative decoding with the checkpoint as its own draft),
    a one-rank gloo world and its parallel groups."""
    sglang_path_here()  # the `sgl_kernel` CPU stand-in, which conftest puts on the children's path
    from sglang.srt.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import get_parallel, reset_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    folder = make_tiny_mimo(tmp_path_factory.mktemp("mimo") / "d0", seed=0)
    args = ServerArgs(model_path=str(folder), device="cpu", attention_backend="torch_native",
                      dtype="float32", speculative_algorithm="EAGLE",
                      speculative_draft_model_path=str(folder))
    set_global_server_args_for_scheduler(args)
    SERVER_ARGS.append(args)
    get_parallel().override_permanently(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0,
                                        pp_size=1, pp_rank=0)
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    initialize_model_parallel(backend="gloo")
    try:
        yield folder
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
        reset_context()  # SGLang's own teardown of what this process published
        SERVER_ARGS.clear()


def model_config(folder: Path, draft: bool) -> Any:
    """SGLang's config of the model (or of its drafter: `MiMoMTP`) from `folder`."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig.from_server_args(SERVER_ARGS[-1], model_path=str(folder),
                                        is_draft_model=draft)


class SGLangModel(ApplyTarget):
    """One of the two models, built and loaded by SGLang's own code (what its scheduler's
    target does, `sglang_ext/scheduler.py`): updates through the model's `load_weights`,
    a fresh load through `DefaultModelLoader`'s load and post-processing."""

    engine = "SGLang"

    def __init__(self, folder: Path, draft: bool) -> None:
        super().__init__(CPU)
        self.folder, self.draft = folder, draft
        self.config = model_config(folder, draft)
        self.module = self.fresh_load(list(load_file(folder / "model.safetensors").items()))

    def build(self, device: torch.device) -> torch.nn.Module:
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        with set_default_torch_dtype(torch.float32), device:
            return _initialize_model(self.config, LoadConfig(load_format="auto"), None)

    def model(self) -> torch.nn.Module:
        return self.module

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self.module.load_weights(weights)  # type: ignore[operator]

    def skeleton(self) -> torch.nn.Module:
        return skeleton_on_meta(self.build, engine="SGLang")

    def checkpoint_dir(self) -> Path:
        return self.folder

    def fresh_load(self, weights: list[tuple[str, torch.Tensor]],
                   before_processing: Callable[[torch.nn.Module], None] | None = None
                   ) -> torch.nn.Module:
        from sglang.srt.model_loader.loader import DefaultModelLoader

        model = self.build(CPU)
        DefaultModelLoader.load_weights_only(model, iter(weights), CPU)
        if before_processing is not None:
            before_processing(model)
        DefaultModelLoader.postprocess_weights(model, CPU)
        return model


class Binding(CompanionBinding):
    engine = "sglang-module"

    def dtype(self) -> str:
        return "float32"


class Handle(EngineHandle):
    def __init__(self, side: EngineSide) -> None:
        self.name, self.side = "sglang-mtp", side

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        return [self.side.call(verb_of(method), *args)]

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        """No prefix cache here."""


@pytest.fixture
def engine(mimo: Path) -> tuple[SGLangModel, SGLangModel, Handle]:
    main, drafter = SGLangModel(mimo, draft=False), SGLangModel(mimo, draft=True)
    assert type(main.module).__name__ == "MiMoForCausalLM"
    assert type(drafter.module).__name__ == "MiMoMTP"
    return main, drafter, Handle(EngineSide(Binding(main, [("the MTP drafter", drafter)])))


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


def test_a_pushed_mtp_head_equals_sglangs_fresh_load(
        engine: tuple[SGLangModel, SGLangModel, Handle], mimo: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINEHOOKS_VERIFY", "always")
    main, drafter, handle = engine
    model = copying_head(perturb(load_tiny_mimo(mimo), seed=7))
    with WeightSync("gloo", bucket_bytes=16 << 10, timeout_s=60) as sync:
        sync.add_replica(handle)
        assert sync.push(model, version=1).ok

    folder = tmp_path / "pushed"  # the oracle: SGLang's fresh load of what was pushed
    model.save_pretrained(folder)
    mimo_config(folder)
    assert same(main.module, SGLangModel(folder, draft=False).module)
    fresh_drafter = SGLangModel(folder, draft=True).module
    assert same(drafter.module, fresh_drafter)
    assert not same(drafter.module, SGLangModel(mimo, draft=True).module), "the head moved"
    took = handle.info(30)[0]["companions"]["the MTP drafter"]
    assert took["tensors_last"] == 18 and took["verification"]["last"]["ok"] is True, took


def test_a_push_without_the_mtp_head_is_refused(
        engine: tuple[SGLangModel, SGLangModel, Handle], mimo: Path) -> None:
    _, drafter, handle = engine
    model = perturb(load_tiny_mimo(mimo), seed=8)
    without = {n: t for n, t in model.state_dict().items() if not n.startswith(MTP_PREFIX)}
    before = SGLangModel(mimo, draft=True).module
    with WeightSync("gloo", timeout_s=60) as sync:
        sync.add_replica(handle)
        with pytest.raises(ManifestError, match="the MTP drafter: 16 tensors") as e:
            sync.push(without, version=1)
    assert f"{MTP_PREFIX}0." in str(e.value)
    assert same(drafter.module, before) and handle.info(30)[0]["version"] is None

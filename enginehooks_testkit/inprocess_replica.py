"""An in-process module replica: a plain torch model behind the real `ApplyTarget`,
`ApplyBinding` and `EngineSide`, as an `EngineHandle` a `WeightSync` pushes into.

No inference engine runs on the GPU machines this project is lent (no GPU builds of vLLM
or SGLang there), so the GPU tests and benchmarks of the engine side (the copy plan, the
receivers' landings, verification) push into this: the engine-side code is the real one,
only the model is a plain torch module whose loader copies by name. The model's class
must have `load_weights(iterator of (name, tensor))`, as vLLM's and SGLang's models do.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

#: builds the model on a device (the replica's, the shadow's, or meta for the dry run)
Build = Callable[[torch.device], torch.nn.Module]


def inprocess_replica(build: Build, device: torch.device, *,
                   after_load: Callable[[torch.nn.Module, set[str]], None] | None = None,
                   streamed_shadow: bool = False) -> tuple[Any, torch.nn.Module]:
    """(handle, live model) of a replica of `build(device)`. Its checkpoint (what the
    engine's loader dry run reads) is saved zeros of the same names, shapes and dtypes.
    `after_load(model, landed)`: the engine's post-load step (a test's fault goes here).
    `streamed_shadow`: verification's shadow streamed in one pass per module
    (`ShadowParts`), as vLLM's and SGLang's are; else it is built whole."""
    from safetensors.torch import save_file

    from enginehooks.control.handles import EngineHandle
    from enginehooks.core.dtypes import dtype_name
    from enginehooks.engine.apply import ApplyBinding, ApplyTarget
    from enginehooks.engine.contract import verb_of
    from enginehooks.engine.expectations import skeleton_on_meta
    from enginehooks.engine.shadow import ShadowParts
    from enginehooks.engine.side import EngineSide

    model = build(device)
    dtype = next(iter(model.parameters())).dtype
    folder = Path(tempfile.mkdtemp(prefix="inprocess-replica-"))
    save_file({n: torch.zeros(1, dtype=p.dtype).expand(p.shape).contiguous()
               for n, p in model.state_dict().items()}, str(folder / "model.safetensors"))

    class Target(ApplyTarget):
        engine = "module"

        def model(self) -> torch.nn.Module:
            return model

        def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            model.load_weights(weights)  # type: ignore[operator]

        def skeleton(self) -> torch.nn.Module:
            return skeleton_on_meta(build, engine=self.engine)

        def checkpoint_dir(self) -> Path:
            return folder

        def fresh_load(self, weights: list[tuple[str, torch.Tensor]],
                       before_processing: Callable[[torch.nn.Module], None] | None = None
                       ) -> torch.nn.Module:
            fresh = build(self.device)
            fresh.load_weights(iter(weights))  # type: ignore[operator]
            if before_processing is not None:
                before_processing(fresh)
            return fresh

        def after_load(self, m: torch.nn.Module, landed: set[str]) -> None:
            if after_load is not None:
                after_load(m, landed)

        def shadow_parts(self) -> ShadowParts | None:
            if not streamed_shadow:
                return None

            def load(m: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
                m.load_weights(iter(weights))  # type: ignore[operator]

            return ShadowParts(lambda: build(self.device), load, lambda m: None, self.lands,
                               self.device)

    class Binding(ApplyBinding):
        engine = "module"

        def dtype(self) -> str:
            return dtype_name(dtype)

    class Handle(EngineHandle):
        def __init__(self) -> None:
            self.name = "module"
            self.side = EngineSide(Binding(Target(device)))

        def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
            return [self.side.call(verb_of(method), *args)]

        def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
            """No cache."""

    return Handle(), model

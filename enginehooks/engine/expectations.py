"""What an engine accepts in an update, derived from the engine itself.

`EngineSide.check` refuses, before any byte moves, every update the engine's loader
would refuse later for a name, shape or dtype reason. The engine plugins supply an
`Expectations` object; this module holds the shared pieces.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path

from safetensors import safe_open

from enginehooks.core.errors import ManifestError
from enginehooks.core.manifest import DTYPE_SIZES, TensorSpec


class Expectations(ABC):
    """The engine's answer to "would you load these tensors?"."""

    @abstractmethod
    def problems(self, specs: Sequence[TensorSpec]) -> list[str]:
        """Every reason the engine would refuse an update of `specs` (names, wire
        dtypes, shapes), each naming its tensor; empty when it takes it."""

    @abstractmethod
    def checkpoint_spec(self, name: str) -> TensorSpec | None:
        """The checkpoint-layout spec of `name` where the engine knows it (digests)."""


class CheckpointExpectations(Expectations):
    """Expectations read from the checkpoint the engine was loaded from: names and
    shapes exactly, floating tensors in the engine's dtype."""

    def __init__(self, specs: Mapping[str, TensorSpec], *, require_all: bool = True) -> None:
        self.specs = dict(specs)
        self.require_all = require_all

    def checkpoint_spec(self, name: str) -> TensorSpec | None:
        return self.specs.get(name)

    def problems(self, specs: Sequence[TensorSpec]) -> list[str]:
        problems = []
        for t in specs:
            want = self.specs.get(t.name)
            if want is None:
                problems.append(f"unknown tensor {t.name!r}: the model has no such weight")
            elif tuple(want.shape) != tuple(t.shape):
                problems.append(f"tensor {t.name!r}: shape {list(t.shape)} but the model "
                                f"expects {list(want.shape)}")
            elif want.dtype != t.dtype:
                problems.append(f"tensor {t.name!r}: dtype {t.dtype} but the engine runs "
                                f"{want.dtype}")
        if self.require_all:
            sent = {t.name for t in specs}
            missing = sorted(n for n in self.specs if n not in sent)
            if missing:
                problems.append(f"{len(missing)} tensors of the model are missing from the "
                                f"update (engines reload whole layers), first: {missing[:5]}")
        return problems


def resolve_model_dir(model: str) -> Path:
    """A local folder for `model`: the path itself, or its snapshot in the HF cache."""
    p = Path(model)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as e:
        raise ManifestError(f"cannot find the checkpoint of {model!r} locally: {e}") from e


_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def checkpoint_specs(
    model_dir: str | os.PathLike[str], *, engine_dtype: str, tie_word_embeddings: bool = False
) -> dict[str, TensorSpec]:
    """HF name -> spec for every tensor in the folder's safetensors files.

    Floating tensors are expected in `engine_dtype` (what the engine runs and what the
    trainer must send); other dtypes as stored. With tied embeddings, `lm_head.weight`
    is expected too: engines that keep a separate output head need it sent.
    """
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ManifestError(f"no *.safetensors in {folder}: cannot validate updates against it")
    specs: dict[str, TensorSpec] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = st.get_slice(name)
                stored = _ST_DTYPES.get(sl.get_dtype(), "")
                if stored not in DTYPE_SIZES:
                    continue
                floating = stored.startswith(("float", "bfloat"))
                dtype = engine_dtype if floating and not stored.startswith("float8") else stored
                specs[name] = TensorSpec(name, dtype, tuple(sl.get_shape()))
    emb = specs.get("model.embed_tokens.weight")
    if tie_word_embeddings and "lm_head.weight" not in specs and emb is not None:
        specs["lm_head.weight"] = TensorSpec("lm_head.weight", emb.dtype, emb.shape)
    return specs

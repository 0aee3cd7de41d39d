"""The engine written in docs/engines.md, run from the page itself.

Every ```python block of the page is executed, in order, as one module (`page`): what a
reader would get by copying the page. Lines outside the blocks are blanked, not
dropped, so a traceback names the page's own line numbers. `MinimalEngine` drives it
for the replica contract suite (registered as the engine "minimal" by
tests/engines/contract/conftest.py); it adds only what a test driver adds to any engine:
start from a folder, generate greedily with logprobs.
"""

from __future__ import annotations

import gc
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from enginehooks.control.handles import EngineHandle
from enginehooks_testkit.engines import (
    NEW_TOKENS,
    PROMPTS,
    Generation,
    RunningEngine,
    hf_generate,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "engines.md"

_FENCE = re.compile(r"^```(\w*)\s*$")


def page_code(text: str) -> str:
    """The page's ```python blocks, at their own line numbers (everything else blank)."""
    out: list[str] = []
    inside: str | None = None
    for line in text.splitlines():
        fence = _FENCE.match(line)
        if fence and inside is None:
            inside = fence.group(1)
            out.append("")
        elif fence and inside is not None and not fence.group(1):
            inside = None
            out.append("")
        else:
            out.append(line if inside == "python" else "")
    if inside is not None:
        raise AssertionError(f"{PAGE}: a code block is not closed")
    return "\n".join(out) + "\n"


def load_page(path: Path = PAGE) -> types.ModuleType:
    """The page's code as a module of its own."""
    module = types.ModuleType("engines_page", f"the code of {path}")
    module.__file__ = str(path)
    exec(compile(page_code(path.read_text()), str(path), "exec"), module.__dict__)
    return module


page = load_page()


class MinimalEngine(RunningEngine):
    """The page's `TinyEngine` behind its `TinyHandle`, generating greedily (by
    transformers, the model it serves) with the page's `weight_label`."""

    engine = "minimal"

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32",
                 engine_args: dict[str, Any] | None = None) -> None:
        self.tiny = page.TinyEngine(model_dir, dtype)
        self._handle: EngineHandle | None = None

    def handle(self, name: str | None = None) -> EngineHandle:
        if self._handle is None:
            self._handle = page.TinyHandle(self.tiny, name=name or "minimal")
        return self._handle

    def generate(self, prompts: Sequence[Sequence[int]] = PROMPTS,
                 max_tokens: int = NEW_TOKENS) -> list[Generation]:
        label = page.weight_label(self.handle().side)  # type: ignore[attr-defined]
        return hf_generate(self.tiny.model, prompts, max_tokens, label)

    def close(self) -> None:
        self.tiny = None
        self._handle = None
        gc.collect()

"""SGLang engine plugin: scheduler methods (rollout side) and engine handles (trainer
side).

Installing enginehooks in SGLang's environment is enough: the `sglang.srt.plugins`
entry point `enginehooks` (this package's `register`) runs in every SGLang process and
attaches `enginehooks_*` methods to each scheduler. Importing this package does
not import SGLang; the handles import it lazily.
"""

from __future__ import annotations

from enginehooks.sglang_ext.handles import SGLangEngine, SGLangServer
from enginehooks.sglang_ext.plugin import register
from enginehooks.sglang_ext.versions import answer_version

__all__ = ["SGLangEngine", "SGLangServer", "answer_version", "register"]

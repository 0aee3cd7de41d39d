"""Test only: a fault in SGLang's post-load step, injected into its scheduler process.

No real SGLang loader misbehaves on demand, and the scheduler runs in a child process a
test cannot reach: this module is an SGLang general plugin (its `.dist-info` beside it
declares the entry point; a test puts this folder on the child's `PYTHONPATH` and names
it in `SGLANG_PLUGINS`). It wraps `SGLangTarget` so that, while the JSON file named by
`ENGINEHOOKS_TEST_FAULT_FILE` exists, each update is applied as the file says:

- `"scale": NAME`: after SGLang's own post-load step, the live tensor `NAME` is
  multiplied by 2 (a post-processing step applied once more than a fresh load applies
  it: what users see on the second and later syncs);
- `"policy": "never" | "always" | "first"`: the verification policy for this update on.

Without the file (or the variable) nothing changes.
"""

from __future__ import annotations

import json
import os
from typing import Any

FAULT_ENV = "ENGINEHOOKS_TEST_FAULT_FILE"


def _fault() -> dict[str, Any]:
    path = os.environ.get(FAULT_ENV)
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return dict(json.load(f))


def register() -> None:
    import torch

    from enginehooks.sglang_ext.scheduler import SGLangTarget

    if getattr(SGLangTarget, "_test_fault", False):
        return
    apply, after_load = SGLangTarget.apply, SGLangTarget.after_load

    def faulty_apply(self: Any, tensors: Any) -> None:
        policy = _fault().get("policy")
        if policy:
            self.verifier.policy = policy
        apply(self, tensors)

    def faulty_after_load(self: Any, model: torch.nn.Module, landed: set[str]) -> None:
        after_load(self, model, landed)
        name = _fault().get("scale")
        if name:
            with torch.no_grad():
                model.get_parameter(name).mul_(2.0)

    SGLangTarget.apply = faulty_apply  # type: ignore[method-assign]
    SGLangTarget.after_load = faulty_after_load  # type: ignore[method-assign]
    SGLangTarget._test_fault = True  # type: ignore[attr-defined]

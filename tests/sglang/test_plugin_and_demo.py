"""The plugin's registration (cheap, idempotent, discoverable by SGLang) and the
`enginehooks demo --engine sglang` run end to end against a real SGLang server."""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points
from pathlib import Path

import pytest


def test_entry_point_is_registered_and_idempotent() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("enginehooks") == "enginehooks.sglang_ext:register"
    from enginehooks.sglang_ext import register

    register()
    register()
    targets = [t for t in HookRegistry._hooks if "scheduler.Scheduler.__init__" in t]
    ours = [h for t in targets for _, h, _ in HookRegistry._hooks[t]
            if getattr(h, "__module__", "").startswith("enginehooks")]
    assert len(ours) == 1, "register() must add its hooks once per process"


def test_demo_runs_and_matches_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from enginehooks.demo import run_sglang_demo as run_demo

    args = argparse.Namespace(engine="sglang", transport="gloo", steps=5, lr=1e-2,
                              timeout=60.0, bucket_bytes=64 << 10, start_timeout=240.0,
                              workdir=str(tmp_path))
    rc = run_demo(args)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "== HF transformers on the new weights (6 prompts): True" in out
    assert "generations say ['1']" in out

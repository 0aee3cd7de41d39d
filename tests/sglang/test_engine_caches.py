"""What an update makes stale in a real SGLang server is dropped, and an update may leave
whole modules out (issue 39 items 1 and 3). Uses the session's shared server.

Caches (read in SGLang 0.5.23's source; `sglang_ext/scheduler.py: drop_stale_caches`):
the radix (prefix) cache, flushed by `Scheduler.flush_cache` after every update, seen
through SGLang's own `meta_info["cached_tokens"]`; and the multimodal embedding cache
(`mm_schedule.embedding_cache`: vision-encoder outputs by image hash), which SGLang's own
flush leaves. No SGLang VLM here fills that cache (the one that serves images on CPU,
PaliGemma through SGLang's Transformers backend, hands pixels to transformers and caches
nothing), so it is observed as an object: in the server's scheduler through `info`
(present, empty after a push), and in this process, SGLang's real cache filled and
dropped by the same function the scheduler runs.

Partial updates: a push with `keep=[...]` leaves whole modules out; generation equals
HF transformers on the trainer's weights with the kept modules as the engine held them;
a module sent in part is refused before any byte moves, the engine unchanged.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from enginehooks import WeightSync
from enginehooks.core.errors import ManifestError
from enginehooks.sglang_ext import SGLangServer
from enginehooks_testkit.engines import PROMPTS
from enginehooks_testkit.servers import cpu_env
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.sglang.helpers import SGLangServerProcess, hf_reference


def _push(server: SGLangServerProcess, model: Any, version: str, **kw: Any) -> Any:
    with WeightSync("gloo", bucket_bytes=32 << 10, timeout_s=120, pause=True) as sync:
        sync.add_replica(SGLangServer(server.url, name="sglang-caches"))
        return sync.push(model, version=version, **kw)


def _cached_tokens(server: SGLangServerProcess) -> list[int]:
    return [int(o["meta_info"].get("cached_tokens", 0)) for o in server.generate()]


def test_a_push_drops_the_radix_cache(sglang_server: SGLangServerProcess,
                                      model_dirs: dict[str, Path]) -> None:
    sglang_server.generate()
    assert any(n > 0 for n in _cached_tokens(sglang_server)), "the prompts were not cached"
    model = perturb(load_tiny(model_dirs["llama"]), seed=401)
    _push(sglang_server, model, "caches-1")
    outs = sglang_server.generate()  # the same requests, right after the push
    assert [int(o["meta_info"].get("cached_tokens", 0)) for o in outs] == [0] * len(PROMPTS)
    assert [o["output_ids"] for o in outs] == hf_reference(model)
    info = SGLangServer(sglang_server.url).info(60)[0]
    assert info["mm_embedding_cache"] == 0  # the scheduler's cache exists, and is empty


#: run where SGLang's scheduler runs: its CPU environment, the kernel stand-in included
CHILD = """
import json, torch
from sglang.srt.managers import mm_schedule
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult
from enginehooks.sglang_ext.scheduler import drop_stale_caches, mm_embedding_cache

class Sched:  # SGLang's own flush_cache signature, recording its arguments
    flushed = []
    def flush_cache(self, empty_cache=True):
        self.flushed.append(empty_cache)
        return True
Sched.flush_cache.__signature__ = __import__("inspect").signature(Scheduler.flush_cache)

mm_schedule.init_mm_embedding_cache(1 << 20)  # as SGLang's KV-cache builder does
cache = mm_embedding_cache()
filled = cache.set(1234, EmbeddingResult(embedding=torch.ones(4, 64)))
before = cache.get_single(1234) is not None
sched = Sched()
ok = drop_stale_caches(sched, torch.device("cpu"))
print(json.dumps({"filled": filled, "before": before, "ok": ok, "after": len(cache),
                  "size": cache.current_size, "flushed": sched.flushed}))
"""


def test_the_flush_drops_sglangs_multimodal_embedding_cache() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], env=cpu_env(), capture_output=True,
                         text=True, timeout=300, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["filled"] and got["before"]  # SGLang's real cache held an image's embedding
    assert got["ok"] is True and got["after"] == 0 and got["size"] == 0
    assert got["flushed"] == [False]  # the prefix flush ran too (no gc pass on CPU)


def test_a_push_may_leave_whole_modules_out(sglang_server: SGLangServerProcess,
                                           model_dirs: dict[str, Path]) -> None:
    first = perturb(load_tiny(model_dirs["llama"]), seed=411)
    _push(sglang_server, first, "keep-1")
    second = perturb(load_tiny(model_dirs["llama"]), seed=412)
    keep = ["model.layers.0", "lm_head"]
    report = _push(sglang_server, second, "keep-2", keep=keep)
    assert report.tensors < len(second.state_dict())
    expected = copy.deepcopy(second)
    expected.load_state_dict({n: t for n, t in first.state_dict().items()
                              if n.startswith(("model.layers.0.", "lm_head."))}, strict=False)
    tokens, versions = sglang_server.greedy()
    assert tokens == hf_reference(expected)
    assert versions == {"keep-2"}


def test_a_module_sent_in_part_is_refused_and_nothing_changes(
        sglang_server: SGLangServerProcess, model_dirs: dict[str, Path]) -> None:
    before, versions = sglang_server.greedy()
    model = perturb(load_tiny(model_dirs["llama"]), seed=421)
    with pytest.raises(ManifestError, match=r"missing from the update \(engines reload") as e:
        _push(sglang_server, model, "keep-bad", keep=["model.layers.1.mlp.up_proj"])
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert sglang_server.greedy() == (before, versions)

"""Every update verified by default, in a real SGLang (CPU, bf16), where the large
tensors are proved by the transport's own check as they landed.

Over gloo a tensor of 1 MB or more travels in a bucket of its own, which the receive
loop checks against the sender's digests as it lands in the engine's parameter; a
verified push takes those digests instead of reading the tensor again at receipt
(`Target.arrived_piece`), and proves the parameter after SGLang's post-load step
against them. Here the embedding and the output head are 2 MB each: once the copy plan
is on, every push is proved by digests alone, and the verdict says the large tensors'
received digests were the transport's (`arrived_bytes`).

Then a post-load step that is not safe to run twice (the embedding scaled once more
after SGLang's own step, injected into the scheduler process by a test-only SGLang
plugin, `fault_plugin/`, since no real loader misbehaves on demand) changes the
embedding after it landed: the first such push ends torn, naming it (no copy was kept:
the digests were to prove it); this test fails exactly when the check after apply of
the arrived tensors is lost. The next push keeps copies, compares the embedding on a
fresh-load shadow, repairs it, and meets the exact oracle; with verification off for
one push, the same fault leaves the engine answering wrong.

(The repairing push once hung here past its timeout, three runs in a row: the failed
push's `leave` calls, still running in the background, and this test's `info` through
a new handle of the same engine polled one socket with two locks and took each other's
replies. One lock per socket now, `sglang_ext/rpc.py`; `test_rpc_socket.py`.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks.demo.tiny import make_tiny_model
from enginehooks.engine.verify import WeightsMismatch
from enginehooks_testkit.engines import SGLangInProcess, first_difference, fresh_generate_of
from enginehooks_testkit.tiny import load_tiny, perturb

pytestmark = pytest.mark.slow

PLUGIN_DIR = Path(__file__).parent / "fault_plugin"
EMBED = "model.embed_tokens.weight"
VOCAB, HIDDEN = 4096, 256  # 2 MB tensors in bf16: each over gloo in a bucket of its own
BUCKET = 1 << 20


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "llama", arch="llama",
                           vocab_size=VOCAB, hidden_size=HIDDEN, layers=1, heads=4,
                           kv_heads=2, seed=5)


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault") / "fault.json"


@pytest.fixture(scope="module")
def engine(wide: Path, fault_file: Path) -> Iterator[SGLangInProcess]:
    with pytest.MonkeyPatch.context() as mp:  # read by the scheduler as it starts
        mp.delenv("ENGINEHOOKS_VERIFY", raising=False)  # the default policy
        mp.delenv("ENGINEHOOKS_COPY_PLAN", raising=False)
        mp.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")) if p))
        mp.setenv("SGLANG_PLUGINS", "enginehooks,enginehooks_test_fault")
        mp.setenv("ENGINEHOOKS_TEST_FAULT_FILE", str(fault_file))
        engine = SGLangInProcess(wide, dtype="bfloat16")
    try:
        yield engine
    finally:
        engine.close()


def _trainer(src: Path, seed: int) -> Any:
    return perturb(load_tiny(src), seed=seed).to(torch.bfloat16)


def _fresh(model: Any, src: Path, folder: Path) -> list:
    return fresh_generate_of("sglang", model, src, folder, dtype="bfloat16")


def _verification(engine: SGLangInProcess) -> dict[str, Any]:
    return engine.handle().info(30)[0]["verification"]  # type: ignore[no-any-return]


def _fault(path: Path, **what: str) -> None:
    """What the scheduler's fault plugin does to the next updates (nothing: removed)."""
    if what:
        path.write_text(json.dumps(what))
    else:
        path.unlink(missing_ok=True)


def test_large_tensors_proved_as_they_arrived_and_a_change_after_landing_is_caught(
        engine: SGLangInProcess, wide: Path, fault_file: Path, tmp_path: Path) -> None:
    a, b = _trainer(wide, seed=501), _trainer(wide, seed=502)
    large = a.model.embed_tokens.weight.nbytes + a.lm_head.weight.nbytes
    assert a.model.embed_tokens.weight.nbytes >= 1 << 20  # over gloo: buckets of their own
    _fault(fault_file)
    with WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=120) as sync:
        sync.add_replica(engine.handle())
        sync.push(a, version=1)  # through SGLang's loader; records the copy plan
        out_a = engine.generate()
        assert first_difference(out_a, _fresh(a, wide, tmp_path / "a")) is None
        sync.push(b, version=2)  # the plan's first use, judged against a fresh load
        out_b = engine.generate()
        assert first_difference(out_b, _fresh(b, wide, tmp_path / "b")) is None
        assert engine.handle().info(30)[0]["copy_plan"]["state"] == "on"
        for version, model, out in ((3, a, out_a), (4, b, out_b)):
            sync.push(model, version=version)  # the plan's steady state
            assert first_difference(engine.generate(), out) is None
            last = _verification(engine)["last"]
            # proved by digests alone; the large tensors' received digests were the
            # transport's own check as they landed (not read again at receipt)
            assert last["outcome"] == "verified" and last["how"] == "digest", last
            assert last["arrived_bytes"] >= large, last

        _fault(fault_file, scale=EMBED)  # SGLang's post-load step now runs "twice"
        repaired = False
        try:
            with pytest.raises(WeightsMismatch, match=r"model\.embed_tokens\.weight"):
                sync.push(a, version=5)  # no copy kept (digests were to prove it): torn
            assert engine.handle().info(30)[0]["state"] == "torn"
            sync.push(a, version=6)  # copies kept: compared on a shadow, repaired
            assert first_difference(engine.generate(), out_a) is None
            last = _verification(engine)["last"]
            assert last["outcome"] == "repaired" and EMBED in last["repaired"], last

            _fault(fault_file, scale=EMBED, policy="never")  # verification off
            sync.push(b, version=7)
            assert first_difference(engine.generate(), out_b) is not None, \
                "the corrupted push met the oracle without verification"
            repaired = True
        finally:
            if repaired:
                _fault(fault_file, policy="always")
            else:
                _fault(fault_file)
        sync.push(a, version=8)  # put right, verified again
        _fault(fault_file)
        assert first_difference(engine.generate(), out_a) is None
        v = _verification(engine)
        assert v["last"]["outcome"] == "verified", v
        assert v["updates"] == {"verified": 5, "repaired": 1, "unverified": 1, "failed": 1}, v

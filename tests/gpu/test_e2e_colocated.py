"""The user's colocated path on one GPU: an FSDP2 trainer (world size 1) pushes through
`trainer_side.push` + `WeightSync(transport="cuda_ipc")` into a replica process on the
same GPU (a module, through `Receiver.deliver`), checked bit for bit after every push
(benchmarks/bench_e2e.py with a small model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp2_to_replica_process_over_cuda_ipc_is_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--layers", "2",
         "--hidden", "256", "--intermediate", "704", "--heads", "4", "--kv-heads", "2",
         "--vocab", "1000", "--bucket-mib", "1", "--reps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    pushes = [v for k, v in res["items"].items() if k.startswith("push[")]
    assert {p["checksum"] for p in pushes} == {"sum64", "none"}
    assert all(p["bit_exact"] for p in pushes)

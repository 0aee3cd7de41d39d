"""The flush after an update skips SGLang's CPU `empty_cache` (a full `gc.collect()`).

SGLang's `Scheduler.flush_cache()` drops the prefix cache and then empties the device's
allocator cache; on CPU that is `gc.collect()` over the scheduler's heap, up to 1.6 s
per update at 1 GB on the CI machine (docs/benchmarks.md, "Where the time goes"). The
arguments are checked against SGLang's real `Scheduler.flush_cache` (the scheduler runs
in the server's child process, where this choice cannot be observed from a test); that
the engine still serves the new weights after such a flush is what
`test_copy_plan.py` and the conformance cells check through the server.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from enginehooks.sglang_ext.scheduler import flush_kwargs
from enginehooks_testkit.servers import cpu_env

#: run where SGLang's scheduler runs: its CPU environment, the kernel stand-in included
CHILD = """
import json, torch
from sglang.srt.managers.scheduler import Scheduler
from enginehooks.sglang_ext.scheduler import flush_kwargs
print(json.dumps({d: flush_kwargs(Scheduler.flush_cache, torch.device(d))
                  for d in ("cpu", "cuda")}))
"""


def test_the_flush_skips_the_gc_pass_on_cpu_only() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], env=cpu_env(), capture_output=True,
                         text=True, timeout=300, check=True).stdout
    kwargs = json.loads(out.strip().splitlines()[-1])
    assert kwargs["cpu"] == {"empty_cache": False}  # the prefix reset stays, gc.collect goes
    assert kwargs["cuda"] == {}  # on GPUs cached blocks go back (a colocated trainer)


def test_an_sglang_without_the_argument_gets_a_plain_flush() -> None:
    def flush_cache(self: object) -> bool:  # the signature of SGLang releases before it
        return True

    assert flush_kwargs(flush_cache, torch.device("cpu")) == {}

"""Let a vLLM CPU process use AMX tiles before vLLM's kernels do.

On Linux a process must ask the kernel for permission to use AMX tile data
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) before its first AMX
instruction; without it that instruction raises SIGILL. oneDNN asks when it first picks
an AMX kernel, but vLLM's CPU build runs its own AMX kernels (bf16 attention and linear
paths on Sapphire Rapids and later) in worker processes that may not have run a oneDNN
AMX op yet: a bf16 vLLM server then loses its worker (exit code -4) on its first
forward, with or without enginehooks (docs/engine-bugs.md). Asking for the permission
is what torch itself does for its compiled AMX kernels (`torch._C._cpu._init_amx`,
which first checks that the CPU has AMX); it changes nothing on a CPU without AMX.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def allow_amx() -> bool:
    """Ask the kernel for AMX tile permission in this process. True if granted; False on
    a CPU without AMX, a torch without the call, or a refusal (logged)."""
    try:
        import torch

        init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
        if init is None:
            return False
        return bool(init())
    except Exception as e:  # never fail a vLLM process over a permission request
        log.warning("could not request AMX permission for this process: %s", e)
        return False

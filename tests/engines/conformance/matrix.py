"""The conformance matrix: which cells exist, which one `make test` runs, which ones an
engine cannot run (with the engine's reason), and how a cell is run (a child process).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tests.engines.conformance.families import FAMILIES

ENGINES = ("vllm", "sglang")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Cell:
    family: str
    engine: str
    trainer: str  # plain | peft | fsdp2
    dtype: str

    def __str__(self) -> str:
        return f"{self.engine}-{self.family}-{self.trainer}-{self.dtype}"


def full() -> list[Cell]:
    """Every family on both engines in both dtypes from a plain trainer; FSDP2 (2 ranks)
    and PEFT-merged for one dense and one MoE family."""
    cells = [Cell(f, e, "plain", d) for f in FAMILIES for e in ENGINES for d in DTYPES]
    cells += [Cell(f, e, t, d) for t in ("peft", "fsdp2") for f in ("llama", "qwen3_moe")
              for e in ENGINES for d in DTYPES]
    return cells


#: What `make test` runs: one MoE, one tied family without an output head, one family
#: whose checkpoint holds fused qkv / gate_up, on both engines.
SLICE = [Cell(f, e, "plain", "float32") for f in ("qwen3_moe", "gemma3_text", "phi3")
         for e in ENGINES]
#: ...and the last-hop classes the byte tracer and verify-after-apply exist for: writes
#: vLLM's layerwise reload drops (GPT-OSS experts, biases and sinks), a buffer aliasing
#: a parameter that CPU bf16 repacks (Mamba2's conv), a constructor that reads a
#: parameter's value (Apertus' xIELU; in SGLang its loader's `fill_(w.item())` too).
SLICE += [Cell("gpt_oss", "vllm", "plain", "float32"), Cell("mamba2", "vllm", "plain", "bfloat16"),
          Cell("apertus", "vllm", "plain", "float32"), Cell("apertus", "sglang", "plain", "float32")]

#: (engine, family) -> why that engine cannot run the family on CPU here. A cell that
#: fails to start outside this table fails the suite, and so does one listed here that
#: starts after all (the table must stay true).
CANNOT_RUN: dict[tuple[str, str], str] = {
    ("sglang", "gpt_oss"): "GptOssForCausalLM requires the triton, trtllm_mha, fa3, fa4, ascend, "
                           "intel_amx, intel_xpu or aiter attention backend; the CPU server runs "
                           "torch_native (AssertionError at start)",
    ("sglang", "mamba2"): "the server dies at start: its tensor-parallel check computes "
                          "model_config.num_attention_heads % tp_size with no attention heads "
                          "(TypeError: unsupported operand type(s) for %: 'NoneType' and 'int')",
    ("sglang", "qwen2_moe"): "the shared-expert gate runs a Triton kernel, which has no CPU "
                             "driver (RuntimeError: 0 active drivers)",
    ("sglang", "deepseek_v2"): "MLA attention with the torch_native backend fails on the first "
                               "prefill (RuntimeError: Expected size for first two dimensions "
                               "of batch2 tensor to be: [2, 96] but got: [2, 576])",
    ("sglang", "deepseek_v3"): "MLA attention with the torch_native backend fails on the first "
                               "prefill (RuntimeError: Expected size for first two dimensions "
                               "of batch2 tensor to be: [2, 96] but got: [2, 576])",
}


#: The phases of a cell, in order, as `phase` records them. An engine that takes the
#: child down in "start" (starting from the untouched checkpoint, or its first
#: generation) cannot run the family; in any later phase the push, the oracle's fresh
#: load or a refused update did, and the cell fails.
PHASES = ("build", "start", "push", "oracle", "refusals")


def phase(work: Path, name: str) -> None:
    """Record where the cell is, for `matrix.run` when this process dies without a
    result (SGLang SIGQUITs its parent when one of its processes dies)."""
    assert name in PHASES, name
    (work / "phase").write_text(name)


def run(cell: Cell, root: Path, workdir: Path, timeout_s: float = 1500.0) -> dict[str, Any]:
    """Run one cell in a child process; its result as a dict (status pass / fail /
    cannot run, detail, seconds)."""
    req = json.dumps(dict(asdict(cell), root=str(root), workdir=str(workdir)))
    (workdir / "phase").unlink(missing_ok=True)
    try:
        out = subprocess.run([sys.executable, "-m", "tests.engines.conformance.cell"], input=req,
                             capture_output=True, text=True, timeout=timeout_s,
                             cwd=Path(__file__).resolve().parents[3])
    except subprocess.TimeoutExpired:
        return timed_out(cell, workdir, timeout_s)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return died(cell, workdir, out.returncode, out.stderr or "")


def timed_out(cell: Cell, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """A cell with no result in time: like a death (`died`), the engine cannot run the
    family only while it was still starting from the untouched checkpoint."""
    try:
        where = (workdir / "phase").read_text().strip()
    except OSError:
        where = "before the cell began"
    if where == "start":
        return dict(asdict(cell), status="cannot run",
                    detail=f"the engine did not start from the checkpoint (or serve its "
                           f"first generation) within {timeout_s}s, before any push")
    return dict(asdict(cell), status="fail",
                detail=f"no result within {timeout_s}s (phase {where!r})")


def died(cell: Cell, workdir: Path, returncode: int, stderr: str) -> dict[str, Any]:
    """The result of a cell whose process died without a word (an engine took it down:
    SGLang SIGQUITs its parent when one of its processes dies). Only a death while the
    engine starts from the untouched checkpoint (or serves its first generation) means
    the engine cannot run the family; anywhere else it is a failure, named by phase."""
    try:
        where = (workdir / "phase").read_text().strip()
    except OSError:
        where = "before the cell began"
    error = engine_error(stderr)
    if where == "start":
        return dict(asdict(cell), status="cannot run",
                    detail=f"the engine process died starting from the checkpoint, before "
                           f"any push (exit {returncode}): {error}")
    return dict(asdict(cell), status="fail",
                detail=f"the process died in phase {where!r} (exit {returncode}): {error}")


_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit)\b:?")


def engine_error(stderr: str, limit: int = 600) -> str:
    """The engine's own words from a dead process's stderr: the last exception line (the
    one its traceback ends with; a bare one, such as an `assert` without a message, with
    the source line it came from), then the last lines of the log."""
    lines = [ln.strip() for ln in stderr.splitlines()
             if ln.strip() and ln.strip().strip("^~ ")]  # no caret underlines
    at = [i for i, ln in enumerate(lines) if _EXCEPTION.match(ln)]
    picked = []
    if at:
        i = at[-1]
        bare = ":" not in lines[i]
        picked = [(f"{lines[i]} at `{lines[i - 1]}`" if bare and i else lines[i])[:limit]]
    return " | ".join(picked + [ln[:200] for ln in lines[-3:] if ln not in picked])


#: The oracle's two findings (`cell.verdict`); any other problem (a bad update accepted,
#: a refusal that moved data) is the push's own and always fails the cell.
ORACLE_PROBLEMS = ("the push did not change the outputs", "after the push != ",
                   "push 3 (the trained weights again) != ")


def undefined_by_the_checkpoint(result: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """A push the oracle faults although the engine verified it (what the update lands in
    equals a fresh load of it, bit for bit), in an engine with parameters no checkpoint
    tensor loads: the outputs then depend on what neither the checkpoint nor the push
    defines (each load leaves those parameters as the constructor did, e.g. an
    uninitialised output head, which may even make every output the same token, so that
    the push changes nothing), so the engine cannot run this checkpoint; the push is not
    at fault. Only when every problem is one of the oracle's (`ORACLE_PROBLEMS`)."""
    ver = info.get("verification") or {}
    last = ver.get("last") or {}
    problems = result.get("problems") or []  # cell.verdict's list
    only_oracle = bool(problems) and all(p.startswith(ORACLE_PROBLEMS) for p in problems)
    if (result["status"] == "fail" and only_oracle
            and info.get("unloaded") and ver.get("verified", 0) >= 2 and last.get("ok")):
        return dict(result, status="cannot run",
                    detail=f"the engine loads no checkpoint tensor into {info['unloaded'][:5]}: "
                           "a fresh load leaves them as its constructor made them, so no "
                           "push can equal it (the push itself was verified equal to a fresh "
                           f"load of every tensor it carries). {result['detail']}")
    return result

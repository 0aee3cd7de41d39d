"""`enginehooks demo --engine sglang`: the vLLM demo's story, told with SGLang.

Builds a tiny Llama offline, starts a real SGLang HTTP server on loopback (the
enginehooks plugin loads in it by itself), trains the model in this (trainer) process
for a few steps on the same toy objective as the vLLM demo, pushes the new weights,
and shows generation before and after. Exits non-zero unless SGLang's greedy tokens
after the push equal HF transformers' on the trainer's new weights, and generations
report the pushed weight version. Run it in the SGLang environment
(`scripts/run.sh sglang enginehooks demo --engine sglang`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def run_demo(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from enginehooks import WeightSync
    from enginehooks.demo import HELD_OUT, NEW_TOKENS, PROMPTS, show_outcome, train
    from enginehooks.sglang_ext import SGLangServer
    from enginehooks.sglang_ext.server import SGLangServerProcess
    from enginehooks.tiny import hf_greedy, make_tiny_model

    work = Path(getattr(args, "workdir", None) or tempfile.mkdtemp(prefix="enginehooks-demo-"))
    model_dir = make_tiny_model(work / "model", arch="llama", seed=0)
    print(f"[demo] tiny Llama written to {model_dir}")
    print("[demo] starting SGLang (CPU) with the enginehooks plugin ...", flush=True)
    server = SGLangServerProcess(model_dir, work / "sglang.log")
    try:
        server.wait_ready(args.start_timeout)
        print(f"[demo] SGLang ready at {server.url} (log: {work / 'sglang.log'})")
        before = server.greedy(PROMPTS, NEW_TOKENS)

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        losses = train(model, args.steps, args.lr)
        print(f"[demo] trained {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

        options = {"root": str(work / "checkpoints")} if args.transport == "disk" else {}
        with WeightSync(args.transport, timeout_s=args.timeout, bucket_bytes=args.bucket_bytes,
                        pause=True, transport_options=options) as sync:
            handle = SGLangServer(server.url, name="sglang-server")
            sync.add_replica(handle)
            report = sync.push(model, version=1)
        outs = server.generate(PROMPTS + HELD_OUT, NEW_TOKENS)
        after = [list(o["output_ids"]) for o in outs]
        served = sorted({str(o["meta_info"].get("weight_version")) for o in outs})
        reference = hf_greedy(model, PROMPTS + HELD_OUT, NEW_TOKENS)
        version = handle.version()
    finally:
        server.stop()

    return show_outcome("SGLang", before, after, reference, version, report, served)

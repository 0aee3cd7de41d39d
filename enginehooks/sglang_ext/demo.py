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


def run_demo(args: argparse.Namespace) -> int:
    from enginehooks.demo import NEW_TOKENS
    from enginehooks.demo import run_demo as run_engine_demo
    from enginehooks.sglang_ext import SGLangServer
    from enginehooks.sglang_ext.server import SGLangServerProcess

    def observe(server: SGLangServerProcess, prompts: list[list[int]]
                ) -> tuple[list[list[int]], list[str]]:
        outs = server.generate(prompts, NEW_TOKENS)
        served = sorted({str(o["meta_info"].get("weight_version")) for o in outs})
        return [list(o["output_ids"]) for o in outs], served

    return run_engine_demo(
        args, engine="SGLang", start_server=SGLangServerProcess,
        make_handle=lambda url: SGLangServer(url, name="sglang-server"), observe=observe,
    )

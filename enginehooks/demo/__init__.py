"""`enginehooks demo`: a real engine, a trainer, one push, and proof that it landed.

Builds a tiny Llama offline, starts a real vLLM server on loopback with the enginehooks
worker extension, trains the model in this (trainer) process for a few steps on a toy
objective (answer each training prompt with its own token, repeated), pushes the new
weights, and shows
generation before and after. Exits non-zero unless the engine's greedy tokens after the
push equal HF transformers' on the trainer's new weights.

Shipped in the wheel on purpose: `enginehooks demo` is the first command a user runs,
from an installed package as from a checkout. The package carries what the demo needs
and nothing the tests need beyond it: the tiny checkpoint (`tiny.py`), the engine
server launchers (`servers.py`) and the CPU stand-in for SGLang's kernels
(`sgl_kernel_stub/`). The test kit (`enginehooks_testkit`, in the repository, not in
the wheel) builds on these; no other part of the library imports this package.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPTS = [[5, 6, 7, 8], [20, 21, 22], [100, 101, 102, 103, 104]]
TARGETS = [42, 77, 123]  # the token each training prompt should be answered with
NEW_TOKENS = 8
# Prompts the toy objective never saw: their continuations are whatever the trained
# network makes of them, so equality with HF there checks more than the learned answers.
HELD_OUT = [[50, 51, 52], [200, 201, 9, 9], [3, 250]]


def train(model: object, steps: int, lr: float) -> list[float]:
    """Teach the model to answer training prompt i with TARGETS[i], repeatedly."""
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=lr)  # type: ignore[attr-defined]
    losses = []
    model.train()  # type: ignore[attr-defined]
    for _ in range(steps):
        loss = torch.zeros(())
        for p, target in zip(PROMPTS, TARGETS):
            ids = torch.tensor([p + [target] * NEW_TOKENS])
            labels = ids.clone()
            labels[:, : len(p)] = -100  # learn the continuation only
            loss = loss + model(input_ids=ids, labels=labels).loss  # type: ignore[operator]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()) / len(PROMPTS))
    model.eval()  # type: ignore[attr-defined]
    return losses


def run_demo(
    args: argparse.Namespace,
    *,
    engine: str,
    start_server: Callable[[Path, Path], Any],
    make_handle: Callable[[str], Any],
    observe: Callable[[Any, list[list[int]]], tuple[list[list[int]], list[str] | None]],
) -> int:
    """The demo's story for any engine: `start_server(model_dir, log)` returns an
    `EngineServerProcess`, `make_handle(url)` the trainer's handle to it, and
    `observe(server, prompts)` its greedy tokens (and the weight versions its responses
    report, where the engine reports them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from enginehooks import WeightSync
    from enginehooks.demo.tiny import hf_greedy, make_tiny_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="enginehooks-demo-"))
    model_dir = make_tiny_model(work / "model", arch="llama", seed=0)
    log = work / f"{engine.lower()}.log"
    print(f"[demo] tiny Llama written to {model_dir}")
    print(f"[demo] starting {engine} (CPU) with the enginehooks plugin ...", flush=True)
    server = start_server(model_dir, log)
    try:
        server.wait_ready(args.start_timeout)
        print(f"[demo] {engine} ready at {server.url} (log: {log})")
        before, _ = observe(server, PROMPTS)

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        losses = train(model, args.steps, args.lr)
        print(f"[demo] trained {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

        options = {"root": str(work / "checkpoints")} if args.transport == "disk" else {}
        with WeightSync(args.transport, timeout_s=args.timeout, bucket_bytes=args.bucket_bytes,
                        pause=True, transport_options=options) as sync:
            handle = make_handle(server.url)
            sync.add_replica(handle)
            report = sync.push(model, version=1)
        after, served = observe(server, PROMPTS + HELD_OUT)
        reference = hf_greedy(model, PROMPTS + HELD_OUT, NEW_TOKENS)
        version = handle.version()
    finally:
        server.stop()
    return show_outcome(engine, before, after, reference, version, report, served)


def run_vllm_demo(args: argparse.Namespace) -> int:
    from enginehooks.demo.servers import VLLMServerProcess
    from enginehooks.vllm_ext import VLLMServer

    return run_demo(
        args, engine="vLLM", start_server=VLLMServerProcess,
        make_handle=lambda url: VLLMServer(url, name="vllm-server"),
        observe=lambda server, prompts: (server.greedy(prompts, NEW_TOKENS), None),
    )


def show_outcome(engine: str, before: list[list[int]], after: list[list[int]],
                 reference: list[list[int]], version: object, report: object,
                 served: list[str] | None = None) -> int:
    """Print what the push changed and return the demo's exit code: 0 only when the
    engine's greedy tokens equal HF's on the new weights and it holds version 1."""
    print("\n[demo] generation (greedy, token ids)")
    for p, b, a in zip(PROMPTS, before, after):
        print(f"  prompt {p}\n    before push: {b}\n    after push:  {a}")
    for p, a, r in zip(HELD_OUT, after[len(PROMPTS):], reference[len(PROMPTS):]):
        print(f"  held-out prompt {p}\n    {engine} after push: {a}\n    HF transformers: {r}")
    print(f"\n[demo] engine reports weight version {version}"
          + (f"; generations say {served}" if served is not None else ""))
    print(report)
    ok = after == reference and version == 1 and served in (None, ["1"])
    print(f"\n[demo] {engine} greedy after push == HF transformers on the new weights "
          f"({len(reference)} prompts): {ok}")
    if not ok:
        print(f"[demo] MISMATCH: HF says {reference}")
    return 0 if ok else 1


def run_sglang_demo(args: argparse.Namespace) -> int:
    from enginehooks.demo.servers import SGLangServerProcess
    from enginehooks.sglang_ext import SGLangServer, answer_version

    def observe(server: SGLangServerProcess, prompts: list[list[int]]
                ) -> tuple[list[list[int]], list[str]]:
        outs = server.generate(prompts, NEW_TOKENS)
        served = sorted({str(answer_version(o["meta_info"])) for o in outs})
        return [list(o["output_ids"]) for o in outs], served

    return run_demo(
        args, engine="SGLang", start_server=SGLangServerProcess,
        make_handle=lambda url: SGLangServer(url, name="sglang-server"), observe=observe,
    )

"""One cell of the conformance matrix: family x engine x trainer x engine dtype.

Run as `python -m tests.engines.conformance.cell` with a JSON request on stdin; prints one JSON
result line. A cell runs in a child process of the suite because an engine that cannot
run a family may take its process down (SGLang SIGQUITs its parent when a child dies).

What a cell checks:
1. The engine starts from the family's tiny checkpoint (else: "engine cannot run", with
   the engine's own error). An engine that loads no checkpoint tensor into some of its
   parameters (`info()["unloaded"]`: vLLM's GPT-OSS ignores `tie_word_embeddings`, so a
   tied checkpoint leaves its output head uninitialised) cannot run that checkpoint
   either, when the push was verified and still differs (`undefined_by_the_checkpoint`).
2. A trainer (plain HF model; PEFT LoRA merged; FSDP2 with 2 ranks on gloo) pushes new
   weights over gloo. The exact oracle: the engine's greedy tokens and their logprobs
   equal those of the same engine freshly started from `save_pretrained` of the pushed
   weights, and differ from before the push. In-process trainers push three versions in
   a row, judged after each (issue 38): the trained weights, the checkpoint's own
   (judged against the engine's start from them), the trained ones again (judged against
   the same fresh load); every push must report a verification that passed (or a
   repair that did). FSDP2 cells push the same three versions from the sharded model
   (the engine then runs as a server, asked between pushes).
3. Bad updates (one extra tensor, one missing, one misshaped) are refused in `check`
   before any byte moves, naming the tensor, and change nothing: same version, same
   outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SEED = 1234
BUCKET = 64 << 10

# Where the cell is, for `matrix.run` when this process dies without a result.
from tests.engines.conformance.matrix import phase  # noqa: E402


def checkpoint(family: str, engine: str, root: Path) -> Path:
    """The family's tiny checkpoint for `engine` (built once per work folder)."""
    from tests.engines.conformance.families import build, family_named

    # no ':' in the path: SGLang serves the model under its path, and refuses a colon
    folder = root / f"{family.replace(':', '-')}-{engine}" / "d0"
    if not (folder / "config.json").exists():
        build(family_named(family), engine, folder)
    return folder


def trained(family: str, d0: Path) -> Any:
    """The trainer's model: the checkpoint in fp32, 'trained' (every weight moved)."""
    import torch
    import transformers

    from enginehooks_testkit.tiny import perturb
    from tests.engines.conformance.families import family_named

    cls_name = family_named(family).model_class
    cls = getattr(transformers, cls_name) if cls_name else transformers.AutoModelForCausalLM
    return perturb(cls.from_pretrained(d0, dtype=torch.float32), seed=SEED)


def with_lora(model: Any) -> tuple[Any, Any]:
    """(PEFT model with trained LoRA factors on every linear layer, its merged copy)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return peft_model, copy.deepcopy(peft_model).merge_and_unload()


def save_reference(model: Any, d0: Path, folder: Path) -> Path:
    from enginehooks_testkit.engines import save_pushed

    return save_pushed(model, d0, folder)


def mutations(state: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(kind, mutated checkpoint state, the tensor the refusal must name)."""
    import torch

    names = list(state)
    layer1 = [n for n in names if ".1." in n] or names
    layer0 = [n for n in names if ".0." in n and state[n].dim() == 2] or \
        [n for n in names if state[n].dim() == 2]
    extra = dict(state, **{"enginehooks_conformance.not_a_weight": torch.zeros(4, 4)})
    missing = {n: t for n, t in state.items() if n != layer1[0]}
    big = max(layer0, key=lambda n: state[n].numel())
    t = state[big]
    misshaped = dict(state, **{big: torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)})
    return [("extra", extra, "enginehooks_conformance.not_a_weight"),
            ("missing", missing, layer1[0]), ("misshaped", misshaped, big)]


def check_bad_updates(sync: Any, replica: Any, reference: Any, version: Any,
                      prompts: Any = None) -> list[str]:
    """Push each bad update; return what went wrong (empty: all refused cleanly)."""
    from enginehooks import ManifestError
    from enginehooks.trainer_side import StateDictAdapter, adapter_for
    from enginehooks_testkit.engines import first_difference

    failures = []
    good = replica.generate(*([prompts] if prompts else []))
    state = dict(adapter_for(reference).stream())
    for kind, bad, culprit in mutations(state):
        adapter = StateDictAdapter(bad)
        try:
            sync.push(adapter, version=f"bad-{kind}")
            failures.append(f"{kind}: the update was accepted")
            continue
        except ManifestError as e:
            if culprit not in str(e):
                failures.append(f"{kind}: refused without naming {culprit!r}: {e}")
        except Exception as e:
            failures.append(f"{kind}: failed with {type(e).__name__} instead of a refusal: {e}")
        if adapter.produced:
            failures.append(f"{kind}: {adapter.produced} tensors moved before the refusal")
        if replica.handle().version() != version:
            failures.append(f"{kind}: the engine's version changed")
        diff = first_difference(replica.generate(*([prompts] if prompts else [])), good)
        if diff is not None:
            failures.append(f"{kind}: outputs changed after a refused update: {diff}")
    return failures


def run_in_process(req: dict[str, Any], work: Path) -> dict[str, Any]:
    """Plain and PEFT trainers pushing into an engine in this process."""
    from enginehooks import WeightSync
    from enginehooks_testkit.engines import (
        EngineUnavailable,
        fresh_generate,
        start_engine,
    )
    from tests.engines.conformance.families import family_named

    family, engine, dtype = req["family"], req["engine"], req["dtype"]
    engine_args = family_named(family).engine_args.get(engine, {})
    phase(work, "build")
    d0 = checkpoint(family, engine, Path(req["root"]))
    # The trainer's model first: vLLM may decorate transformers' classes in place when it
    # loads a model through its Transformers backend (Olmo2Model then needs a vLLM
    # config to be built), so an HF model built after an in-process vLLM engine can fail.
    model = trained(family, d0)
    # The checkpoint's own weights, pushed back after the trained ones: the engine's
    # start from d0 (`before`) is their fresh load, so that push's oracle costs nothing.
    original = untrained(family, d0)
    prompts = cell_prompts(family, engine, d0)
    phase(work, "start")
    try:
        replica = start_engine(engine, d0, dtype=dtype, engine_args=engine_args)
    except EngineUnavailable as e:
        return {"status": "cannot run", "detail": str(e)}
    with replica:
        try:
            before = replica.generate(prompts)
        except Exception as e:  # a plain load of the checkpoint cannot serve either
            return {"status": "cannot run",
                    "detail": f"the engine starts but cannot generate: {type(e).__name__}: {e}"}
        phase(work, "push")
        pushed, reference = (model, model) if req["trainer"] == "plain" else with_lora(model)
        # Successive pushes (issue 38), the exact oracle after each: the trained weights
        # (through the engine's loader; this push records the copy plan), the
        # checkpoint's own (the plan's first use, judged against a fresh load in full),
        # then the trained ones again, exactly (the plan's steady state, where a
        # post-load step that is not safe to run twice would show). The fresh load of
        # the trained weights is started once and judges both of their pushes.
        with WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=120) as sync:
            sync.add_replica(replica.handle())
            outputs, reports, verifications = [], [], []
            for version, weights in ((1, pushed), (2, original), (3, pushed)):
                reports.append(sync.push(weights, version=version))
                outputs.append(replica.generate(prompts))
                verifications.append(replica.handle().info(60)[0].get("verification") or {})
            report = reports[0]
            plan = copy_plan(replica.handle())
            info = replica.handle().info(60)[0]
            phase(work, "oracle")
            oracle = fresh_generate(engine, save_reference(reference, d0, work / "d1"),
                                    dtype=dtype, engine_args=engine_args, prompts=prompts)
            phase(work, "refusals")
            bad = check_bad_updates(sync, replica, reference, 3, prompts)
    after = outputs[0]
    bad = successive(outputs, before, oracle, verifications) + bad
    result = dict(verdict(before, after, oracle, bad, report), copy_plan=plan)
    result["unloaded"] = info.get("unloaded")
    result["pushes"] = [pushed_summary(v) for v in verifications]
    from tests.engines.conformance.matrix import undefined_by_the_checkpoint

    return undefined_by_the_checkpoint(result, info)


def cell_prompts(family: str, engine: str, d0: Path) -> list[Any]:
    """The cell's prompts: the text ids every cell uses, and for a vision-language family
    text with a small image too (`vlm.prompts`), sent again after every push, so that a
    cache the old vision tower filled shows."""
    from enginehooks_testkit.engines import PROMPTS
    from tests.engines.conformance.families import family_named

    if "vision-language" not in family_named(family).tags or not family.startswith("gen:"):
        return PROMPTS
    from tests.engines.conformance.vlm import prompts

    return prompts(engine, d0)


def untrained(family: str, d0: Path) -> Any:
    """The checkpoint's own weights as the trainer holds them (fp32, untouched)."""
    import torch
    import transformers

    from tests.engines.conformance.families import family_named

    cls_name = family_named(family).model_class
    cls = getattr(transformers, cls_name) if cls_name else transformers.AutoModelForCausalLM
    return cls.from_pretrained(d0, dtype=torch.float32)


def pushed_summary(verification: dict[str, Any]) -> dict[str, Any]:
    """One push's verification, as a cell's row keeps it."""
    last = verification.get("last") or {}
    return {k: last.get(k) for k in ("ok", "outcome", "how", "digest_bytes", "shadow_bytes",
                                     "repaired", "unverified", "shadow_kind", "shadow_why")}


def successive(outputs: list[Any], before: Any, oracle: Any,
               verifications: list[dict[str, Any]]) -> list[str]:
    """Problems of the second and third pushes (the first is `verdict`'s): the
    checkpoint's weights pushed back must give what the engine gave when it started
    from them, the trained ones pushed again what their fresh load gives; and every
    push must report a verification that passed (or a repair that did)."""
    from enginehooks_testkit.engines import first_difference

    problems = []
    diff = first_difference(outputs[1], before)
    if diff is not None:
        problems.append(f"push 2 (the checkpoint's weights again) != the engine's start "
                        f"from them: {diff}")
    diff = first_difference(outputs[2], oracle)
    if diff is not None:
        problems.append(f"push 3 (the trained weights again) != freshly loaded: {diff}")
    for i, v in enumerate(verifications, 1):
        last = v.get("last") or {}
        if last.get("ok") is not True or last.get("unverified"):
            problems.append(f"push {i} not verified: {last.get('error') or last.get('unverified')}")
    return problems


def copy_plan(handle: Any) -> dict[str, Any] | None:
    """What went through the engine's copy plan in the judged push (first worker)."""
    info = handle.info(60)[0].get("copy_plan")
    if not info:
        return None
    keys = ("state", "reason", "planned", "loader", "planned_last", "loader_last",
            "loader_examples", "twins_last")
    return {k: info.get(k) for k in keys}


def verdict(before: Any, after: Any, oracle: Any, bad: list[str], report: Any) -> dict[str, Any]:
    from enginehooks_testkit.engines import first_difference

    problems = list(bad)
    diff = first_difference(after, oracle)
    if diff is not None:
        problems.insert(0, f"after the push != freshly loaded: {diff}")
    if first_difference(after, before) is None:
        problems.insert(0, "the push did not change the outputs")
    return {"status": "fail" if problems else "pass", "detail": "; ".join(problems),
            "problems": problems, "tensors": report.tensors, "bytes": report.bytes}


# -- FSDP2: two trainer ranks, the engine as a server -------------------------------------
#: the FSDP2 ranks' versions, in order: the trained weights, the checkpoint's own, the
#: trained ones again (as the in-process cells push them)
FSDP2_VERSIONS = ("trained", "original", "trained")


def run_fsdp2(req: dict[str, Any], work: Path) -> dict[str, Any]:
    """Two FSDP2 trainer ranks (gloo) push to the engine running as a server (a trainer
    and an engine sharing a process would share torch.distributed's default group):
    three versions in a row, the exact oracle after each, as the in-process cells do
    (the ranks wait for `go-<n>` in the cell's folder before push n > 1, and write
    `pushed-<n>` after it, so the engine is asked between pushes)."""
    from enginehooks_testkit.engines import first_difference
    from enginehooks_testkit.servers import HANDLES, SERVERS, free_port
    from tests.engines.conformance.families import family_named

    family, engine, dtype = req["family"], req["engine"], req["dtype"]
    if family_named(family).engine_args.get(engine):
        return {"status": "fail", "detail": "engine arguments are not passed to servers"}
    phase(work, "build")
    d0 = checkpoint(family, engine, Path(req["root"]))
    server_cls = SERVERS[engine]
    phase(work, "start")
    outputs: list[Any] = []
    verifications: list[dict[str, Any]] = []
    with server_cls(d0, work / "server-a.log", dtype=dtype) as a:
        before = a.generations()
        handle = HANDLES[engine](a.url, name="server")
        phase(work, "push")
        port = free_port()
        logs = [work / f"rank-{rank}.log" for rank in (0, 1)]
        job = json.dumps({"family": family, "d0": str(d0), "port": port, "url": a.url,
                          "engine": engine, "out": str(work / "d1"), "work": str(work)})
        procs = []
        for rank, log in zip((0, 1), logs):
            with open(log, "w") as f:  # a file: a pipe nobody reads between pushes fills
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.engines.conformance.cell", "--fsdp2-rank",
                     str(rank)], stdin=subprocess.PIPE, stdout=f, stderr=subprocess.STDOUT,
                    text=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
        for p in procs:  # both ranks get the job before either is waited for
            p.stdin.write(job)  # type: ignore[union-attr]
            p.stdin.close()  # type: ignore[union-attr]
            p.stdin = None  # communicate() would flush the closed pipe
        deadline = time.monotonic() + 600
        for n in range(1, len(FSDP2_VERSIONS) + 1):
            while not (work / f"pushed-{n}").exists():
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.5)
            if not (work / f"pushed-{n}").exists():
                break
            outputs.append(a.generations())
            verifications.append(handle.info(60)[0].get("verification") or {})
            (work / f"go-{n + 1}").touch()
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if any(p.returncode for p in procs) or len(outputs) < len(FSDP2_VERSIONS):
            return {"status": "fail", "detail": "trainer ranks failed: " + " | ".join(
                log.read_text()[-1500:] for log, p in zip(logs, procs) if p.returncode)
                or f"only {len(outputs)} of {len(FSDP2_VERSIONS)} pushes"}
    phase(work, "oracle")
    with server_cls(work / "d1", work / "server-b.log", dtype=dtype) as b:
        oracle = b.generations()
    problems = []
    if first_difference(outputs[0], before) is None:
        problems.append("the push did not change the outputs")
    diff = first_difference(outputs[0], oracle)
    if diff is not None:
        problems.append(f"after the push != freshly loaded: {diff}")
    problems += successive(outputs, before, oracle, verifications)
    return {"status": "fail" if problems else "pass", "detail": "; ".join(problems),
            "pushes": [pushed_summary(v) for v in verifications]}


def fsdp2_rank(rank: int) -> None:
    """One FSDP2 trainer rank: shard every layer, push in lockstep (rank 0 sends) the
    versions of `FSDP2_VERSIONS` (the checkpoint's own weights loaded into the sharded
    model between them); rank 0 saves the trained weights for the oracle first."""
    import datetime

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from enginehooks import WeightSync
    from enginehooks.trainer_side import FSDP2Adapter, push
    from enginehooks_testkit.servers import HANDLES

    job = json.loads(sys.stdin.read())
    work = Path(job["work"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    d0 = Path(job["d0"])
    model = trained(job["family"], d0)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for layer in module:
                fully_shard(layer)
    fully_shard(model)
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=full_options)
    if rank == 0:  # (before the pushes: loading a full state spreads it into DTensors)
        reference = trained(job["family"], d0)
        reference.load_state_dict(full)
        save_reference(reference, d0, Path(job["out"]))
    states = {"trained": full,
              "original": untrained(job["family"], d0).state_dict() if rank == 0 else {}}
    sync = None
    if rank == 0:
        sync = WeightSync("gloo", bucket_bytes=BUCKET, timeout_s=120, pause=True)
        sync.add_replica(HANDLES[job["engine"]](job["url"], name="server"))
    for n, name in enumerate(FSDP2_VERSIONS, 1):
        if n > 1:
            while not (work / f"go-{n}").exists():
                time.sleep(0.2)
            # rank 0's full state, spread to the shards (the others hold none of it)
            set_model_state_dict(model, states[name], options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True))
        push(FSDP2Adapter(model, start_timeout_s=300.0), n, sync=sync)
        dist.barrier()
        if rank == 0:
            (work / f"pushed-{n}").touch()
    if sync is not None:
        sync.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--fsdp2-rank":
        fsdp2_rank(int(sys.argv[2]))
        os._exit(0)
    req = json.loads(sys.stdin.read())
    work = Path(req["workdir"])
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        result = run_fsdp2(req, work) if req["trainer"] == "fsdp2" else run_in_process(req, work)
    except Exception as e:
        result = {"status": "fail", "detail": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-3000:]}
    result.update(req, seconds=round(time.monotonic() - t0, 1))
    print(json.dumps(result), flush=True)
    os._exit(0)  # engines may leave non-daemon threads behind


if __name__ == "__main__":
    main()

"""Real megatron-core trainer ranks on CPU: 2 gloo ranks that build a model through mbridge
from a tiny HF checkpoint, push it into a running engine, train a few steps and push again.

Test support only (the library never imports it). It keeps in one place what running
megatron-core 0.14 + mbridge 0.15.1 on a machine without GPUs needs (the verified recipe
in docs/trainers.md):

* settings: CUDA hidden, `TORCHDYNAMO_DISABLE=1`, the local (no Transformer Engine) layer
  spec and its two norm names, `use_cpu_initialization`, SequentialMLP experts
  (`moe_grouped_gemm=False`) with the allgather dispatcher, `persist_layer_norm=False`;
* patches (`patch_export`, `patch_sequence_parallel_norm`, `patch_training`), each
  applied only where the layout needs it.

Two halves:

* the ranks: `python -m torch.distributed.run --standalone --nproc-per-node 2 -m
  enginehooks_testkit.megatron_cpu JOB.json` in the Megatron environment
  (`scripts/setup-megatron-env.sh`); each rank writes `rank<N>.json` beside the job;
* the launcher: `run_ranks(job, folder)` from any environment (the tests run it from the
  vLLM one), bounded by a timeout that kills the whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Environment of every Megatron rank on CPU.
CPU_ENV: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "",      # megatron and mbridge take the CPU paths only without CUDA
    "TORCHDYNAMO_DISABLE": "1",      # the MoE forward otherwise compiles (minutes, no gain)
    "OMP_NUM_THREADS": "1",          # two ranks on a small machine
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass(frozen=True)
class Layout:
    """A 2-rank layout: tensor, pipeline and expert parallel sizes (expert TP is 1)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 and self.ep > 1  # megatron requires it for TP with EP


LAYOUTS: dict[str, Layout] = {
    "tp2": Layout(tp=2), "pp2": Layout(pp=2), "ep2": Layout(ep=2), "tp2ep2": Layout(tp=2, ep=2),
}


def megatron_python() -> str | None:
    """The Megatron environment's interpreter: `ENGINEHOOKS_MEGATRON_PYTHON`, else the one
    `scripts/setup-megatron-env.sh` builds in the cache; None when there is none."""
    explicit = os.environ.get("ENGINEHOOKS_MEGATRON_PYTHON")
    if explicit:
        return explicit
    cache = Path(os.environ.get("ENGINEHOOKS_CACHE", Path.home() / ".cache" / "enginehooks"))
    python = cache / "venv-megatron" / "bin" / "python"
    return str(python) if python.exists() else None


# -- patches (rank side) ------------------------------------------------------------------
def patch_export() -> None:
    """P1 (export with PP): mbridge allocates the receive buffer of its pipeline broadcast
    on `torch.cuda.current_device()` (mbridge/core/util.py, `broadcast_from_megatron_pp`)."""
    import torch

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def patch_sequence_parallel_norm() -> None:
    """P2 (TP with EP): megatron requires sequence parallelism there, and its torch norm
    (used without Transformer Engine) asserts against it: build the norm from a copy of the
    config with it off and mark its parameters `sequence_parallel`, as the TE norm does."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm, "_enginehooks_cpu", False):
        return
    orig = WrappedTorchNorm.__new__

    def __new__(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return orig(cls, config, *args, **kwargs)
        cfg = copy.copy(config)
        cfg.sequence_parallel = False
        norm = orig(cls, cfg, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = __new__  # type: ignore[method-assign]
    WrappedTorchNorm._enginehooks_cpu = True  # type: ignore[attr-defined]


def patch_training() -> None:
    """Forward and backward through megatron's schedules on CPU:
    P3 the RNG tracker keeps CPU generator states instead of CUDA ones
    (tensor_parallel/random.py); P5 `moe_utils.te_general_gemm` is read even without
    Transformer Engine (a megatron-core 0.14.0 bug); P6 `torch.cuda.synchronize` after the
    pipeline's shape exchange is a no-op. P4 (`device="cuda"` in the schedules) is the
    `CudaToCpu` mode, entered around each step."""
    import megatron.core.tensor_parallel.random as rng
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch

    rng._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    rng._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    def add(self: Any, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"RNG state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    rng.CudaRNGStatesTracker.add = add  # type: ignore[method-assign]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


def _cuda_to_cpu_mode() -> Any:
    """P4: a TorchFunctionMode mapping `device="cuda"` and `.cuda()` to the CPU
    (pipeline_parallel/schedules.py `torch.zeros([], device="cuda")`, rope_utils `.cuda()`)."""
    import torch

    def cpu(d: Any) -> Any:
        try:
            return "cpu" if d is not None and torch.device(d).type == "cuda" else d
        except (TypeError, RuntimeError):
            return d

    class CudaToCpu(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)):
                args = (args[0], cpu(args[1]), *args[2:])
            return func(*args, **kwargs)

    return CudaToCpu()


# -- the model (rank side) ----------------------------------------------------------------
def local_spec(bridge: Any) -> Any:
    """mbridge builds Transformer Engine layer specs and maps the norms TE fuses into the
    linear layers; without TE, megatron's local spec keeps them as modules of their own.
    Use the local spec and map those two norms to their HF names (the rest of the bridge's
    mapping is unchanged)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cls = type(bridge)
    if getattr(cls, "_enginehooks_local_spec", False):
        return bridge
    cls._get_transformer_layer_spec = lambda self, vp_stage=None: get_gpt_decoder_block_spec(
        self.config, use_transformer_engine=False, vp_stage=vp_stage)
    cls._OTHER_MAPPING = dict(getattr(cls, "_OTHER_MAPPING", {}), **{
        "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]})
    mlp = dict(cls._MLP_MAPPING, **{
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]})
    cls._MLP_MAPPING = {k: mlp[k] for k in sorted(mlp, key=len, reverse=True)}  # specific first
    cls._enginehooks_local_spec = True
    return bridge


def build(checkpoint: str | Path, layout: Layout, *, seed: int = 1234) -> tuple[Any, list[Any]]:
    """Initialise megatron's parallel state for `layout` (the default process group must
    exist), build the checkpoint's model through mbridge in fp32 on the CPU and load the
    HF weights into it. Returns (bridge, model chunks)."""
    import torch
    from mbridge import AutoBridge
    from megatron.core import parallel_state as mpu
    from transformers import AutoConfig

    from enginehooks.trainer_side.megatron import grouped_expert_names

    patch_export()
    if layout.sequence_parallel:
        patch_sequence_parallel_norm()
    mpu.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                  pipeline_model_parallel_size=layout.pp,
                                  expert_model_parallel_size=layout.ep,
                                  expert_tensor_parallel_size=1)
    torch.manual_seed(seed)
    hf_config = AutoConfig.from_pretrained(checkpoint)
    if not hasattr(hf_config, "rope_theta"):  # transformers 5 keeps it in rope_parameters
        hf_config.rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0)
    bridge = local_spec(AutoBridge.from_config(hf_config, dtype=torch.float32))
    extra: dict[str, Any] = dict(sequence_parallel=layout.sequence_parallel,
                                 use_cpu_initialization=True)
    if getattr(hf_config, "num_experts", None):
        extra.update(moe_grouped_gemm=False,            # SequentialMLP: no TE, no grouped_gemm
                     persist_layer_norm=False,          # the torch norm rejects it
                     moe_token_dispatcher_type="allgather",  # alltoall wants CUDA streams
                     variable_seq_lengths=False)        # which allgather rejects
    bridge.set_extra_args(**extra)
    # use_torch_fsdp2 with use_cpu_initialization skips mbridge's model.cuda(); nothing is
    # wrapped (wrap_with_ddp=False).
    model = bridge.get_model(bf16=False, use_torch_fsdp2=True, use_cpu_initialization=True)
    bridge.load_weights(grouped_expert_names(model), str(checkpoint))
    return bridge, model


def _sync_grads(model: list[Any], layout: Layout) -> None:
    """What megatron's finalize_model_grads does for these layouts, without its DDP
    wrapper: sum the grads of sequence-parallel and q/k-norm parameters over the TP group,
    average the others over their data-parallel group (experts: the expert one)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    tp_group = mpu.get_tensor_model_parallel_group()
    dp_group = mpu.get_data_parallel_group()
    edp_group = mpu.get_expert_data_parallel_group()
    for chunk in model:
        for name, p in chunk.named_parameters():
            if p.grad is None:
                continue
            if layout.tp > 1 and (getattr(p, "sequence_parallel", False)
                                  or "q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=tp_group)
            group = dp_group if getattr(p, "allreduce", True) else edp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)  # gloo has no AVG
                p.grad.div_(dist.get_world_size(group))


def train(model: list[Any], vocab_size: int, *, steps: int, lr: float = 1e-2, seq: int = 16,
          seed: int = 0) -> list[float | None]:
    """`steps` real optimizer steps: forward and backward through megatron's pipeline
    schedule (language-model loss on one batch of random tokens, each data-parallel rank
    its own), the grads reduced as megatron reduces them, then Adam. Returns the loss of
    each step (on the last pipeline stage; None elsewhere)."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    patch_training()
    model_parallel_cuda_manual_seed(seed + 1)
    layout = Layout(tp=mpu.get_tensor_model_parallel_world_size(),
                    pp=mpu.get_pipeline_model_parallel_world_size(),
                    ep=mpu.get_expert_model_parallel_world_size())
    params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed * 1000 + mpu.get_data_parallel_rank())
    ids = torch.randint(4, vocab_size, (1, seq + 1), generator=g)
    batch = (ids[:, :-1].contiguous(), torch.arange(seq).unsqueeze(0), ids[:, 1:].contiguous())
    losses: list[float | None] = []
    for chunk in model:
        chunk.train()
    for _ in range(steps):  # the same batch each step: its loss must go down

        def forward_step(data_iterator: Any, m: Any) -> Any:
            tokens, positions, labels = next(data_iterator)
            out = m(tokens, positions, attention_mask=None, labels=labels)

            def loss_func(per_token: Any) -> Any:
                loss = per_token.float().mean()
                return loss, {"loss": loss.detach()}

            return out, loss_func

        opt.zero_grad(set_to_none=True)
        with torch.enable_grad(), _cuda_to_cpu_mode():
            res = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([batch]), model=model,
                num_microbatches=1, seq_length=seq, micro_batch_size=1, forward_only=False)
        _sync_grads(model, layout)
        opt.step()
        losses.append(float(res[0]["loss"]) if res else None)
    for chunk in model:
        chunk.eval()
    return losses


def export_to(bridge: Any, model: list[Any], path: Path | None) -> int:
    """Every rank: one pass of the bridge's export (a collective); the rank given a `path`
    saves the HF tensors there (safetensors). Returns the number of tensors."""
    import torch
    from safetensors.torch import save_file

    from enginehooks.trainer_side.megatron import grouped_expert_names

    tensors: dict[str, Any] = {}
    with torch.no_grad():
        for name, t in bridge.export_weights(grouped_expert_names(model)):
            if path is not None:
                tensors[name] = t.detach().to("cpu", copy=True).contiguous()
            else:
                tensors[name] = None
    if path is not None:
        save_file(tensors, str(path))
    return len(tensors)


# -- one rank -----------------------------------------------------------------------------
def rank_main(job_path: Path) -> None:
    """One rank of a job (JSON): build the model of `checkpoint` in `layout`, then for each
    step of `pushes` train `train_steps` steps, push `version` into the engine at `url`
    (rank 0 sends; the other rank follows) and, with `save`, export the pushed weights
    into that file (rank 0 writes). A step with `exclude` pushes the model without that
    tensor instead, and records how each rank saw the refusal (`refused`)."""
    import datetime

    import torch.distributed as dist

    job = json.loads(job_path.read_text())
    out = job_path.parent
    timeout_s = float(job.get("timeout_s", 120))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    res: dict[str, Any] = {"rank": rank, "pushes": []}
    t0 = time.monotonic()
    try:
        from enginehooks import EngineHooksError, WeightSync
        from enginehooks.trainer_side import MegatronBridgeAdapter, push
        from enginehooks_testkit.servers import HANDLES

        layout = LAYOUTS[job["layout"]]
        bridge, model = build(job["checkpoint"], layout)
        res["build_s"] = round(time.monotonic() - t0, 2)
        sync = None
        if rank == 0:
            sync = WeightSync("gloo", bucket_bytes=int(job.get("bucket_bytes", 256 << 10)),
                              timeout_s=timeout_s, pause=True)
            sync.add_replica(HANDLES[job["engine"]](job["url"], name="server"))
        adapter = MegatronBridgeAdapter(model, bridge=bridge, timeout_s=timeout_s,
                                        start_timeout_s=timeout_s)
        for step in job["pushes"]:
            entry: dict[str, Any] = {"version": step["version"]}
            if step.get("train_steps"):
                entry["losses"] = train(model, bridge.hf_config.vocab_size,
                                        steps=int(step["train_steps"]), seed=int(step.get("seed", 0)))
            t1 = time.monotonic()
            if step.get("exclude"):  # a bad update (one tensor left out): the engine refuses it
                left_out = step["exclude"]
                bad = MegatronBridgeAdapter(model, bridge=bridge, timeout_s=timeout_s,
                                            start_timeout_s=timeout_s,
                                            include=lambda n, x=left_out: n != x)
                try:
                    push(bad, step["version"], sync=sync)
                    entry["refused"] = None
                except EngineHooksError as e:
                    entry["refused"] = f"{type(e).__name__}: {e}"
                entry["push_s"] = round(time.monotonic() - t1, 2)
                res["pushes"].append(entry)
                continue
            report = push(adapter, step["version"], sync=sync)
            entry["push_s"] = round(time.monotonic() - t1, 2)
            if report is not None:
                entry.update(tensors=report.tensors, bytes=report.bytes)
            if step.get("save"):
                entry["saved"] = export_to(bridge, model, out / step["save"] if rank == 0 else None)
            res["pushes"].append(entry)
        res["dry_runs"] = adapter.dry_runs
        if sync is not None:
            sync.close()
        dist.barrier()
    except BaseException as e:
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    res["seconds"] = round(time.monotonic() - t0, 2)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0 if "error" not in res else 1)  # no teardown: a peer may be gone


# -- the launcher (any environment) -------------------------------------------------------
class RanksFailed(RuntimeError):
    """The Megatron ranks failed or did not finish in time; the message has their logs."""


def run_ranks(job: dict[str, Any], folder: Path, *, python: str | None = None,
              timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run `job` on 2 Megatron ranks (torchrun, gloo, CPU) in `folder`; return each rank's
    result. Raises `RanksFailed` with the ranks' output when a rank fails or the job
    outlives `timeout_s` (the whole process group is killed then)."""
    python = python or megatron_python()
    if python is None or not Path(python).exists():
        raise RanksFailed(f"no Megatron environment at {python!r}: build it with "
                          "scripts/setup-megatron-env.sh (or set ENGINEHOOKS_MEGATRON_PYTHON)")
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("rank*.json"):
        stale.unlink()
    job_path = folder / "job.json"
    job_path.write_text(json.dumps(job))
    import enginehooks

    root = str(Path(enginehooks.__file__).resolve().parents[1])  # the enginehooks under test
    env = dict(os.environ, **CPU_ENV)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    argv = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "enginehooks_testkit.megatron_cpu", str(job_path)]
    log_path = folder / "ranks.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=folder)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise RanksFailed(f"the Megatron ranks did not finish in {timeout_s}s:\n"
                              f"{log_path.read_text(errors='replace')[-4000:]}") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    found = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
    errors = [f"rank {r['rank']}: {r['error']}\n{r.get('traceback', '')}" for r in found
              if "error" in r]  # the first failure: torchrun stops the other rank then
    if errors or proc.returncode != 0 or len(found) != 2:
        raise RanksFailed("\n".join(errors) or f"torchrun exited {proc.returncode} with "
                          f"{len(found)} results:\n{log_path.read_text(errors='replace')[-4000:]}")
    return found


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))

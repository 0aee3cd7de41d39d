"""GPU data-plane benchmark: enginehooks transports against the raw primitives, one run.

Synthetic weights with the exact tensor shapes of Qwen2.5-7B (bf16, 15.2 GB) live on
GPU 0 in this process (the trainer, rank 0). Receiver processes hold a preallocated
copy of the same shapes on their GPU and receive into it through `ModuleTarget`, the
same `Receiver.deliver` code the engine plugins run. Measured in the same run, so the
ratios are meaningful on a shared machine:

- raw NCCL broadcast of the same bytes at the same bucket size (same process-group
  kind: a `ProcessGroupNCCL` built from a TCPStore), one buffer, back to back;
- enginehooks `nccl` end to end (pack, broadcast, verify, copy into parameters), with
  checksum off and with `sum64`;
- one broadcast per tensor straight into the parameters (how TRL / OpenRLHF sync);
- `cuda_ipc` end to end (receiver process on the same GPU) vs a raw device-to-device
  copy of the same bytes;
- fan-out to 3 receivers vs 1 (only with 4+ GPUs; otherwise recorded as not run);
- peak extra GPU memory per side (max allocated minus what was allocated before).

Every timed item runs from "command posted to the receivers" to "every receiver
reported done", on the sender's clock; medians of `--reps` warm repetitions.

    python benchmarks/bench_transports.py --out benchmarks/results/transports-h200x2.json
    python benchmarks/bench_transports.py --smoke     # CPU only: gloo + shm, tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from enginehooks.core.checksums import sum64_tensor  # noqa: E402
from enginehooks.core.manifest import Manifest, TensorSpec, plan  # noqa: E402
from enginehooks.engine.targets import ModuleTarget  # noqa: E402
from enginehooks.transports._rendezvous import client_store, master_store, new_group  # noqa: E402
from enginehooks.transports.base import Abort  # noqa: E402

GB = 1e9
MiB = 1 << 20


# -- the model ---------------------------------------------------------------------------
def qwen25_7b_specs(layers: int = 28) -> list[TensorSpec]:
    """Qwen2.5-7B: hidden 3584, intermediate 18944, 28 heads, 4 kv heads (head_dim 128),
    vocab 152064, qkv biases, untied lm_head; HF names and order."""
    h, inter, vocab, kv = 3584, 18944, 152064, 4 * 128
    out = [TensorSpec("model.embed_tokens.weight", "bfloat16", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            TensorSpec(p + "input_layernorm.weight", "bfloat16", (h,)),
            TensorSpec(p + "self_attn.q_proj.weight", "bfloat16", (h, h)),
            TensorSpec(p + "self_attn.q_proj.bias", "bfloat16", (h,)),
            TensorSpec(p + "self_attn.k_proj.weight", "bfloat16", (kv, h)),
            TensorSpec(p + "self_attn.k_proj.bias", "bfloat16", (kv,)),
            TensorSpec(p + "self_attn.v_proj.weight", "bfloat16", (kv, h)),
            TensorSpec(p + "self_attn.v_proj.bias", "bfloat16", (kv,)),
            TensorSpec(p + "self_attn.o_proj.weight", "bfloat16", (h, h)),
            TensorSpec(p + "post_attention_layernorm.weight", "bfloat16", (h,)),
            TensorSpec(p + "mlp.gate_proj.weight", "bfloat16", (inter, h)),
            TensorSpec(p + "mlp.up_proj.weight", "bfloat16", (inter, h)),
            TensorSpec(p + "mlp.down_proj.weight", "bfloat16", (h, inter)),
        ]
    out += [
        TensorSpec("model.norm.weight", "bfloat16", (h,)),
        TensorSpec("lm_head.weight", "bfloat16", (vocab, h)),
    ]
    return out


def qwen3_30b_a3b_specs(layers: int = 12) -> list[TensorSpec]:
    """Qwen3-30B-A3B: hidden 2048, 128 experts x moe_intermediate 768, 32 q / 4 kv heads
    of 128, vocab 151936, per-expert tensors as in its checkpoint (48 layers in the real
    model; 12 layers give 4719 tensors, 16.2 GB)."""
    h, e, inter, vocab, nq, nkv, d = 2048, 128, 768, 151936, 32, 4, 128
    bf = "bfloat16"
    out = [TensorSpec("model.embed_tokens.weight", bf, (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            TensorSpec(p + "input_layernorm.weight", bf, (h,)),
            TensorSpec(p + "self_attn.q_proj.weight", bf, (nq * d, h)),
            TensorSpec(p + "self_attn.k_proj.weight", bf, (nkv * d, h)),
            TensorSpec(p + "self_attn.v_proj.weight", bf, (nkv * d, h)),
            TensorSpec(p + "self_attn.o_proj.weight", bf, (h, nq * d)),
            TensorSpec(p + "self_attn.q_norm.weight", bf, (d,)),
            TensorSpec(p + "self_attn.k_norm.weight", bf, (d,)),
            TensorSpec(p + "post_attention_layernorm.weight", bf, (h,)),
            TensorSpec(p + "mlp.gate.weight", bf, (e, h)),
        ]
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            out += [TensorSpec(q + "gate_proj.weight", bf, (inter, h)),
                    TensorSpec(q + "up_proj.weight", bf, (inter, h)),
                    TensorSpec(q + "down_proj.weight", bf, (h, inter))]
    out += [TensorSpec("model.norm.weight", bf, (h,)), TensorSpec("lm_head.weight", bf, (vocab, h))]
    return out


MODELS = {"qwen2.5-7b": ("Qwen2.5-7B shapes", qwen25_7b_specs, 28),
          "qwen3-30b-a3b": ("Qwen3-30B-A3B shapes", qwen3_30b_a3b_specs, 12)}


def smoke_specs() -> list[TensorSpec]:
    return [
        TensorSpec("embed", "bfloat16", (3000, 64)),
        *[TensorSpec(f"l{i}.w", "bfloat16", (64, 256)) for i in range(4)],
        TensorSpec("l.b", "float32", (77,)),
        TensorSpec("head", "bfloat16", (3000, 64)),
    ]


def alloc(specs: list[TensorSpec], device: torch.device, fill: bool) -> dict[str, torch.Tensor]:
    """Parameters of `specs` on `device`: random values (trainer) or zeros (receiver)."""
    g = torch.Generator(device=device).manual_seed(1234)
    out = {}
    for s in specs:
        dt = getattr(torch, s.dtype)
        t = torch.empty(s.shape, dtype=dt, device=device)
        if fill:
            t.copy_(torch.randn(s.shape, generator=g, device=device, dtype=torch.float32))
        else:
            t.zero_()
        out[s.name] = t
    return out


def model_digest(params: dict[str, torch.Tensor]) -> str:
    """sum64 of every tensor's bytes, combined: equal digests = bit-identical models."""
    total = 0
    for i, t in enumerate(params.values()):
        b = t.reshape(-1).view(torch.uint8)
        total = (total * 1000003 + (int(sum64_tensor(b).item()) & ((1 << 64) - 1)) + i) % (
            (1 << 61) - 1
        )
    return f"{total:016x}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mem_base(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    gc.collect()  # buffers of an earlier part must not count as this part's base
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def mem_peak(device: torch.device, base: int) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.max_memory_allocated(device) - base


# -- receiver processes ------------------------------------------------------------------
def receiver_main(
    name: str, rank: int, device_str: str, ctl_port: int, cfg: dict[str, Any]
) -> None:
    """Serve commands posted on the control store until told to exit."""
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctl = client_store("127.0.0.1", ctl_port, cfg["timeout_s"])
    specs = [TensorSpec(*s[:2], tuple(s[2])) for s in cfg["specs"]]
    params: dict[str, torch.Tensor] = {}
    groups: dict[str, Any] = {}
    bufs: dict[int, torch.Tensor] = {}
    state: dict[str, Any] = {}
    manifests: dict[str, Manifest] = {}
    i = 0
    while True:
        cmd = json.loads(ctl.get(f"cmd/{i}"))
        key = f"done/{i}/{name}"
        i += 1
        if name not in cmd["who"]:
            continue
        op = cmd["op"]
        try:
            if op == "exit":
                ctl.set(key, "{}")
                break
            if not params:
                params = alloc(specs, device, fill=False)
            out: dict[str, Any] = {}
            if op == "raw_group":
                store = client_store("127.0.0.1", cmd["port"], cfg["timeout_s"])
                pg = new_group(cfg["backend"], store, cmd["prefix"], cmd["rank_of"][name],
                               cmd["world"], cfg["timeout_s"])
                t = torch.zeros(1, device=device)
                pg.broadcast([t], root_bcast()).wait()
                sync(device)
                groups[cmd["prefix"]] = (pg, store)
            elif op == "raw_bcast":
                pg = groups[cmd["prefix"]][0]
                n = cmd["nbytes"]
                if n not in bufs:
                    bufs.clear()
                    bufs[n] = torch.empty(n, dtype=torch.uint8, device=device)
                w = None
                for _ in range(cmd["count"]):
                    w = pg.broadcast([bufs[n]], root_bcast())
                if w is not None:
                    w.wait()
                sync(device)
            elif op == "per_tensor":
                pg = groups[cmd["prefix"]][0]
                w = None
                for t in params.values():
                    w = pg.broadcast([t], root_bcast())
                if w is not None:
                    w.wait()
                sync(device)
            elif op == "per_tensor_ipc":
                # One CUDA IPC handle per tensor, opened, copied from and dropped: the
                # pattern of SGLang's update_weights_from_tensor / verl's colocated sync.
                from enginehooks.transports.cuda_ipc import rebuild

                for (name_, desc) in cmd["descs"]:
                    t = params[name_]
                    src = rebuild(desc, device)
                    t.view(-1).view(torch.uint8).copy_(src)
                    del src
                sync(device)
            elif op == "raw_free":
                bufs.clear()
                for pg, _s in groups.values():
                    pg.abort() if hasattr(pg, "abort") else None
                groups.clear()
            elif op == "eh_join":
                ep = cmd["endpoint"]
                from enginehooks.plugins import get_transport

                bufs.clear()
                for t in params.values():
                    t.zero_()  # earlier parts wrote the right bytes: make this one do it too
                state["base"] = mem_base(device)
                r = get_transport(ep["transport"]).receiver(ep, cmd["rank_of"][name], device)
                r.connect()
                state["receiver"] = r
            elif op == "eh_deliver":
                # Parsed once per manifest text: an engine parses it at `check`, before
                # the transfer this times.
                m = manifests.get(cmd["manifest"])
                if m is None:
                    manifests.clear()
                    m = manifests[cmd["manifest"]] = Manifest.from_json(cmd["manifest"])
                t0 = time.perf_counter()
                state["delivers"] = state.get("delivers", 0) + 1
                prof_path = os.environ.get("ENGINEHOOKS_BENCH_PROFILE")
                if prof_path and state["delivers"] == 4:  # a warm push, under cProfile
                    import cProfile
                    import io
                    import pstats

                    pr = cProfile.Profile()
                    pr.enable()
                    got = state["receiver"].deliver(m, ModuleTarget(params, device))
                    pr.disable()
                    buf = io.StringIO()
                    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
                    with open(f"{prof_path}.{name}.txt", "a") as f:
                        f.write(buf.getvalue())
                else:
                    got = state["receiver"].deliver(m, ModuleTarget(params, device))
                sync(device)
                out["seconds"] = time.perf_counter() - t0
                if "phases_ms" in got:
                    out["phases_ms"] = got["phases_ms"]
            elif op == "eh_leave":
                out["peak_extra_bytes"] = mem_peak(device, state.pop("base", 0))
                state.pop("receiver").close()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            elif op == "digest":
                out["digest"] = model_digest(params)
                for t in params.values():
                    t.zero_()  # the next transport must write every byte again
            ctl.set(key, json.dumps(out))
        except BaseException as e:
            ctl.set(key, json.dumps({"error": f"{type(e).__name__}: {e}",
                                     "trace": traceback.format_exc()[-3000:]}))
            if op == "exit":
                break


def root_bcast() -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


# -- the sender / driver -----------------------------------------------------------------
class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = args.smoke
        self.backend = "gloo" if self.smoke else "nccl"
        self.colo = "shm" if self.smoke else "cuda_ipc"
        self.n_gpus = 0 if self.smoke else torch.cuda.device_count()
        self.device = torch.device("cpu") if self.smoke else torch.device("cuda", 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        _title, fn, default_layers = MODELS[args.model]
        self.specs = smoke_specs() if self.smoke else fn(args.layers or default_layers)
        self.total = sum(s.nbytes for s in self.specs)
        self.ctl = master_store("127.0.0.1", 0, args.timeout_s)
        self.seq = 0
        self.procs: dict[str, Any] = {}
        self.results: dict[str, Any] = {"items": {}, "not_run": {}}

    # control plane of the benchmark itself
    def post(self, op: str, who: list[str], **kw: Any) -> int:
        i = self.seq
        self.seq += 1
        self.ctl.set(f"cmd/{i}", json.dumps({"op": op, "who": who, **kw}))
        return i

    def wait(self, i: int, who: list[str]) -> list[dict[str, Any]]:
        keys = [f"done/{i}/{w}" for w in who]
        self.ctl.wait(keys, _dt.timedelta(seconds=self.args.timeout_s))
        out = [json.loads(v) for v in self.ctl.multi_get(keys)]
        for w, o in zip(who, out, strict=True):
            if "error" in o:
                raise RuntimeError(f"receiver {w}: {o['error']}\n{o.get('trace', '')}")
        return out

    def call(self, op: str, who: list[str], **kw: Any) -> list[dict[str, Any]]:
        return self.wait(self.post(op, who, **kw), who)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        cfg = {"timeout_s": self.args.timeout_s, "backend": self.backend,
               "specs": [[s.name, s.dtype, list(s.shape)] for s in self.specs]}
        names: list[tuple[str, str]] = []
        if self.smoke:
            names = [("g1", "cpu"), ("g2", "cpu"), ("g3", "cpu"), ("c0", "cpu")]
        else:
            names = [(f"g{i}", f"cuda:{i}") for i in range(1, self.n_gpus)] + [("c0", "cuda:0")]
        for name, dev in names:
            p = ctx.Process(target=receiver_main, args=(name, 0, dev, self.ctl.port, cfg),
                            daemon=True)
            p.start()
            self.procs[name] = p
        self.params = alloc(self.specs, self.device, fill=True)
        sync(self.device)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call("exit", list(self.procs))
        for p in self.procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    # timing
    def timed(self, fn: Callable[[], None]) -> dict[str, Any]:
        for _ in range(self.args.warmup):
            fn()
        times = []
        for _ in range(self.args.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        return {"seconds_median": med, "seconds_all": times, "gbps": self.total / med / GB}

    def record(self, key: str, res: dict[str, Any], **extra: Any) -> None:
        res.update(extra)
        self.results["items"][key] = res
        print(f"  {key:42s} {res['seconds_median'] * 1e3:9.2f} ms  {res['gbps']:8.1f} GB/s",
              flush=True)

    # -- parts ---------------------------------------------------------------------------
    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.params.items())

    def manifest(self, bucket: int, checksum: str | None, version: int = 1,
                 transport: str | None = None) -> Manifest:
        """The update as `WeightSync` plans it for `transport` (its direct buckets too);
        without one, every bucket packed (the raw baselines' cut)."""
        direct_min = None
        if transport is not None:
            from enginehooks.plugins import get_transport

            direct_min = get_transport(transport).direct_min
        return plan(self.specs, weight_version=version, bucket_bytes=bucket, checksum=checksum,
                    direct_min=direct_min)

    def raw_broadcast(self, who: list[str], bucket: int, tag: str) -> None:
        """Raw NCCL broadcast of the same bytes, cut at the same bucket size."""
        m = self.manifest(bucket, None)
        from enginehooks.core.buckets import message_bytes

        sizes = [message_bytes(b.nbytes) for b in m.buckets]
        nbytes, count = max(sizes), len(sizes)
        store = master_store("127.0.0.1", 0, self.args.timeout_s)
        prefix = f"raw-{tag}/"
        rank_of = {w: i + 1 for i, w in enumerate(who)}
        i = self.post("raw_group", who, port=store.port, prefix=prefix, world=len(who) + 1,
                      rank_of=rank_of)
        pg = new_group(self.backend, store, prefix, 0, len(who) + 1, self.args.timeout_s)
        pg.broadcast([torch.zeros(1, device=self.device)], root_bcast()).wait()
        sync(self.device)
        self.wait(i, who)
        buf = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)]

        def once() -> None:
            j = self.post("raw_bcast", who, prefix=prefix, nbytes=nbytes, count=count)
            w = None
            for _ in range(count):
                w = pg.broadcast(buf, root_bcast())
            if w is not None:
                w.wait()
            sync(self.device)
            self.wait(j, who)

        self.record(f"raw_broadcast[{tag}]", self.timed(once), receivers=len(who),
                    bucket_bytes=bucket, messages=count, message_bytes=nbytes)
        if tag.endswith("r1") and self.args.per_tensor:

            def per_tensor() -> None:
                j = self.post("per_tensor", who, prefix=prefix)
                w = None
                for t in self.params.values():
                    w = pg.broadcast([t], root_bcast())
                if w is not None:
                    w.wait()
                sync(self.device)
                self.wait(j, who)

            self.record("per_tensor_broadcast[r1]", self.timed(per_tensor), receivers=len(who),
                        tensors=len(self.specs))
        buf.clear()
        self.call("raw_free", who)
        if hasattr(pg, "abort"):
            pg.abort()

    def enginehooks(self, transport: str, who: list[str], bucket: int,
                    checksums: list[str | None], tag: str) -> None:
        """enginehooks end to end: sender.send + every receiver's deliver into params."""
        from enginehooks.plugins import get_transport

        base = mem_base(self.device)
        opts: dict[str, Any] = {}
        if transport == "cuda_ipc" and tag.endswith(",packed"):
            opts["single_copy"] = False
        sender = get_transport(transport).sender(
            host="127.0.0.1", port=0, timeout_s=self.args.timeout_s, device=self.device, **opts)
        rank_of = {w: i + 1 for i, w in enumerate(who)}
        ep = dict(sender.endpoint(), world_size=len(who) + 1)
        j = self.post("eh_join", who, endpoint=ep, rank_of=rank_of)
        sender.connect(len(who) + 1)
        self.wait(j, who)
        recv_seconds: dict[str, list[float]] = {}
        try:
            for checksum in checksums:
                m = self.manifest(bucket, checksum, transport=transport)
                text = m.to_json()
                rs: list[float] = []

                extra: dict[str, Any] = {}

                def once(m: Manifest = m, text: str = text, rs: list[float] = rs,
                         extra: dict[str, Any] = extra) -> None:
                    k = self.post("eh_deliver", who, manifest=text)
                    st = sender.send(m, self.stream(), Abort())
                    extra.update(st.extra)
                    extra.setdefault("send_seconds", []).append(st.seconds)
                    sync(self.device)
                    out = self.wait(k, who)
                    rs.append(max(o["seconds"] for o in out))
                    if "phases_ms" in out[0]:
                        extra.setdefault("receiver_phases_ms", []).append(out[0]["phases_ms"])
                    if "phases_ms" in st.extra:
                        extra.setdefault("sender_phases_ms", []).append(st.extra["phases_ms"])

                cs = checksum or "none"
                self.record(f"{transport}[{tag},checksum={cs}]", self.timed(once),
                            receivers=len(who), bucket_bytes=bucket, buckets=len(m.buckets),
                            checksum=checksum, sender_extra=dict(extra),
                            deliver_seconds=list(rs))
                recv_seconds[cs] = rs
        finally:
            sender_peak = mem_peak(self.device, base)
            out = self.call("eh_leave", who)
            sender.close()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        digests = self.call("digest", who)
        mine = model_digest(self.params)
        exact = all(d["digest"] == mine for d in digests)
        self.results["items"].setdefault(f"memory[{transport},{tag}]", {}).update({
            "sender_peak_extra_bytes": sender_peak,
            "receiver_peak_extra_bytes": max(o["peak_extra_bytes"] for o in out),
            "bucket_bytes": bucket,
            "slot_bytes": max(m.buckets, key=lambda b: b.nbytes).nbytes,
        })
        self.results["items"][f"bit_exact[{transport},{tag}]"] = {"ok": exact}
        print(f"  memory {transport}[{tag}]: sender +{sender_peak / MiB:.0f} MiB, receiver "
              f"+{max(o['peak_extra_bytes'] for o in out) / MiB:.0f} MiB; bit-exact: {exact}",
              flush=True)
        if not exact:
            raise RuntimeError(f"{transport}[{tag}]: receivers' weights differ from the sender's")

    def raw_copy(self) -> None:
        """A raw device-to-device copy of the same bytes (one flat buffer to another)."""
        src = torch.empty(self.total, dtype=torch.uint8, device=self.device)
        pair = [src.random_(), torch.empty_like(src)]
        del src

        def once() -> None:
            pair[1].copy_(pair[0])
            sync(self.device)

        self.record("raw_device_copy", self.timed(once))
        pair.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def raw_foreach_copy(self) -> None:
        """The same tensors copied into a second set in one process
        (`torch._foreach_copy_`): the copy floor for many tensors."""
        dst = {n: torch.empty_like(t) for n, t in self.params.items()}
        srcs, dsts = list(self.params.values()), list(dst.values())

        def once() -> None:
            torch._foreach_copy_(dsts, srcs)
            sync(self.device)

        self.record("raw_foreach_copy", self.timed(once), tensors=len(srcs))
        dst.clear()
        dsts.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def per_tensor_ipc(self, who: list[str]) -> None:
        """One CUDA IPC handle per tensor per push (torch's own sharing), each rebuilt in
        the engine process and copied into its parameter."""
        from enginehooks.transports.cuda_ipc import describe

        names = list(self.params)

        def once() -> None:
            for start in range(0, len(names), 512):
                part = names[start:start + 512]
                descs = [[n, describe(self.params[n].reshape(-1).view(torch.uint8))]
                         for n in part]
                self.call("per_tensor_ipc", who, descs=descs)
            torch.cuda.ipc_collect()

        saved = (self.args.warmup, self.args.reps)
        self.args.warmup, self.args.reps = 1, self.args.per_tensor_reps
        try:
            self.record("per_tensor_ipc", self.timed(once), tensors=len(names))
        finally:
            self.args.warmup, self.args.reps = saved
        self.call("digest", who)  # zero the receiver again

    def run(self) -> dict[str, Any]:
        a = self.args
        buckets = [int(b * MiB) for b in a.bucket_mib] if not self.smoke else [16384]
        checks: list[str | None] = [None if c == "none" else c for c in a.checksums]
        parts = set(a.parts)
        one = ["g1"]
        print(f"model: {len(self.specs)} tensors, {self.total / GB:.2f} GB; device {self.device}; "
              f"buckets {[b // MiB for b in buckets]} MiB", flush=True)
        if "nccl" in parts:
            if self.n_gpus >= 2 or self.smoke:
                for b in buckets:
                    tag = f"{b // MiB}MiB,r1" if not self.smoke else "smoke,r1"
                    self.raw_broadcast(one, b, tag)
                    self.enginehooks(self.backend, one, b, checks, tag)
            else:
                self.results["not_run"]["nccl"] = f"needs 2 GPUs, found {self.n_gpus}"
        if "cuda_ipc" in parts:
            self.raw_copy()
            if not self.smoke:
                self.raw_foreach_copy()
            for b in buckets:
                tag = f"{b // MiB}MiB,r1" if not self.smoke else "smoke,r1"
                self.enginehooks(self.colo, ["c0"], b, checks, tag)
            if not self.smoke and a.packed:
                b = buckets[0]
                self.enginehooks(self.colo, ["c0"], b, checks, f"{b // MiB}MiB,r1,packed")
            if not self.smoke and a.per_tensor:
                self.per_tensor_ipc(["c0"])
        if "fanout" in parts:
            if self.n_gpus >= 4 or self.smoke:
                three = ["g1", "g2", "g3"]
                b = buckets[0]
                tag = f"{b // MiB}MiB,r3" if not self.smoke else "smoke,r3"
                self.raw_broadcast(three, b, tag)
                self.enginehooks(self.backend, three, b, checks, tag)
            else:
                self.results["not_run"]["fanout"] = (
                    f"fan-out to 3 receivers needs 4 GPUs; this machine has {self.n_gpus}")
        return self.results


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if info["gpu_count"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(info["gpu_count"])]
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        try:
            import subprocess

            q = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            ).stdout.strip().splitlines()
            info["driver"] = q[0].split(",")[0].strip() if q else None
            info["gpu_memory"] = [x.split(",")[1].strip() for x in q]
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                  timeout=30).stdout
            info["topology"] = topo[:2000]
        except Exception as e:
            info["driver"] = f"unknown ({e})"
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "ENGINEHOOKS_FUSED_PACK",
              "ENGINEHOOKS_FUSED_UNPACK"):
        if k in os.environ:
            info[k] = os.environ[k]
    return info


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Ratios against the raw primitives of the same run, and the issue's targets."""
    items = res["items"]
    out: dict[str, Any] = {}
    for key, v in items.items():
        if not key.startswith(("nccl[", "gloo[")):
            continue
        tag = key[key.index("[") + 1 : key.index(",checksum")]
        raw = items.get(f"raw_broadcast[{tag}]")
        if raw:
            out[f"{key} / raw_broadcast"] = raw["seconds_median"] / v["seconds_median"]
    raws = [v["seconds_median"] for k, v in items.items()
            if k.startswith("raw_broadcast[") and ",r1" in k and "seconds_median" in v]
    if raws:  # the fastest raw cut of the same bytes: what the wire can do in this run
        for key, v in items.items():
            if key.startswith(("nccl[", "gloo[")) and ",r1," in key:
                out[f"{key} / best raw_broadcast"] = min(raws) / v["seconds_median"]
    for key, v in items.items():
        if key.startswith(("cuda_ipc[", "shm[")) and "raw_device_copy" in items:
            out[f"{key} / raw_device_copy"] = (
                items["raw_device_copy"]["seconds_median"] / v["seconds_median"])
    for key, v in items.items():
        if key.startswith("cuda_ipc[") and "raw_foreach_copy" in items:
            out[f"{key} / raw_foreach_copy"] = (
                items["raw_foreach_copy"]["seconds_median"] / v["seconds_median"])
    pti = items.get("per_tensor_ipc")
    if pti:
        for key, v in items.items():
            if key.startswith("cuda_ipc[") and "seconds_median" in v:
                out[f"{key} speedup over per_tensor_ipc"] = (
                    pti["seconds_median"] / v["seconds_median"])
    pt = items.get("per_tensor_broadcast[r1]")
    if pt:
        for key, v in items.items():
            if key.startswith(("nccl[", "gloo[")) and ",r1," in key:
                out[f"{key} speedup over per_tensor"] = pt["seconds_median"] / v["seconds_median"]
    r3 = [k for k in items if k.startswith(("nccl[", "gloo[")) and ",r3," in k]
    for k3 in r3:
        k1 = k3.replace(",r3,", ",r1,")
        if k1 in items:
            out[f"{k3} time / r1 time"] = items[k3]["seconds_median"] / items[k1]["seconds_median"]
    return out


def print_table(res: dict[str, Any]) -> None:
    print("\n| item | median ms | GB/s |")
    print("| --- | ---: | ---: |")
    for k, v in res["items"].items():
        if "seconds_median" in v:
            print(f"| {k} | {v['seconds_median'] * 1e3:.2f} | {v['gbps']:.1f} |")
    print("\n| memory | sender extra MiB | receiver extra MiB | bucket MiB |")
    print("| --- | ---: | ---: | ---: |")
    for k, v in res["items"].items():
        if k.startswith("memory["):
            print(f"| {k} | {v['sender_peak_extra_bytes'] / MiB:.0f} | "
                  f"{v['receiver_peak_extra_bytes'] / MiB:.0f} | {v['bucket_bytes'] / MiB:.0f} |")
    print("\n| ratio | value |")
    print("| --- | ---: |")
    for k, v in res["summary"].items():
        print(f"| {k} | {v:.3f} |")
    for k, v in res["not_run"].items():
        print(f"not run: {k}: {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bucket-mib", type=float, nargs="+", default=[1024, 512, 256],
                    help="bucket sizes; the first is the GPU transports' default "
                         "(default_bucket_bytes)")
    ap.add_argument("--checksums", nargs="+", default=["none", "sum64"],
                    help="checksums for the enginehooks runs: none, sum64, crc32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-7b",
                    help="tensor shapes: Qwen2.5-7B (dense) or Qwen3-30B-A3B (MoE, per expert)")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers (default: all 28 for 7B, 12 of 48 for the MoE)")
    ap.add_argument("--per-tensor-reps", type=int, default=2,
                    help="repetitions of the per-tensor IPC handle baseline (slow)")
    ap.add_argument("--packed", action="store_true",
                    help="also run cuda_ipc's two-buffer path (single_copy=False)")
    ap.add_argument("--parts", nargs="+", default=["nccl", "cuda_ipc", "fanout"],
                    choices=["nccl", "cuda_ipc", "fanout"])
    ap.add_argument("--no-per-tensor", dest="per_tensor", action="store_false")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--smoke", action="store_true", help="CPU: gloo + shm on tiny shapes")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (matplotlib)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        ap.error("no CUDA device here; --smoke runs the CPU variant")
    kind = "smoke" if args.smoke else (
        f"{torch.cuda.get_device_name(0).replace('NVIDIA ', '').replace(' ', '')}"
        f"x{torch.cuda.device_count()}").lower()
    out = args.out or ROOT / "benchmarks" / "results" / f"transports-{kind}.json"
    drv = Driver(args)
    drv.start()
    try:
        res = drv.run()
    finally:
        drv.stop()
    res["machine"] = machine()
    res["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    res["model"] = {"name": MODELS[args.model][0] if not args.smoke else "smoke",
                    "tensors": len(drv.specs), "bytes": drv.total, "dtype": "bfloat16"}
    res["summary"] = summarize(res)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print_table(res)
    print(f"\nwrote {out}")
    if args.plot is not None:
        from plot_transports import plot

        plot(res, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

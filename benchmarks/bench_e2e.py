"""Colocated RL on one GPU, end to end: an FSDP2 trainer (world size 1) pushes into a
replica process on the same GPU through `trainer_side.push` + `WeightSync(transport=
"cuda_ipc")`, against a raw device copy of the same bytes in the same run.

The trainer is a Llama-architecture `transformers` model (Qwen2.5-7B widths, fewer
layers by default) wrapped with `fully_shard` on a one-rank NCCL group; the replica is a
`LocalEngine` around the same architecture in a spawned process, reached through a
small JSON-over-pipe engine handle (the verbs are JSON in and out; nothing is pickled).
So the bytes take the user's path: the FSDP2 adapter's checkpoint-format stream, the
coordinator, the engine contract's verbs, `EngineSide`, and `Receiver.deliver` into the
module (single copy, digest fused into the receiver's copy). Each push is checked bit
for bit afterwards (sum64 of every tensor on both sides).

    python benchmarks/bench_e2e.py --out benchmarks/results/e2e-h100.json
    python benchmarks/bench_e2e.py --layers 2 --hidden 256 --reps 1   # a quick check
    python benchmarks/bench_e2e.py --arch qwen3_moe --layers 5 --out ...  # MoE shapes
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from enginehooks.control.handles import EngineHandle  # noqa: E402
from enginehooks.core.checksums import sum64_tensor  # noqa: E402
from enginehooks.core.errors import ReplicaError  # noqa: E402

GB = 1e9


def build_model(cfg: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The trainer's architecture: Llama (dense, the default) or Qwen3-MoE (`--arch
    qwen3_moe`: transformers 5 fuses each layer's experts, which the checkpoint format
    sends as per-expert tensors, thousands of them)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if cfg.get("arch", "llama") == "qwen3_moe":
                from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

                model: torch.nn.Module = Qwen3MoeForCausalLM(Qwen3MoeConfig(
                    hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                    moe_intermediate_size=cfg["moe_intermediate"],
                    num_experts=cfg["experts"], num_experts_per_tok=8,
                    num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                    num_key_value_heads=cfg["kv_heads"], head_dim=128,
                    vocab_size=cfg["vocab"], tie_word_embeddings=False,
                    max_position_embeddings=4096))
            else:
                from transformers import LlamaConfig, LlamaForCausalLM

                model = LlamaForCausalLM(LlamaConfig(
                    hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                    num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                    num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
                    tie_word_embeddings=False, max_position_embeddings=4096))
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The replica's tensors under the checkpoint's names (what `save_pretrained` writes:
    per-expert tensors for the MoE), zeroed, on the model's device; the model itself is
    dropped. A dense model's names are its own."""
    from enginehooks.trainer_side import adapter_for

    dev = next(model.parameters()).device
    specs = adapter_for(model).specs()
    return {s.name: torch.zeros(s.shape, dtype=torch.bfloat16, device=dev) for s in specs}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sum64 of every tensor's bytes, combined in name order."""
    total = 0
    for i, name in enumerate(sorted(tensors)):
        b = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        total = (total * 1000003 + (int(sum64_tensor(b).item()) & ((1 << 64) - 1)) + i) % (
            (1 << 61) - 1)
    return f"{total:016x}"


# -- the replica process ---------------------------------------------------------------
def replica_main(conn: Any, cfg_json: str) -> None:
    from enginehooks.engine.local import LocalEngine

    cfg = json.loads(cfg_json)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if cfg.get("arch", "llama") == "llama":
        model: Any = build_model(cfg, device)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        tensors = None
    else:  # the checkpoint's per-expert tensors, as an engine loads them
        model = checkpoint_tensors(build_model(cfg, device))
        torch.cuda.empty_cache()
        tensors = model
    engine = LocalEngine(model, name="replica", device=device)

    def state() -> dict[str, torch.Tensor]:
        return dict(tensors) if tensors is not None else dict(model.state_dict())

    def params() -> list[torch.Tensor]:
        return list(tensors.values()) if tensors is not None else list(model.parameters())

    while True:
        msg = json.loads(conn.recv_bytes())
        reply: dict[str, Any]
        try:
            if msg["op"] == "stop":
                conn.send_bytes(b"{}")
                return
            if msg["op"] == "zero":
                with torch.no_grad():
                    for p in params():
                        p.zero_()
                torch.cuda.synchronize()
                reply = {}
            elif msg["op"] == "digest":
                torch.cuda.synchronize()
                reply = {"digest": digest(state())}
            elif msg["op"] == "profile":  # cProfile the calls in between (on, then off)
                import cProfile
                import io
                import pstats

                if msg["on"]:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    reply = {}
                else:
                    profiler.disable()
                    buf = io.StringIO()
                    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(40)
                    reply = {"text": buf.getvalue()}
            else:
                out = engine.rpc(msg["method"], *msg["args"], timeout_s=msg["timeout_s"])
                reply = {"ok": out}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        conn.send_bytes(json.dumps(reply).encode())


class ProcessReplica(EngineHandle):
    """A replica in another process (`main(conn, cfg_json)`, by default a `LocalEngine`),
    one JSON call at a time over a pipe. `bench_verify.py` passes its own `main`."""

    def __init__(self, cfg: dict[str, Any], main: Any = None) -> None:
        self.name = "replica"
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main or replica_main, args=(child, json.dumps(cfg)),
                                daemon=True)
        self.proc.start()
        self.lock = threading.Lock()

    def _call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        with self.lock:
            self.conn.send_bytes(json.dumps(msg).encode())
            if not self.conn.poll(timeout_s):
                raise ReplicaError(f"replica: no answer to {msg.get('method', msg['op'])} "
                                   f"within {timeout_s}s")
            reply: dict[str, Any] = json.loads(self.conn.recv_bytes())
        if "error" in reply:
            raise ReplicaError(f"replica: {reply['error']}")
        return reply

    def rpc(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        out = self._call({"op": "rpc", "method": method, "args": list(args),
                          "timeout_s": timeout_s}, timeout_s + 30)["ok"]
        return list(out)

    def flush_pending(self) -> bool:
        return False  # a module has no cache: no call to make

    def flush_cache(self, timeout_s: float, auth: str | None = None) -> None:
        """A module has no cache."""

    def zero(self) -> None:
        self._call({"op": "zero"}, 600)

    def digest(self) -> str:
        return str(self._call({"op": "digest"}, 600)["digest"])

    def stop(self) -> None:
        try:
            self._call({"op": "stop"}, 60)
        finally:
            self.proc.join(timeout=60)
            if self.proc.is_alive():
                self.proc.kill()


def push_facts(report: Any) -> dict[str, Any]:
    """What a push report says about where its time went, JSON-able: calls per replica,
    the path (planned / prepared), the sender's and each replica worker's phases."""
    workers = [w for res in report.replicas for w in (res.stats or {}).get("workers") or []]
    return {"rpcs": report.rpcs, "layout": report.layout,
            "doorbells": report.sender.get("doorbells"),
            "sender_phases_ms": dict(report.sender.get("phases_ms") or {}),
            "replica_phases_ms": [dict(w.get("phases_ms") or {}) for w in workers],
            "replica_seconds": [w.get("seconds") for w in workers]}


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over `rows` (a key a row lacks counts as 0)."""
    names = sorted({k for r in rows for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in names}


def phases_ms(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """`phases_ms` of a benchmark row, medians in ms over the timed pushes: the trainer's
    push phases and the trainer-side total outside them, the sender's and each replica
    worker's transport phases, each worker's receive time."""
    trainer = {k: v * 1e3 for k, v in _medians([r["phases"] for r in reports]).items()}
    if all("seconds" in r for r in reports):
        trainer["outside_phases"] = statistics.median(
            r["seconds"] - sum(r["phases"].values()) for r in reports) * 1e3
    workers = max(len(r.get("replica_phases_ms", [])) for r in reports)
    return {"trainer": trainer,
            "sender": _medians([r.get("sender_phases_ms", {}) for r in reports]),
            "replica": [_medians([r["replica_phases_ms"][w] for r in reports
                                  if len(r.get("replica_phases_ms", [])) > w])
                        for w in range(workers)],
            "replica_receive_ms": [
                statistics.median([r["replica_seconds"][w] * 1e3 for r in reports
                                   if len(r.get("replica_seconds", [])) > w
                                   and r["replica_seconds"][w]] or [0.0])
                for w in range(max(len(r.get("replica_seconds", [])) for r in reports))],
            "doorbells": reports[-1].get("doorbells")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["llama", "qwen3_moe"], default="llama",
                    help="qwen3_moe: Qwen3-30B-A3B widths (give --layers; 5 is ~6 GB)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--intermediate", type=int, default=18944)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--bucket-mib", type=int, default=None,
                    help="bucket size (default: the transport's default_bucket_bytes)")
    ap.add_argument("--checksums", nargs="+", default=["sum64", "none"])
    ap.add_argument("--window-mib", type=int, default=None,
                    help="cuda_ipc: bytes per doorbell window (`window_bytes`; default none)")
    ap.add_argument("--window-tensors", type=int, default=None,
                    help="cuda_ipc: tensors per doorbell window (`window_tensors`; "
                    "default none: one doorbell per push)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from enginehooks import WeightSync
    from enginehooks.trainer_side import push

    cfg: dict[str, Any] = {"arch": args.arch, "layers": args.layers, "hidden": args.hidden,
                           "intermediate": args.intermediate, "heads": args.heads,
                           "kv_heads": args.kv_heads, "vocab": args.vocab}
    if args.arch == "qwen3_moe":  # Qwen3-30B-A3B's widths, fewer layers
        cfg.update(hidden=2048, intermediate=6144, moe_intermediate=768, experts=128,
                   heads=32, kv_heads=4, vocab=151936)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, device_id=device)
    replica = ProcessReplica(cfg)
    model = build_model(cfg, device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t
            for n, t in model.state_dict().items()}
    if args.arch != "llama":  # the digest is of what travels: the checkpoint's tensors
        from enginehooks.trainer_side import adapter_for

        ad = adapter_for(model)
        ad.specs()
        full = {n: t.clone() for n, t in ad.stream()}
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    res: dict[str, Any] = {"config": {**cfg, "bucket_mib": args.bucket_mib, "reps": args.reps,
                                      "window_mib": args.window_mib,
                                      "window_tensors": args.window_tensors},
                           "tensors": len(full), "bytes": nbytes, "items": {}}

    def med(fn: Any) -> dict[str, Any]:
        for _ in range(args.warmup):
            fn()
        ts = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return {"seconds_median": statistics.median(ts), "seconds_all": ts}

    # raw copies of the same bytes, same run
    pair = [torch.empty(nbytes, dtype=torch.uint8, device=device).random_()]
    pair.append(torch.empty_like(pair[0]))
    res["items"]["raw_device_copy"] = med(lambda: pair[1].copy_(pair[0]))
    pair.clear()
    lists = (list(full.values()), [torch.empty_like(t) for t in full.values()])
    res["items"]["raw_foreach_copy"] = med(lambda: torch._foreach_copy_(lists[1], lists[0]))
    lists[0].clear()
    lists[1].clear()
    mine = digest(full)
    del full
    torch.cuda.empty_cache()
    version = 0
    transport_options: dict[str, Any] = {}
    if args.window_mib:
        transport_options["window_bytes"] = args.window_mib << 20
    if args.window_tensors is not None:
        transport_options["window_tensors"] = args.window_tensors
    try:
        for cs in args.checksums:
            sync = WeightSync(transport="cuda_ipc",
                              bucket_bytes=args.bucket_mib << 20 if args.bucket_mib else None,
                              timeout_s=600, device=device,
                              checksum=None if cs == "none" else cs,
                              transport_options=transport_options)
            sync.add_replica(replica)
            replica.zero()  # this mode's pushes must write every byte
            reports: list[dict[str, Any]] = []

            def once(sync: Any = sync, reports: list[dict[str, Any]] = reports) -> None:
                nonlocal version
                version += 1
                t0 = time.perf_counter()
                r = push(model, version, sync=sync)
                reports.append({"phases": dict(r.phases), "bytes": r.bytes,
                                "seconds": time.perf_counter() - t0, **push_facts(r)})

            item = med(once)
            prof = os.environ.get("ENGINEHOOKS_BENCH_PROFILE")
            if prof:  # one more push under cProfile: where the trainer side's time goes
                import cProfile
                import io
                import pstats

                pr = cProfile.Profile()
                replica._call({"op": "profile", "on": True}, 60)
                pr.enable()
                once()
                pr.disable()
                text = replica._call({"op": "profile", "on": False}, 60)["text"]
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("cumtime").print_stats(45)
                with open(f"{prof}.trainer-{cs}.txt", "w") as f:
                    f.write(buf.getvalue())
                with open(f"{prof}.replica-{cs}.txt", "w") as f:
                    f.write(text)
            ok = replica.digest() == mine
            steady = reports[args.warmup:] or reports
            item.update(checksum=cs, bit_exact=ok,
                        transfer_seconds_median=statistics.median(
                            r["phases"].get("transfer", float("nan")) for r in reports),
                        phases_last=reports[-1]["phases"],
                        # both sides, milliseconds: the trainer's push phases (median over
                        # the timed pushes), the sender's and the replica's transport phases
                        # (last push); calls per replica per push, and the path each took
                        phases_ms=phases_ms(steady),
                        rpcs_per_push=[r["rpcs"] for r in reports],
                        rpcs_steady=max(r["rpcs"] for r in steady),
                        layouts=[r["layout"] for r in reports])
            res["items"][f"push[checksum={cs}]"] = item
            sync.close()
            print(f"push checksum={cs}: {item['seconds_median'] * 1e3:.1f} ms (transfer "
                  f"{item['transfer_seconds_median'] * 1e3:.1f} ms), bit-exact {ok}", flush=True)
    finally:
        replica.stop()
        dist.destroy_process_group()
    raw = res["items"]["raw_device_copy"]["seconds_median"]
    raw_fe = res["items"]["raw_foreach_copy"]["seconds_median"]
    res["summary"] = {}
    for k, v in res["items"].items():
        if k.startswith("push["):
            for base, t in (("raw_device_copy", raw), ("raw_foreach_copy", raw_fe)):
                res["summary"][f"{k} transfer / {base}"] = t / v["transfer_seconds_median"]
                res["summary"][f"{k} whole push / {base}"] = t / v["seconds_median"]
    res["machine"] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "cuda": torch.version.cuda, "pid": os.getpid()}
    print(f"\nmodel: {len(res['config'])} cfg, {res['tensors']} tensors, {nbytes / GB:.2f} GB")
    print("| item | median ms |\n| --- | ---: |")
    for k, v in res["items"].items():
        print(f"| {k} | {v['seconds_median'] * 1e3:.2f} |")
    for k, v in res["items"].items():
        if "phases_ms" in v:
            print(f"\n{k}: rpcs per replica per push {v['rpcs_per_push']} ({v['layouts'][-1]}); "
                  f"phases_ms {json.dumps(v['phases_ms'])}")
    print("\n| ratio | value |\n| --- | ---: |")
    for k, v in res["summary"].items():
        print(f"| {k} | {v:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return 0 if all(v.get("bit_exact", True) for v in res["items"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

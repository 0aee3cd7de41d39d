"""Child process of `test_rl_flows_tp2.py`: vLLM's in-process RL flow (`rlhf_nccl.py`:
an `LLM`, the trainer side of vLLM's weight-transfer API with backend "enginehooks",
`LLM.collective_rpc` as the client) with an fp32 trainer into a bf16 `LLM` with two
tensor-parallel workers. Its own process, because an `LLM` with workers leaves
distributed state behind that would break the other engines of the test session.

Reads one JSON request on stdin ({"model_dir", "seed", "out"}), saves the pushed fp32
weights to `out`, and prints one JSON line: generations before and after the push, the
push report and every worker's info.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    req = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from enginehooks.vllm_ext import VLLMEngine
    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo
    from enginehooks_testkit.engines import VLLMInProcess
    from enginehooks_testkit.tiny import load_tiny, perturb

    tp = int(req.get("tp", 2))
    model = perturb(load_tiny(req["model_dir"]), seed=int(req["seed"]))
    with VLLMInProcess(req["model_dir"], dtype="bfloat16", engine_args={
            "tensor_parallel_size": tp,
            "weight_transfer_config": {"backend": "enginehooks"}}) as llm:
        before = llm.generate()
        engine = WeightTransferTrainerFactory.trainer_init(
            EnginehooksTrainerInitInfo(rank=0, world_size=1 + tp, timeout_s=120,
                                       bucket_bytes=32 << 10),
            client=VLLMEngine(llm.llm), source=ModuleSource(model))
        try:
            report = engine.send_weights(weight_version="llm-tp2")
        finally:
            engine.shutdown()
        after = llm.generate()
        infos = llm.handle().info(60)
    model.save_pretrained(req["out"])

    def gens(gs: list) -> list:
        return [{"tokens": list(g.tokens), "logprobs": list(g.logprobs)} for g in gs]

    print(json.dumps({"ok": bool(report.ok), "buckets": report.buckets, "before": gens(before),
                      "after": gens(after), "infos": infos}, default=str), flush=True)
    os._exit(0)  # engines may leave non-daemon threads behind


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Issue 37 items 3, 4, 6 on a GPU machine: the GPU tests of the changed paths, then the
# measurements (fused landing, transports at the default bucket and others, 7B and MoE
# shapes). Usage: benchmarks/run_issue37_gpu.sh OUTDIR [tests|bench|fused|moe|all|final]
# (needs pytest and pytest-timeout where it runs; PYTHONPATH=the checkout)
set -o pipefail
OUT=${1:?outdir}; WHAT=${2:-all}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  timeout 100 python3 -m pytest -p no:cacheprovider -q -m gpu --timeout 90 --durations=10 \
    tests/gpu/test_broadcast_device_checks.py tests/gpu/test_cuda_ipc_doorbell.py \
    tests/gpu/test_gpu_integrity.py tests/gpu/test_fused_copy.py tests/gpu/test_fused_unpack.py \
    tests/gpu/test_gpu_transports.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ] || [ "$WHAT" = fused ]; then
  timeout 25 python3 benchmarks/bench_fused_landing.py --out "$OUT/fused-landing.json" 2>&1 | tail -12
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  timeout 65 python3 benchmarks/bench_transports.py --parts nccl cuda_ipc --bucket-mib 1024 256 \
    --reps 5 --warmup 2 --no-per-tensor --out "$OUT/transports-7b.json" 2>&1 \
    | tee "$OUT/transports-7b.log" | grep -v "^  " | tail -40
fi
if [ "$WHAT" = moe ] || [ "$WHAT" = all ]; then
  timeout 55 python3 benchmarks/bench_transports.py --model qwen3-30b-a3b --parts nccl cuda_ipc \
    --bucket-mib 1024 --reps 5 --warmup 2 --no-per-tensor --out "$OUT/transports-moe.json" 2>&1 \
    | tee "$OUT/transports-moe.log" | grep -v "^  " | tail -40
fi
if [ "$WHAT" = final ]; then  # run 2 of 2026-11-27 (2x H200): the changed paths' tests, then 1 GiB
  timeout 45 python3 -m pytest -p no:cacheprovider -q -m gpu --timeout 40 \
    tests/gpu/test_broadcast_device_checks.py tests/gpu/test_cuda_ipc_doorbell.py \
    tests/gpu/test_fused_unpack.py tests/gpu/test_fused_copy.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
  timeout 40 python3 benchmarks/bench_transports.py --parts nccl cuda_ipc --bucket-mib 1024 \
    --reps 5 --warmup 2 --no-per-tensor --out "$OUT/transports-7b.json" 2>&1 | tee "$OUT/transports-7b.log" | tail -30
  timeout 40 python3 benchmarks/bench_transports.py --model qwen3-30b-a3b --parts nccl cuda_ipc \
    --bucket-mib 1024 --reps 3 --warmup 1 --no-per-tensor --out "$OUT/transports-moe.json" 2>&1 | tee "$OUT/transports-moe.log" | tail -30
fi

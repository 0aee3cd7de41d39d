#!/usr/bin/env bash
# The final code on a GPU machine, in one call: the GPU tests, then the benchmarks of
# issues 37 and 38 whose JSON is committed (transports at 1 GiB, the colocated
# FSDP2 -> replica push with dense and MoE shapes, 2 FSDP2 ranks -> 2 replicas over NCCL
# where 4 GPUs are present, verification always vs never on a module replica over
# cuda_ipc and nccl).
# Usage (repo root, PYTHONPATH=$PWD): bash benchmarks/device_final.sh OUTDIR
# PARTS (default all): which of tests transports e2e moe multisender verify to run, for a
# call that has less device time than the whole (about 10 minutes on 4 GPUs).
set -o pipefail
OUT=${1:?outdir}
PARTS=${PARTS:-"tests transports e2e moe multisender verify"}
want() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
want tests && timeout 330 python3 -m pytest -p no:cacheprovider -q --timeout 150 -rs tests/gpu \
  2>&1 | tee "$OUT/gpu-tests.log" | tail -25
want transports && timeout 45 python3 benchmarks/bench_transports.py --parts nccl cuda_ipc --bucket-mib 1024 \
  --reps 5 --warmup 2 --no-per-tensor --out "$OUT/transports-7b.json" > "$OUT/transports-7b.log" 2>&1
want transports && tail -12 "$OUT/transports-7b.log"
if want e2e; then
  timeout 70 python3 benchmarks/bench_e2e.py --reps 5 --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
  tail -8 "$OUT/e2e.log"
fi
if want moe; then
  timeout 120 python3 benchmarks/bench_e2e.py --arch qwen3_moe --layers 5 --reps 5 \
    --checksums sum64 --out "$OUT/e2e-moe.json" > "$OUT/e2e-moe.log" 2>&1
  tail -8 "$OUT/e2e-moe.log"
fi
if [ "$ngpu" -ge 4 ] && want multisender; then
  timeout 200 python3 benchmarks/bench_multisender_gpu.py --bucket-mib 1024 --reps 3 \
    --deadline-s 190 --out "$OUT/multisender" > "$OUT/multisender.stdout" 2>&1
  tail -25 "$OUT/multisender.stdout"
fi
# verification always vs never: colocated (cuda_ipc), and over nccl where 2 GPUs are present
want verify && for t in cuda_ipc nccl; do
  sd=cuda:0; [ "$t" = nccl ] && sd=cuda:1
  if [ "$t" = nccl ] && [ "$ngpu" -lt 2 ]; then continue; fi
  timeout 120 python3 benchmarks/bench_verify.py --engine module --device cuda:0 --gb 1 \
    --rounds 6 --transport "$t" --sender-device "$sd" --out "$OUT/bench_verify-gpu.json" \
    > "$OUT/bench_verify-gpu-$t.log" 2>&1
  tail -1 "$OUT/bench_verify-gpu-$t.log" | cut -c1-300
done

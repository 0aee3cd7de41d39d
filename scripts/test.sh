#!/usr/bin/env bash
# The whole test suite: what `make test` and CI run. Each engine pins its own torch, so
# each has its own environment; tests run in the environment of the engine they start.
# pytest's exit code 5 ("no tests ran") counts as a failure. Each run lists its 25 slowest
# tests: CI must stay under 60 minutes, and that list says where its time goes.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
status=0

run_pytest() {  # env, pytest args...
  local env="$1"; shift
  local py; py="$(env_python "$env")"
  # What scripts/run.sh does, less its setup (done once below: a setup run by each half
  # at the same time would install the project into two environments at once, both
  # writing its egg-info in this tree).
  if [ -x "$py" ] && [ -f "$(dirname "$py")/activate" ]; then
    PATH="$(dirname "$py"):$PATH" HF_HUB_OFFLINE=1 python -m pytest -p no:cacheprovider "$@"
  else
    bash scripts/run.sh "$env" python -m pytest -p no:cacheprovider "$@"
  fi
  local rc=$?
  if [ "$rc" -eq 5 ]; then echo "[test] pytest in $env ran no tests: failing" >&2; rc=1; fi
  return "$rc"
}

# The interpreter of an environment set up below (empty before its setup; not in a
# virtual environment if the setup failed).
env_python() {
  case "$1" in
    vllm) echo "${ENGINEHOOKS_VLLM_PYTHON:-}" ;;
    sglang) echo "${ENGINEHOOKS_SGLANG_PYTHON:-}" ;;
  esac
}

bash scripts/run.sh vllm ruff check enginehooks enginehooks_testkit tests benchmarks || status=1
# The library's types ([tool.mypy] in pyproject.toml), in the environment CI tests in.
bash scripts/run.sh vllm mypy || status=1
# Both environments exist before any test runs: the Ray test in the vLLM environment
# starts an SGLang actor with the SGLang one, and the mixed SGLang test a vLLM server.
ENGINEHOOKS_SGLANG_PYTHON="$(bash scripts/setup-sglang-env.sh)/bin/python" || status=1
ENGINEHOOKS_VLLM_PYTHON="$(bash scripts/setup-vllm-env.sh)/bin/python" || status=1
# The Megatron trainer ranks (megatron-core on CPU) run in their own environment; the
# tests in tests/megatron start them from the vLLM one.
ENGINEHOOKS_MEGATRON_PYTHON="$(bash scripts/setup-megatron-env.sh)/bin/python" || status=1
export ENGINEHOOKS_SGLANG_PYTHON ENGINEHOOKS_VLLM_PYTHON ENGINEHOOKS_MEGATRON_PYTHON
# Tests are organised by what they need to run (docs/testing.md): tests/library needs the
# library alone, tests/engines runs in each engine's environment (parametrised over the
# engines), tests/vllm, tests/sglang and tests/megatron need that engine or trainer,
# tests/gpu CUDA GPUs (skips without), tests/multihost root and network namespaces (skips
# with the reason without).
# The two environments' halves run side by side (ENGINEHOOKS_TEST_SERIAL=1: one after the
# other). Most of their time is one process at a time waiting for, or importing into, an
# engine that is starting (a vLLM server's start used 0.7 of one core here), so on a
# 2-core machine each half runs at most of its own speed beside the other; the measured
# saving and the conditions are in docs/testing.md. Ports are the kernel's picks
# (`free_port`), temporary folders pytest's own per session, so the halves share
# nothing. The SGLang half writes to a log file, printed whole when both are done.
# The vLLM environment: the library, both contracts and the conformance slice on vLLM and
# the module replica, the vLLM suites, GPU tests (skip here), the tests across hosts, and
# the Megatron ranks pushing into vLLM and SGLang servers.
vllm_half() {
  run_pytest vllm tests/library tests/engines tests/vllm tests/gpu \
    tests/multihost tests/megatron -q -rs --durations=25
}
# The SGLang environment: both contracts and the conformance slice on SGLang, and the
# SGLang suites (attacks on SGLang servers included).
sglang_half() {
  run_pytest sglang tests/engines tests/sglang -k "sglang or not contract" -q -rs --durations=25
}
if [ "${ENGINEHOOKS_TEST_SERIAL:-0}" = "1" ]; then
  vllm_half || status=1
  sglang_half || status=1
else
  sglang_log="$(mktemp "${TMPDIR:-/tmp}/enginehooks-sglang-half.XXXXXX")"
  start=$SECONDS
  sglang_half >"$sglang_log" 2>&1 &
  sglang_pid=$!
  echo "[test] the SGLang half runs beside this one (pid $sglang_pid, log $sglang_log)"
  vllm_half || status=1
  echo "[test] vLLM half done after $((SECONDS - start)) s; waiting for the SGLang half"
  wait "$sglang_pid" || status=1
  echo "[test] SGLang half done after $((SECONDS - start)) s; its output:"
  cat "$sglang_log"
  rm -f "$sglang_log"
fi
exit "$status"

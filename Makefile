# Two commands for a fresh machine:
#   make demo   sets up the vLLM environment and runs the end-to-end demo
#   make test   sets up every environment and runs the whole test suite
# Engine environments are cached in $(ENGINEHOOKS_CACHE) (default ~/.cache/enginehooks)
# and rebuilt from nothing when their setup script changes.

.PHONY: demo test conformance lint bench-cpu

demo:
	@bash scripts/run.sh vllm python -m enginehooks.cli demo

test:
	@bash scripts/test.sh

# Every model family x engine x trainer x dtype; regenerates docs/models.md (~1 hour).
conformance:
	@bash scripts/conformance.sh

lint:
	@bash scripts/run.sh vllm ruff check enginehooks tests benchmarks

bench-cpu:
	@bash scripts/run.sh vllm python benchmarks/bench_gloo_cpu.py

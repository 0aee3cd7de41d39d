"""MTP heads pushed with the model (issue 39 item 5), on a real vLLM CPU server running
speculative decoding with the checkpoint's own multi-token-prediction layers
(`--speculative-config '{"method": "mtp"}'`).

vLLM builds the MTP drafter as a second model from the same checkpoint: the main model's
loader skips `model.mtp_layers.*` and the drafter's takes them. Before companions
(`engine/companions.py`) a push updated the main model only and the engine reported the
new version with the old MTP head; a push that left the head out was taken too.

The model is a tiny MiMo (`enginehooks_testkit.mtp`: a Qwen2 with one MTP layer). Its
random head drafts nothing acceptable. The push carries a perturbed model whose head
drafts what the model just predicted (`copying_head`), accepted wherever the model repeats
a token. The exact oracle: greedy speculative decoding is lossless, so the target's tokens
and logprobs equal those of a server freshly started from `save_pretrained` of the pushed
model, and the drafter shows in the drafted/accepted counts, which equal that server's
too. A push without the MTP tensors is refused before any byte moves, naming them. The
same push into a server started with backend "enginehooks" as well meets the same oracle,
and so does a push by vLLM's own weight-transfer client into such a server.

Four servers of about a minute each on 2 cores: outside CI, run with
ENGINEHOOKS_MTP_CELLS=1 (`scripts/run.sh vllm python -m pytest tests/vllm/test_mtp_heads.py`);
its log is in benchmarks/results/mtp/.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginehooks import WeightSync
from enginehooks.core.errors import ManifestError
from enginehooks_testkit.engines import NEW_TOKENS, PROMPTS, Generation, save_pushed
from enginehooks_testkit.mtp import (
    MTP_PREFIX,
    copying_head,
    load_tiny_mimo,
    make_tiny_mimo,
    mimo_config,
)
from enginehooks_testkit.tiny import perturb
from tests.support import requires_vllm
from tests.vllm.conftest import VLLMServerProcess
from tests.vllm.test_draft_model import counters

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("ENGINEHOOKS_MTP_CELLS") != "1",
                                 reason="starts four vLLM servers: ENGINEHOOKS_MTP_CELLS=1")]

MTP = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]


def run(server: VLLMServerProcess) -> tuple[list[Generation], tuple[float, float]]:
    """Greedy answers (tokens, logprobs) of the test prompts and the drafted/accepted
    tokens they took."""
    drafted, accepted = counters(server)
    answers = server.generations(PROMPTS, NEW_TOKENS)
    drafted2, accepted2 = counters(server)
    return answers, (drafted2 - drafted, accepted2 - accepted)


def oracle(answers: list[Generation]) -> list[tuple[Any, Any]]:
    return [(a.tokens, a.logprobs) for a in answers]


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mimo(tmp_path_factory.mktemp("mimo") / "d0", seed=0)


@pytest.fixture(scope="module")
def mtp_server(mimo: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[VLLMServerProcess]:
    # Pushed through the worker extension (WeightSync): the worker reaches its drafter.
    log = tmp_path_factory.mktemp("logs") / "vllm-mtp.log"
    with VLLMServerProcess(mimo, log, extra_args=MTP) as srv:
        yield srv


def push(server: VLLMServerProcess, model: Any, version: str) -> Any:
    from enginehooks.vllm_ext import VLLMServer

    with WeightSync("gloo", bucket_bytes=64 << 10, timeout_s=120, verify=True) as sync:
        sync.add_replica(VLLMServer(server.url, name="mtp"))
        return sync.push(model, version=version)


def test_a_push_without_the_mtp_head_is_refused(mtp_server: VLLMServerProcess,
                                               mimo: Path) -> None:
    before, counts = run(mtp_server)
    assert counts[0] > 0 and counts[1] == 0, "the random head drafts nothing acceptable"
    model = perturb(load_tiny_mimo(mimo), seed=5)
    without = {n: t for n, t in model.state_dict().items() if not n.startswith(MTP_PREFIX)}
    with pytest.raises(ManifestError, match=r"the MTP drafter: 16 tensors .* missing") as e:
        push(mtp_server, without, "no-head")
    assert "model.mtp_layers.0." in str(e.value)
    again, counts_again = run(mtp_server)
    assert oracle(again) == oracle(before) and counts_again == counts, "nothing moved"


#: the fresh server's answers and counts for each pushed model (one fresh start each)
FRESH: dict[int, tuple[list[tuple[Any, Any]], tuple[float, float]]] = {}


def pushed_model(mimo: Path, seed: int) -> Any:
    """A 'trained' model: every weight moved, and a head that drafts the model's repeats."""
    return copying_head(perturb(load_tiny_mimo(mimo), seed=seed))


def fresh_start(model: Any, seed: int, mimo: Path, tmp_path: Path
                ) -> tuple[list[tuple[Any, Any]], tuple[float, float]]:
    """The oracle: a server with the same flags started from `save_pretrained` of the
    pushed model (started once per model; call it with no other server running)."""
    if seed not in FRESH:
        folder = tmp_path / "pushed"
        save_pushed(model, mimo, folder)
        mimo_config(folder)
        with VLLMServerProcess(folder, tmp_path / "vllm-mtp-fresh.log", extra_args=MTP) as fresh:
            answers, counts = run(fresh)
        FRESH[seed] = (oracle(answers), counts)
    return FRESH[seed]


def test_a_pushed_mtp_head_drafts_as_a_fresh_start_with_it(
        mtp_server: VLLMServerProcess, mimo: Path, tmp_path: Path) -> None:
    from enginehooks.vllm_ext import VLLMServer

    # two pushes: the second goes through the copy plans the first recorded (the
    # drafter's too), verified against fresh loads as the first through a plan always is
    assert push(mtp_server, pushed_model(mimo, seed=6), "mtp-0").ok
    model = pushed_model(mimo, seed=7)
    report = push(mtp_server, model, "mtp-1")
    assert report.ok
    info = VLLMServer(mtp_server.url).info(30)[0]
    pushed, pushed_counts = run(mtp_server)
    assert pushed_counts[1] > 0, "the pushed head drafts the model's repeats"
    mtp_server.stop()  # one server at a time: the oracle's next

    fresh_answers, fresh_counts = fresh_start(model, 7, mimo, tmp_path)
    assert oracle(pushed) == fresh_answers
    assert pushed_counts == fresh_counts
    drafter = info["companions"]["the MTP drafter"]
    assert drafter["tensors_last"] == 18  # 16 MTP tensors, the embedding and the head
    assert drafter["verification"]["last"]["ok"] is True, drafter
    assert drafter["verification"]["verified"] == 2, drafter


def test_with_the_transfer_backend_too_the_head_is_pushed(mimo: Path, tmp_path: Path) -> None:
    """A server started with backend "enginehooks" as well: the backend's receiving state
    is handed the model only, so the worker's own (drafter included) takes its place
    while it is unused, for both ways of pushing."""
    model = pushed_model(mimo, seed=7)
    fresh_answers, fresh_counts = fresh_start(model, 7, mimo, tmp_path)
    backend = ["--weight-transfer-config", '{"backend": "enginehooks"}']
    with VLLMServerProcess(mimo, tmp_path / "vllm-mtp-backend.log",
                           extra_args=backend + MTP) as srv:
        assert push(srv, model, "mtp-1").ok
        pushed, pushed_counts = run(srv)
    assert oracle(pushed) == fresh_answers
    assert pushed_counts == fresh_counts


def test_vllms_own_client_pushes_the_head_once_the_extension_has_answered(
        mimo: Path, tmp_path: Path) -> None:
    """vLLM's own weight-transfer client (a main session, backend "enginehooks") on such
    a server: once the worker extension has answered (`info`), the backend's state is
    the worker's and its main session updates the drafter too."""
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from enginehooks.control._http import request_json
    from enginehooks.vllm_ext import VLLMServer
    from enginehooks.vllm_ext.transfer_trainer import EnginehooksTrainerInitInfo

    model = pushed_model(mimo, seed=7)
    fresh_answers, fresh_counts = fresh_start(model, 7, mimo, tmp_path)
    backend = ["--weight-transfer-config", '{"backend": "enginehooks"}']
    with VLLMServerProcess(mimo, tmp_path / "vllm-mtp-client.log",
                           extra_args=backend + MTP) as srv:
        info = VLLMServer(srv.url).info(30)[0]
        assert info["companions"]["the MTP drafter"]["tensors_last"] is None
        trainer = WeightTransferTrainerFactory.trainer_init(
            EnginehooksTrainerInitInfo(rank=0, world_size=2, timeout_s=120),
            client=HTTPVLLMWeightSyncClient(srv.url, timeout=120), source=ModuleSource(model))
        request_json(f"{srv.url}/pause", {}, timeout_s=60)  # vLLM's RL pattern
        try:
            assert trainer.send_weights(weight_version="mtp-1").ok
        finally:
            trainer.shutdown()
            request_json(f"{srv.url}/resume", {}, timeout_s=60)
        pushed, pushed_counts = run(srv)
    assert oracle(pushed) == fresh_answers
    assert pushed_counts == fresh_counts

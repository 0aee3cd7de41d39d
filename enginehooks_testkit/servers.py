"""Real engine servers started as child processes, for the tests and benchmarks: the
demo's launchers (`enginehooks.demo.servers`) with the exact oracle's generations (greedy
tokens, the logprob of each, the weight version), and the trainer-side handle of each.

Each server runs in its own process group, so a test can SIGSTOP / SIGCONT all of it
and `stop()` leaves nothing behind; readiness is a bounded probe of `/health`.
"""

from __future__ import annotations

from typing import Any

from enginehooks.demo import servers as _demo
from enginehooks.demo.servers import EXTENSION, STUB_DIR, EngineServerProcess, cpu_env, free_port
from enginehooks.sglang_ext.versions import answer_version
from enginehooks_testkit.generation import NEW_TOKENS, PROMPTS, Generation

__all__ = ["EXTENSION", "HANDLES", "SERVERS", "STUB_DIR", "EngineServerProcess",
           "SGLangServerProcess", "VLLMServerProcess", "cpu_env", "free_port"]


class VLLMServerProcess(_demo.VLLMServerProcess):
    """The demo's vLLM server (dev mode, the worker extension), with the oracle's view."""

    def generations(self, prompts: list[list[int]] | None = None,
                    max_tokens: int | None = None, *, cold: bool = True) -> list[Generation]:
        """Greedy tokens of each prompt (one request each) and their logprobs, from a cold
        prefix cache (cached prefixes change the last bits of logprobs) unless `cold` is
        false (traffic beside a push, which flushes the cache itself)."""
        return [Generation(tuple(choice["token_ids"]),
                           tuple(float(x) for x in choice["logprobs"]["token_logprobs"]),
                           headers.get("x-enginehooks-weight-version"))
                for choice, headers in self.completions(prompts or PROMPTS,
                                                        max_tokens or NEW_TOKENS, cold=cold)]


class SGLangServerProcess(_demo.SGLangServerProcess):
    """The demo's SGLang server (CPU), with the oracle's view."""

    def generations(self, prompts: list[list[int]] | None = None,
                    max_tokens: int | None = None, *, cold: bool = True) -> list[Generation]:
        """Greedy tokens of each prompt, their logprobs and the weight version, from a
        cold prefix cache (cached prefixes change the last bits of logprobs) unless
        `cold` is false."""
        if cold:
            self.flush_cache()
        out = []
        for r in self.generate(prompts or PROMPTS, max_tokens or NEW_TOKENS, logprobs=True):
            lps = r["meta_info"]["output_token_logprobs"]
            out.append(Generation(tuple(r["output_ids"]), tuple(float(x[0]) for x in lps),
                                  answer_version(r["meta_info"])))
        return out


#: engine -> its server launcher, and the trainer-side handle to such a server
SERVERS: dict[str, type[VLLMServerProcess] | type[SGLangServerProcess]] = {
    "vllm": VLLMServerProcess, "sglang": SGLangServerProcess,
}


def _handles() -> dict[str, Any]:
    from enginehooks.sglang_ext import SGLangServer
    from enginehooks.vllm_ext import VLLMServer

    return {"vllm": VLLMServer, "sglang": SGLangServer}


HANDLES = _handles()

"""Real engine servers started as child processes: what `enginehooks demo` runs its push
against (shipped in the wheel for it), and what the tests' launchers build on
(`enginehooks_testkit.servers` adds the exact oracle's generations). Production users
start their engines their own way.

Each server runs in its own process group, so a test can SIGSTOP / SIGCONT all of it
and `stop()` leaves nothing behind; readiness is a bounded probe of `/health`. Servers
bind to loopback: vLLM's dev-mode routes and the SGLang plugin's `/enginehooks/rpc`
route are open unless the server runs with an API key.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from enginehooks.control._http import request_json
from enginehooks.control.identity import ServerIdentity
from enginehooks.core.auth import load_secret
from enginehooks.core.errors import PushTimeout, ReplicaError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's pick), for a server about to start."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineServerProcess:
    """`argv` started with `env`, logging to `log`, answering on `url`."""

    kind = "server"

    def __init__(self, argv: list[str], env: dict[str, str], log: str | Path, url: str) -> None:
        self.url = url
        self.log: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text(errors="replace")[-3000:]
                raise ReplicaError(self.kind, f"exited with {self.proc.returncode}; see "
                                   f"{self.log.name}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            # Readiness probe of a process we started, bounded above; every 0.25 s (a
            # refused connection costs nothing): the tests start dozens of servers, and
            # a 1 s probe noticed each 0.5 s late on average.
            time.sleep(0.25)
        raise PushTimeout(f"{self.kind} not ready in {timeout_s}s; see {self.log.name}")

    def __enter__(self) -> EngineServerProcess:
        """`with Server(...) as srv:` waits until it is ready and always stops it."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        self.log.close()


# -- vLLM ----------------------------------------------------------------------
EXTENSION = "enginehooks.vllm_ext.WorkerExtension"


class VLLMServerProcess(EngineServerProcess):
    """`python -m vllm.entrypoints.launchers.api_server.entry` with the extension, in
    dev mode. `python` may be another environment's interpreter (vLLM pins its torch)."""

    kind = "vLLM server"

    def __init__(self, model: str | Path, log: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, dtype: str = "float32", max_model_len: int = 256,
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.model = str(model)
        self.port = port or free_port(host)
        env = dict(os.environ if env is None else env)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        # vLLM loads endpoint plugins (our fail-closed middleware) only when named.
        env.setdefault("VLLM_PLUGINS", "enginehooks")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # With a secret the server guards its control routes (/reset_prefix_cache below).
        self.secret = load_secret(env)
        super().__init__(
            [python, "-m", "vllm.entrypoints.launchers.api_server.entry",
             "--model", self.model, "--host", host, "--port", str(self.port),
             "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
             "--worker-extension-cls", EXTENSION, *(extra_args or [])],
            env, log, f"http://{host}:{self.port}",
        )

    def completions(self, prompts: list[list[int]], max_tokens: int, *, cold: bool = True
                    ) -> list[tuple[dict[str, Any], dict[str, str]]]:
        """Each prompt's greedy completion (one request each: vLLM's choice, with token ids
        and the logprob of every chosen token) and its response headers, from a cold
        prefix cache (cached prefixes change the last bits of logprobs) unless `cold` is
        false (traffic beside a push, which flushes the cache itself)."""
        if cold:
            ServerIdentity(self.url, self.url).post(
                "/reset_prefix_cache", {}, secret=self.secret, headers={}, timeout_s=60)
        out = []
        for p in prompts:
            body = {"model": self.model, "prompt": p, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": 0}
            headers: dict[str, str] = {}
            r = request_json(f"{self.url}/v1/completions", body, timeout_s=60, who=self.url,
                             response_headers=headers)
            out.append((r["choices"][0], headers))
        return out

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy tokens of each prompt, from a cold prefix cache."""
        return [list(choice["token_ids"]) for choice, _ in self.completions(prompts, max_tokens)]


# -- SGLang --------------------------------------------------------------------
#: The test-only `sgl_kernel` stand-in (no CPU build of SGLang's kernel package exists;
#: SGLang's CPU engine imports it but, on the paths used here, never calls it: the
#: stand-in raises if it ever does). Shipped with the demo, never put on a path unless
#: the real kernels cannot be imported.
STUB_DIR = Path(__file__).resolve().parent / "sgl_kernel_stub"


def cpu_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for SGLang on a machine without a GPU: the CPU engine, and the
    `sgl_kernel` stand-in on PYTHONPATH when the real kernels cannot be imported."""
    env = dict(os.environ if env is None else env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    if STUB_DIR.is_dir() and not _kernels_importable():
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(STUB_DIR) not in parts:
            env["PYTHONPATH"] = os.pathsep.join([str(STUB_DIR), *parts])
    return env


def _kernels_importable() -> bool:
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        import sgl_kernel  # noqa: F401
    except Exception:  # a CUDA build fails in many ways without a GPU
        return False
    return True


class SGLangServerProcess(EngineServerProcess):
    """`python -m sglang.launch_server` on CPU, in its own process group."""

    kind = "SGLang server"

    def __init__(self, model: str | Path, log: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, dtype: str = "float32",
                 python: str = sys.executable, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.model = str(model)
        self.port = port or free_port(host)
        super().__init__(
            [python, "-m", "sglang.launch_server", "--model-path", self.model,
             "--host", host, "--port", str(self.port), "--device", "cpu", "--dtype", dtype,
             "--attention-backend", "torch_native", "--mem-fraction-static", "0.2",
             "--max-total-tokens", "4096", "--log-level", "warning", "--random-seed", "0",
             "--sleep-on-idle",  # no busy loop while idle (enginehooks_testkit/engines.py says why)
             *(extra_args or [])],
            cpu_env(env), log, f"http://{host}:{self.port}",
        )

    def flush_cache(self) -> None:
        """Empty the prefix cache (cached prefixes change the last bits of logprobs)."""
        request_json(f"{self.url}/flush_cache", {}, timeout_s=60, who=self.url)

    def generate(self, prompts: list[list[int]], max_tokens: int, *,
                 logprobs: bool = False) -> list[dict[str, Any]]:
        """SGLang's answer to a greedy `/generate` of each prompt (one request each), with
        the logprob of every chosen token in its `meta_info` when `logprobs`."""
        sp = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        extra = {"return_logprob": True} if logprobs else {}
        return [request_json(f"{self.url}/generate",
                             {"input_ids": p, "sampling_params": sp, **extra},
                             timeout_s=60, who=self.url) for p in prompts]

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy tokens of each prompt."""
        return [list(o["output_ids"]) for o in self.generate(prompts, max_tokens)]

"""Real engine servers on other hosts: the replica and server contracts, a mixed vLLM +
SGLang push across three hosts, and network faults in the middle of a push.

Three hosts (network namespaces, `enginehooks_testkit.netns`): "trainer" 10.78.0.1,
"vllm" 10.78.0.2, "sglang" 10.78.0.3. This test process *is* the trainer host: its main
thread runs in the trainer's namespace for the whole module (`Host.entered`), so every
push, HTTP call and process it starts goes over the switch. Each engine server runs in
its own host, started once per module with the launch line of docs/transports.md
(vLLM: the README's CPU line on its own address; SGLang: its CPU line), with a shared
secret in its environment (as the server contract runs them).

The contracts' scenarios run unchanged (their functions are called from here) with two
things that being across hosts needs: `WeightSync(host=<the trainer's address>)` (a
loopback store cannot be reached from another host) and, for the replica contract, the
replica is the server across the switch, generating over HTTP, and trainers sign with
the servers' secret. The exact oracle is the contract's: after a push, the server's
greedy tokens and logprobs equal those of the same engine freshly loaded from
`save_pretrained` of the pushed weights (an engine started in a child process with the
engine's own environment), and its greedy tokens equal HF's.

Faults, made in the switch while the engine receives over a link shaped so that the
push takes seconds: (a) the link drops every packet, (b) latency jumps to seconds,
(c) the engine's host disappears; and a partition while the engines `check` the
manifest and while they `finish` (flush). Each ends the push on the trainer within
`timeout_s` plus the coordinator's grace, with an error naming the replica. The engine
ends its update within `timeout_s` of the last byte it received (its receive waits that
long per bucket), `torn`, never `current` on the failed version; a partition during
`check` leaves it on its previous version; one during `finish` comes after the engine
applied the whole update (`finish` only flushes the prefix cache): it is `current` on
that version and serves exactly it (SGLang's scheduler flushes while it applies, so its
handle sends nothing in `finish` and that push succeeds). After the link heals the next push succeeds and
meets the exact oracle.

CI runs the vLLM server's share; SGLang's (a second server start), the three-host
mixed push and a contract scenario that needs one more fresh load need
`ENGINEHOOKS_MULTIHOST_FULL=1` (their log is committed under
benchmarks/results/multihost/).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from enginehooks import EngineTorn, ReplicaError, WeightSync
from enginehooks.control._futures import spawn
from enginehooks.core.auth import SECRET_ENV
from enginehooks.engine.beacon import Beacon
from enginehooks_testkit.engines import EngineUnavailable, Generation, first_difference
from enginehooks_testkit.generation import NEW_TOKENS, PROMPTS
from enginehooks_testkit.netns import Host, Network
from enginehooks_testkit.servers import (
    HANDLES,
    EngineServerProcess,
    SGLangServerProcess,
    VLLMServerProcess,
    cpu_env,
)
from enginehooks_testkit.stalling_trainer import HOST_ENV
from enginehooks_testkit.tiny import hf_greedy, load_tiny, perturb
from tests.engines.contract import test_replica_contract as rc
from tests.engines.contract import test_server_contract as sc
from tests.multihost.test_vllm_across_hosts import docs_argv, sglang_docs_argv
from tests.support import have

HOSTS = ["trainer", "vllm", "sglang"]
ENGINES = HOSTS[1:]
SECRET = sc.SECRET
FULL_ENV = "ENGINEHOOKS_MULTIHOST_FULL"
full = pytest.mark.skipif(not os.environ.get(FULL_ENV),
                          reason=f"outside CI (set {FULL_ENV}=1): its log is committed under "
                                 "benchmarks/results/multihost/")
#: Every data-plane wait of a push under a fault (`WeightSync(timeout_s=...)`).
TIMEOUT_S = 10.0
#: The trainer may take `timeout_s` plus the coordinator's grace (5 s, for the replica
#: to report its own error) plus scheduling on a loaded 2-core machine.
TRAINER_MARGIN_S = 5.0 + 3.0
#: The engine ends its update within `timeout_s` (its receive waits that long per
#: bucket) plus scheduling.
ENGINE_MARGIN_S = 3.0
#: The engine host's link while a fault is injected: the tiny Llama (about 0.5 MB in
#: float32) then takes about 7 s to push.
SHAPED_KBIT = 600
BUCKET_BYTES = 32 << 10

pytestmark = [pytest.mark.slow]


def engine_python(engine: str) -> str | None:
    """The interpreter of `engine`'s environment (each engine pins its own torch)."""
    if have(engine):
        return sys.executable
    cache = Path(os.environ.get("ENGINEHOOKS_CACHE", Path.home() / ".cache" / "enginehooks"))
    python = os.environ.get(f"ENGINEHOOKS_{engine.upper()}_PYTHON",
                            str(cache / f"venv-{engine}" / "bin" / "python"))
    return python if Path(python).exists() else None


def on_host(host: Host, python: str, folder: Path) -> str:
    """An interpreter that runs on `host`: what a server launcher starts as `python`."""
    script = folder / f"python-on-{host.name}"
    script.write_text(f'#!/bin/sh\nexec ip netns exec {host.ns} {python} "$@"\n')
    script.chmod(0o755)
    return str(script)


#: The network of the module (set by the `hosts` fixture): where a fresh SGLang server runs.
NET: list[Network] = []
#: sha256 of a saved checkpoint -> its engine's fresh outputs (one fresh load per weights).
FRESH: dict[tuple[str, str], list[Generation]] = {}


def fresh_generate(engine: str, model_dir: str | Path, *, dtype: str = "float32",
                   prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = NEW_TOKENS,
                   timeout_s: float = 400.0) -> list[Generation]:
    """The exact oracle's reference: `engine` freshly loaded from `model_dir`. vLLM: the
    in-process engine in a child (`enginehooks_testkit.engines.fresh_generate`; its
    outputs equal the server's bit for bit, checked by the first vLLM test here). SGLang:
    a second SGLang server from the same docs line on the SGLang host (the in-process
    `sglang.Engine` differs from `launch_server` in the last bits of some logprobs,
    -3.3523244857788086 vs -3.3523240089416504 on the same weights), as
    tests/megatron does."""
    digest = hashlib.sha256(b"".join(
        f.read_bytes() for f in sorted(Path(model_dir).glob("*.safetensors")))).hexdigest()
    key = (engine, digest)
    if key in FRESH:
        return FRESH[key]
    python = engine_python(engine)
    assert python is not None, f"{engine}'s environment is missing"
    if engine == "sglang":
        host = NET[0].hosts["sglang"]
        folder = Path(model_dir).parent
        srv = DocsSGLangServer(Path(model_dir), folder / "fresh-sglang.log", host,
                               on_host(host, python, folder), port=30001)
        NET[0].processes.append(srv.proc)
        try:
            srv.wait_ready(timeout_s=timeout_s)
            FRESH[key] = srv.generations([list(p) for p in prompts], max_tokens)
        finally:
            srv.stop()
        return FRESH[key]
    request = json.dumps({"engine": engine, "model_dir": str(model_dir), "dtype": dtype,
                          "engine_args": {}, "prompts": [list(p) for p in prompts],
                          "max_tokens": max_tokens})
    out = subprocess.run([python, "-m", "enginehooks_testkit.engines"], input=request,
                         capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    reply = json.loads(lines[-1]) if lines else {"error": out.stderr[-3000:]}
    if "error" in reply:
        raise EngineUnavailable(reply["error"])
    FRESH[key] = [Generation(tuple(g["tokens"]), tuple(g["logprobs"]), g["version"])
                  for g in reply["generations"]]
    return FRESH[key]


# -- hosts and servers ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hosts(netns_ok: None) -> Iterator[Network]:
    """Three hosts; this process's main thread runs on "trainer" until the module ends,
    and the contracts' trainers connect to the trainer host's own address."""
    with Network(HOSTS) as net, net.hosts["trainer"].entered(), pytest.MonkeyPatch.context() as mp:
        here = net.hosts["trainer"].address
        NET[:] = [net]
        mp.setattr(sc, "WeightSync", functools.partial(WeightSync, host=here))
        mp.setattr(rc, "WeightSync", functools.partial(WeightSync, host=here, secret=SECRET))
        mp.setattr(rc, "fresh_generate", fresh_generate)
        mp.setenv(HOST_ENV, here)
        yield net


class DocsVLLMServer(VLLMServerProcess):
    """The vLLM server started with docs/transports.md's engine-host line, as written."""

    def __init__(self, model: Path, log: Path, host: Host, folder: Path) -> None:
        argv, line_env = docs_argv(model, host.address)
        self.model, self.port = str(model), int(argv[argv.index("--port") + 1])
        self.secret = SECRET
        argv[0] = on_host(host, argv[0], folder)
        EngineServerProcess.__init__(self, argv, {**line_env, SECRET_ENV: SECRET}, log,
                                     f"http://{host.address}:{self.port}")


class DocsSGLangServer(SGLangServerProcess):
    """The SGLang server started with docs/transports.md's engine-host line, as written
    (plus the `sgl_kernel` stand-in where the real kernels cannot be imported)."""

    def __init__(self, model: Path, log: Path, host: Host, python: str,
                 port: int | None = None) -> None:
        argv, env = sglang_docs_argv(model, host.address, python)
        if port is not None:  # a second server on the same host
            argv[argv.index("--port") + 1] = str(port)
        self.model, self.port = str(model), int(argv[argv.index("--port") + 1])
        EngineServerProcess.__init__(self, argv, cpu_env({**env, SECRET_ENV: SECRET}), log,
                                     f"http://{host.address}:{self.port}")


def start_server(engine: str, net: Network, model: Path, folder: Path) -> EngineServerProcess:
    python = engine_python(engine)
    if python is None:
        pytest.skip(f"{engine}'s environment is not built (scripts/setup-{engine}-env.sh)")
    host = net.hosts[engine]
    if engine == "vllm":
        srv: EngineServerProcess = DocsVLLMServer(model, folder / "vllm.log", host, folder)
    else:
        srv = DocsSGLangServer(model, folder / "sglang.log", host, on_host(host, python, folder))
    net.processes.append(srv.proc)  # the network kills it whatever happens
    try:
        srv.wait_ready(timeout_s=400.0)
    except BaseException:
        srv.stop()
        raise
    srv.engine = engine  # type: ignore[attr-defined]
    srv.host = host  # type: ignore[attr-defined]
    return srv


@pytest.fixture(scope="module")
def _server_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers-across-hosts")


@pytest.fixture(scope="module")
def servers(hosts: Network, _server_folder: Path) -> Iterator[dict[str, EngineServerProcess]]:
    """Each engine's server, started the first time a test asks for it (`get_server`),
    at most once per engine in the module, and stopped at its end."""
    started: dict[str, EngineServerProcess] = {}
    try:
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def get_server(engine: str, hosts: Network, servers: dict[str, EngineServerProcess],
               model_dirs: dict[str, Path], folder: Path) -> EngineServerProcess:
    if engine not in servers:
        servers[engine] = start_server(engine, hosts, model_dirs["llama"], folder)
    return servers[engine]


@pytest.fixture(scope="module", params=[
    "vllm", pytest.param("sglang", marks=full)])
def server(request: pytest.FixtureRequest, hosts: Network,
           servers: dict[str, EngineServerProcess], model_dirs: dict[str, Path],
           _server_folder: Path) -> EngineServerProcess:
    return get_server(request.param, hosts, servers, model_dirs, _server_folder)


def handle_of(server: Any, name: str | None = None) -> Any:
    """The server contract's handle (signing what the engine guards), named after the
    engine's host."""
    h = sc.handle(server)
    h.name = name or f"{server.engine}@{server.host.address}"
    return h


class ServerReplica(rc.RunningEngine):
    """The replica contract's engine: the server on its host, generating over HTTP."""

    def __init__(self, server: Any) -> None:
        self.server, self.engine = server, server.engine  # type: ignore[misc]

    def handle(self, name: str | None = None) -> Any:
        return handle_of(self.server, name)

    def generate(self, prompts: Sequence[Sequence[int]] = PROMPTS,
                 max_tokens: int = NEW_TOKENS) -> list[Generation]:
        try:
            return self.server.generations([list(p) for p in prompts], max_tokens)  # type: ignore[no-any-return]
        except ReplicaError as e:  # the server's fail-closed refusal: HTTP 503
            if "503" not in str(e):
                raise
            raise EngineTorn({"error": str(e)}) from e

    def close(self) -> None:
        """The module's fixture stops the server."""


@pytest.fixture
def replicas(server: Any) -> dict[str, ServerReplica]:
    return {"llama": ServerReplica(server)}


@pytest.fixture
def engine(server: Any) -> str:
    return str(server.engine)


# -- the replica contract across hosts --------------------------------------------------
def test_push_equals_fresh_load(engine: str, replicas: dict[str, ServerReplica],
                                model_dirs: dict[str, Path], tmp_path: Path) -> None:
    rc.test_push_equals_fresh_load(engine, replicas, model_dirs, "llama", tmp_path)


def test_pushes_in_a_row_reuse_the_group_then_disk(
        engine: str, replicas: dict[str, ServerReplica], model_dirs: dict[str, Path],
        tmp_path: Path) -> None:
    """Disk across hosts: a folder both hosts see (namespaces share the filesystem)."""
    rc.test_pushes_in_a_row_reuse_the_group_then_disk(engine, replicas, model_dirs, tmp_path)


@pytest.mark.parametrize("mutate", [rc._extra, rc._missing, rc._misshaped],
                         ids=["extra", "missing", "misshaped"])
def test_bad_update_is_refused_before_data_moves_and_changes_nothing(
        engine: str, replicas: dict[str, ServerReplica], model_dirs: dict[str, Path],
        mutate: Any) -> None:
    rc.test_bad_update_is_refused_before_data_moves_and_changes_nothing(
        engine, replicas, model_dirs, mutate)


@full
def test_failed_stream_tears_the_engine_and_the_next_push_repairs_it(
        engine: str, replicas: dict[str, ServerReplica], model_dirs: dict[str, Path],
        tmp_path: Path) -> None:
    if engine == "sglang":
        pytest.skip("one more fresh SGLang server for its oracle (minutes on the shared "
                    "machine); SGLang runs this scenario on one host in tests/engines/contract")
    rc.test_failed_stream_tears_the_engine_and_the_next_push_repairs_it(
        engine, replicas, model_dirs, tmp_path)


def test_push_with_generation_paused(engine: str, replicas: dict[str, ServerReplica],
                                     model_dirs: dict[str, Path]) -> None:
    rc.test_push_with_generation_paused(engine, replicas, model_dirs)


# -- the server contract across hosts ---------------------------------------------------
def test_a_killed_trainer_leaves_the_server_refusing_until_the_next_push(
        server: Any, model_dirs: dict[str, Path]) -> None:
    sc.test_a_killed_trainer_leaves_the_server_refusing_until_the_next_push(server, model_dirs)


def test_a_request_during_an_update_waits_and_gets_the_new_weights(
        server: Any, model_dirs: dict[str, Path]) -> None:
    sc.test_a_request_during_an_update_waits_and_gets_the_new_weights(server, model_dirs)


def test_serve_policy_marks_the_answers(server: Any, model_dirs: dict[str, Path]) -> None:
    sc.test_serve_policy_marks_the_answers(server, model_dirs)


@pytest.mark.parametrize("secret", [None, "not-the-secret"], ids=["unsigned", "wrong secret"])
def test_unsigned_or_wrongly_signed_updates_are_refused_and_change_nothing(
        server: Any, model_dirs: dict[str, Path], secret: str | None) -> None:
    sc.test_unsigned_or_wrongly_signed_updates_are_refused_and_change_nothing(
        server, model_dirs, secret)


# -- network faults mid-push against a real server ---------------------------------------
def beacon_states(beacons: list[str]) -> list[dict[str, Any]]:
    return [Beacon.read(b) or {} for b in beacons]


def wait_beacons(beacons: list[str], pred: Callable[[dict[str, Any]], bool], timeout_s: float,
                 what: str) -> list[dict[str, Any]]:
    """The workers' published states, once each satisfies `pred` (files on this machine:
    read without asking the engine, whose host may be cut off)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = beacon_states(beacons)
        if all(pred(s) for s in states):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine's workers never {what} within {timeout_s}s: {states}")
        time.sleep(0.05)  # polling files the workers write, bounded above


#: The weights every healed push sends (after its test's own pushes moved the engine):
#: one fresh load serves them all (`fresh_generate` keeps it).
HEALED_SEED = 112


def assert_exact(server: Any, seed: int, like: Path, tmp: Path, version: Any) -> None:
    """The exact oracle: the server equals the same engine freshly loaded from
    `save_pretrained` of the pushed weights (`perturb(llama, seed)`), and HF's greedy
    tokens."""
    model = perturb(load_tiny(like), seed=seed)
    got = server.generations()
    diff = first_difference(got, rc.fresh_outputs(server.engine, model, like, tmp))
    assert diff is None, f"{server.engine} after the push != freshly loaded: {diff}"
    assert [list(g.tokens) for g in got] == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert {g.version for g in got} == {str(version)}


FAULTS: dict[str, Callable[[Host], None]] = {
    "link-drops-every-packet": Host.blackhole,
    "latency-jumps-to-seconds": lambda h: h.latency(3.0),
    "engine-host-disappears": Host.down,
}


def named(err: BaseException | None, name: str) -> bool:
    return err is not None and (name in str(err) or getattr(err, "replica", None) == name)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_mid_push_ends_every_side_in_time_and_the_next_push_heals(
        fault: str, hosts: Network, server: Any, model_dirs: dict[str, Path],
        tmp_path: Path) -> None:
    host, like = server.host, model_dirs["llama"]
    h = handle_of(server)
    beacons = [i["beacon"] for i in h.info(30)]
    failed = f"{fault}-failed"
    with WeightSync("gloo", host=hosts.hosts["trainer"].address, secret=SECRET,
                    timeout_s=TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sync:
        sync.add_replica(h)
        sync.push(perturb(load_tiny(like), seed=110), version=f"{fault}-before")
        host.shape(SHAPED_KBIT)
        try:
            fut: Future[Any] = spawn(sync.push, perturb(load_tiny(like), seed=111), version=failed)
            wait_beacons(beacons, lambda s: s.get("updating_to") == failed, 60.0,
                         f"started receiving {failed}")
            time.sleep(1.0)  # some buckets are through, most are not (about 7 s here)
            assert all(s["state"] == "updating" for s in beacon_states(beacons)), \
                "the push ended before the fault"
            FAULTS[fault](host)
            t_fault, wall_fault = time.monotonic(), time.time()
            try:
                fut.result(timeout=TIMEOUT_S + TRAINER_MARGIN_S + 30.0)
                err: BaseException | None = None
            except Exception as e:
                err = e
            trainer_s = time.monotonic() - t_fault
            ended = wait_beacons(beacons, lambda s: s.get("state") != "updating",
                                 TIMEOUT_S + ENGINE_MARGIN_S + 30.0, "ended the update")
        finally:
            host.heal()
        engine_s = max(s["time"] for s in ended) - wall_fault
        print(f"{server.engine}, {fault}: trainer ended after {trainer_s:.1f}s "
              f"({type(err).__name__}: {err}); engine {[s['state'] for s in ended]} after "
              f"{engine_s:.1f}s: {[s.get('reason') for s in ended]}")
        assert named(err, h.name), err
        assert trainer_s <= TIMEOUT_S + TRAINER_MARGIN_S, (trainer_s, err)
        # `timeout_s` bounds the engine's whole receive (not each bucket), so even a slow
        # link that still delivers a bucket now and then ends it within `timeout_s`.
        assert engine_s <= TIMEOUT_S + ENGINE_MARGIN_S, (engine_s, ended)
        for s in ended:
            assert s["state"] == "torn" and s["failed_version"] == failed, s

        # Healed: the next push lands and meets the exact oracle.
        sync.push(perturb(load_tiny(like), seed=HEALED_SEED), version=f"{fault}-healed")
    assert_exact(server, HEALED_SEED, like, tmp_path, f"{fault}-healed")


def faulty_handle(server: Any, verb: str, fault: Callable[[], None]) -> Any:
    """A handle that cuts its engine's host off just before it sends `verb` (once)."""
    base = HANDLES[server.engine]
    method = {"check": "check", "finish": "flush_cache"}[verb]

    class CutOff(base):  # type: ignore[misc, valid-type]
        armed = True

        def _cut(self) -> None:
            if self.armed:
                self.armed = False
                fault()

    def cut_then_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._cut()
        return getattr(base, method)(self, *args, **kwargs)

    setattr(CutOff, method, cut_then_call)
    h = handle_of(server)
    h.__class__ = CutOff
    return h


@pytest.mark.parametrize("verb", ["check", "finish"])
def test_partition_during_a_control_phase_ends_in_time_and_the_next_push_heals(
        verb: str, hosts: Network, server: Any, model_dirs: dict[str, Path],
        tmp_path: Path) -> None:
    """The engine's host is cut off (every packet dropped) the moment the trainer sends
    `check` (before data moves), or `finish` (the engine has applied the update and the
    trainer asks it to flush its prefix cache)."""
    host, like = server.host, model_dirs["llama"]
    h = faulty_handle(server, verb, host.blackhole)
    beacons = [i["beacon"] for i in h.info(30)]
    failed = f"{verb}-partitioned"
    with WeightSync("gloo", host=hosts.hosts["trainer"].address, secret=SECRET,
                    timeout_s=TIMEOUT_S, bucket_bytes=BUCKET_BYTES) as sync:
        sync.add_replica(h)
        h.armed = False
        sync.push(perturb(load_tiny(like), seed=120), version=f"{verb}-before")
        h.armed = True
        t0 = time.monotonic()
        try:
            # On a thread: a push that never ends fails this test instead of hanging it.
            fut: Future[Any] = spawn(sync.push, perturb(load_tiny(like), seed=121),
                                     version=failed)
            err = fut.exception(timeout=TIMEOUT_S + TRAINER_MARGIN_S + 30.0)
            trainer_s = time.monotonic() - t0
            states = beacon_states(beacons)
        finally:
            host.heal()
        print(f"{server.engine}, partition during {verb}: trainer ended after {trainer_s:.1f}s "
              f"({type(err).__name__}: {err}); engine {states}")
        if err is None:
            # The handle sent nothing in `finish`: the engine flushed its prefix cache
            # while it applied the update (SGLang's scheduler does, and says so in its
            # receive's answer), so the partition touched no call of this push.
            assert verb == "finish" and getattr(h, "_last_flushed", None) is True, verb
        else:
            assert named(err, h.name), err
        assert trainer_s <= TIMEOUT_S + TRAINER_MARGIN_S, trainer_s
        for s in states:
            assert s["state"] != "updating", s
            if verb == "check":  # nothing moved: the previous version stays
                assert s["state"] == "current" and s["version"] == f"{verb}-before", s
            else:  # the update was applied before `finish`: one whole version, as said
                assert s["state"] == "current" and s["version"] == failed, s
        if verb == "finish":
            gens = server.generations()
            assert {g.version for g in gens} == {failed}
            assert [list(g.tokens) for g in gens] == hf_greedy(
                perturb(load_tiny(like), seed=121), PROMPTS, NEW_TOKENS)
        sync.push(perturb(load_tiny(like), seed=HEALED_SEED), version=f"{verb}-healed")
    assert_exact(server, HEALED_SEED, like, tmp_path, f"{verb}-healed")


# -- the mixed fleet across three hosts -------------------------------------------------
@full
def test_one_push_updates_vllm_and_sglang_on_two_other_hosts(
        hosts: Network, servers: dict[str, EngineServerProcess], model_dirs: dict[str, Path],
        _server_folder: Path, tmp_path: Path) -> None:
    """Trainer on 10.78.0.1, a vLLM server on .2 and an SGLang server on .3 (each engine
    in its own environment, with its own torch): one gloo group of three hosts."""
    both = {e: get_server(e, hosts, servers, model_dirs, _server_folder) for e in ENGINES}
    like = model_dirs["llama"]
    handles = [handle_of(s) for s in both.values()]
    with WeightSync("gloo", host=hosts.hosts["trainer"].address, secret=SECRET,
                    timeout_s=90, bucket_bytes=BUCKET_BYTES) as sync:
        for h in handles:
            sync.add_replica(h)
        report = sync.push(perturb(load_tiny(like), seed=11), version="mixed-1")
        assert report.ok and [r.name for r in report.replicas] == [h.name for h in handles]
        for srv in both.values():
            assert_exact(srv, 11, like, tmp_path / srv.engine, "mixed-1")  # type: ignore[attr-defined]
        report = sync.push(perturb(load_tiny(like), seed=HEALED_SEED), version="mixed-2")
        assert report.phases["group"] < report.phases["transfer"] + 1.0  # the group is reused
    for srv in both.values():
        assert_exact(srv, HEALED_SEED, like, tmp_path / f"{srv.engine}-2", "mixed-2")  # type: ignore[attr-defined]

"""The plugin system: every hook is documented and tested, built-ins are plugins,
third-party plugins load from the entry point and are usable by name."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from enginehooks import WeightSync, hookimpl, hookspecs
from enginehooks.core.errors import PluginError
from enginehooks.engine.local import LocalEngine
from enginehooks.plugins import (
    get_plugin_manager,
    register_plugin,
    transports,
    unregister_plugin,
)
from enginehooks.trainer_side import TrainerAdapter, adapter_for

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(n for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
               if hasattr(f, "enginehooks_spec"))


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def signature(fn: object) -> str:
    """`name(arg: Type, ...) -> Return` as written in hookspecs.py."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    args = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{fn.__name__}({args}) -> {sig.return_annotation}"  # type: ignore[attr-defined]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_every_hook_is_documented_with_its_signature_and_docstring_and_tested() -> None:
    assert HOOKS, "no hookspecs found"
    docs = (ROOT / "docs" / "hooks.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    sections = re.findall(r"^## `(.+)`$", docs, re.M)
    assert len(sections) == len(HOOKS), f"docs/hooks.md documents {sections}, hookspecs {HOOKS}"
    for hook in HOOKS:
        fn = getattr(hookspecs, hook)
        assert signature(fn) in sections, f"docs/hooks.md lacks the section `{signature(fn)}`"
        assert fn.__doc__, f"hookspec {hook} has no docstring"
        assert _words(inspect.cleandoc(fn.__doc__)) in _words(docs), \
            f"docs/hooks.md does not carry {hook}'s docstring as written in hookspecs.py"
        assert re.search(rf"def test_hook_\w*{hook}", tests), f"no test_hook_..{hook}.. test"


def test_builtins_are_registered_as_plugins_and_loading_is_idempotent() -> None:
    pm = get_plugin_manager()
    names = {pm.get_name(p) for p in pm.get_plugins()}
    from enginehooks.plugins import DEFAULT_PLUGINS

    assert set(DEFAULT_PLUGINS) <= names
    assert get_plugin_manager() is pm
    before = len(pm.get_plugins())
    pm.load_setuptools_entrypoints("enginehooks")  # what every engine process may do again
    assert len(pm.get_plugins()) == before
    assert {"gloo", "nccl", "disk"} <= set(transports())


def test_hook_register_transports_third_party_package(tmp_path: Path) -> None:
    """Install a separate package with an `enginehooks` entry point and use its
    transport by name, in a fresh interpreter (nothing in enginehooks changes)."""
    target = tmp_path / "site"
    source = tmp_path / "src"  # pip builds in place: keep the checkout clean
    shutil.copytree(ROOT / "tests" / "plugins" / "enginehooks_queue", source)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, timeout=300,
    )
    script = textwrap.dedent("""
        import torch
        from torch import nn
        from enginehooks import WeightSync
        from enginehooks.engine.local import LocalEngine
        from enginehooks.plugins import transports
        assert "queue" in transports(), transports()
        torch.manual_seed(0); src = nn.Linear(32, 32)
        torch.manual_seed(1); dst = nn.Linear(32, 32)
        with WeightSync("queue", timeout_s=20, bucket_bytes=1024) as sync:
            sync.add_replica(LocalEngine(dst))
            report = sync.push(src, version=3)
        assert torch.equal(src.weight, dst.weight) and torch.equal(src.bias, dst.bias)
        print("OK", report.transport, report.buckets)
    """)
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK queue" in out.stdout


def test_duplicate_transport_name_is_an_error(plugin) -> None:
    from enginehooks.transports.collectives import GlooTransport

    class Impostor(GlooTransport):
        name = "gloo"

    class Plugin:
        @hookimpl
        def register_transports(self, register):
            register(Impostor)

    p = plugin(Plugin(), name="impostor")
    with pytest.raises(PluginError, match="transport 'gloo' registered twice"):
        transports()
    unregister_plugin(p)
    assert transports()["gloo"] is GlooTransport


def test_unknown_transport_names_the_installed_ones() -> None:
    with pytest.raises(PluginError, match=r"no transport named 'carrier-pigeon'; installed: \["):
        WeightSync("carrier-pigeon")


def test_hook_register_trainer_adapters_plugin_adapter_wins(plugin) -> None:
    class Doubled(TrainerAdapter):
        """An adapter for a model type enginehooks does not know."""

        name = "doubled"

        @classmethod
        def accepts(cls, model) -> bool:
            return isinstance(model, dict)

        def specs(self):
            return [self.wire_spec(k, v.dtype, tuple(v.shape)) for k, v in self.model.items()]

        def stream(self):
            return ((k, self.to_wire(v * 2)) for k, v in self.model.items())

    class Plugin:
        @hookimpl
        def register_trainer_adapters(self, register):
            register(Doubled)

    plugin(Plugin(), name="doubled")
    dst = nn.Linear(4, 4)
    src = {"weight": torch.ones(4, 4), "bias": torch.ones(4)}
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(LocalEngine(dst))
        sync.push(src, version=1)
    assert torch.equal(dst.weight, torch.full((4, 4), 2.0))


def test_an_adapter_outside_the_contract_is_refused_by_name(plugin) -> None:
    class NotAnAdapter:
        name = "rogue"

        @classmethod
        def accepts(cls, model) -> bool:
            return True

    class Plugin:
        @hookimpl
        def register_trainer_adapters(self, register):
            register(NotAnAdapter)

    plugin(Plugin(), name="rogue")
    with pytest.raises(PluginError, match="does not subclass"):
        adapter_for(nn.Linear(2, 2))


def test_hook_run_phase_and_push_finished_wrappers(plugin) -> None:
    seen: list[str] = []
    reports = []

    class Tracer:
        @hookimpl(wrapper=True)
        def run_phase(self, phase, report, run):
            seen.append(f"enter {phase}")
            result = yield
            seen.append(f"exit {phase}")
            return result

        @hookimpl
        def push_finished(self, report):
            reports.append(report)

    plugin(Tracer(), name="tracer")
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(LocalEngine(small_model(1)))
        report = sync.push(small_model(2), version=9)
    phases = ["plan", "group", "check", "transfer", "finish"]
    assert seen == [f"{x} {p}" for p in phases for x in ("enter", "exit")]
    assert list(report.phases) == phases and all(v >= 0 for v in report.phases.values())
    assert reports == [report] and report.ok



def test_hook_send_weights_receive_weights_update_group_overrides(plugin) -> None:
    calls: list[str] = []

    class Spy:
        @hookimpl(wrapper=True)
        def update_group(self, request):
            calls.append(f"update_group {request.action} {request.side}")
            return (yield)

        @hookimpl(tryfirst=True)
        def send_weights(self, transport, sender, manifest, stream, abort):
            calls.append("send_weights")
            # Scale every tensor on the way: a plugin that owns the send for a transport.
            return sender.send(manifest, ((n, t * 3) for n, t in stream), abort)

        @hookimpl(tryfirst=True)
        def receive_weights(self, transport, receiver, manifest, target):
            calls.append("receive_weights")
            return None  # defer to the built-in implementation

    plugin(Spy(), name="spy")
    src, dst = small_model(3), small_model(4)
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(LocalEngine(dst))
        sync.push(src, version=1)
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a * 3, b), n
    assert calls[:2] == ["update_group join sender", "update_group join receiver"]
    assert "send_weights" in calls and "receive_weights" in calls
    # both sides leave once the sync closes (their order is the threads'), after the data
    leaves = [i for i, c in enumerate(calls) if c.startswith("update_group leave")]
    assert sorted(calls[i] for i in leaves) == ["update_group leave receiver",
                                                "update_group leave sender"], calls
    assert min(leaves) > max(calls.index("send_weights"), calls.index("receive_weights"))



def test_hook_update_group_takes_one_typed_request_per_mode_and_answers_its_type() -> None:
    """`update_group` takes one frozen request per mode (no field that stays None outside
    it), the old constructors build them, and `ask` returns the mode's type or refuses a
    plugin's other answer by class, on the real plugin manager."""
    import dataclasses

    from enginehooks.core.errors import TransportError
    from enginehooks.transports.base import (
        GroupRequest,
        JoinReceiver,
        JoinSender,
        LeaveReceiver,
        LeaveSender,
        Sender,
    )

    join = GroupRequest.join_receiver("odd", {"group": "g"}, 3, "cpu")
    assert join == JoinReceiver("odd", {"group": "g"}, 3, "cpu")
    assert (join.action, join.side) == ("join", "receiver")
    assert GroupRequest.join_sender("odd", {"port": 1}) == JoinSender("odd", {"port": 1})
    for cls in (JoinSender, JoinReceiver, LeaveSender, LeaveReceiver):
        names = [f.name for f in dataclasses.fields(cls)]
        assert names[0] == "transport" and "member" not in names, cls
        assert all(f.default is not None for f in dataclasses.fields(cls)), cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        join.rank = 4  # type: ignore[misc]

    class Sent(Sender):
        def endpoint(self) -> dict[str, Any]:
            return {"transport": "odd"}

        def connect(self, world_size: int) -> None:  # pragma: no cover
            pass

        def send(self, manifest: Any, stream: Any, abort: Any) -> Any:  # pragma: no cover
            raise AssertionError("not used")

        def close(self) -> None:
            pass

    sent = Sent()
    leave = GroupRequest.leave("odd", "sender", sent)
    assert leave == LeaveSender("odd", sent) and leave.member is sent
    with pytest.raises(TransportError, match="needs a Receiver"):
        GroupRequest.leave("odd", "receiver", sent)

    class Odd:
        @hookimpl(tryfirst=True)
        def update_group(self, request: Any) -> Any:
            if request.transport != "odd":
                return None
            return sent if isinstance(request, (JoinSender, LeaveSender)) else "a receiver"

    pm = get_plugin_manager()
    odd = Odd()
    register_plugin(odd, name="odd-transport")
    try:
        assert JoinSender("odd", {}).ask(pm) is sent
        assert LeaveSender("odd", sent).ask(pm) is sent
        with pytest.raises(TransportError, match="answered str"):
            JoinReceiver("odd", {}, 1, "cpu").ask(pm)
    finally:
        unregister_plugin(odd)

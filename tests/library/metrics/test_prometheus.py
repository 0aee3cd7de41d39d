"""The optional metrics plugins, registered like a third-party plugin: the Prometheus
exporter is scraped over HTTP after real pushes (gloo, a module replica), one that
succeeds and one refused; the progress line appears for a long push only."""

from __future__ import annotations

import io
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from enginehooks import ManifestError, WeightSync
from enginehooks.engine.local import LocalEngine
from enginehooks.metrics import ProgressLine
from enginehooks.trainer_side import StateDictAdapter

prometheus_client = pytest.importorskip("prometheus_client")


def small_model(seed: int, out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, out))


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` parsed: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_hook_push_finished_and_run_phase_feed_prometheus(plugin: Any) -> None:
    from enginehooks.metrics import PrometheusMetrics

    metrics = plugin(PrometheusMetrics(), name="prometheus")
    port = metrics.serve(0)
    try:
        replica = LocalEngine(small_model(1), name="local-0")
        with WeightSync("gloo", timeout_s=20, bucket_bytes=256) as sync:
            sync.add_replica(replica)
            report = sync.push(small_model(2), version=7)
            with pytest.raises(ManifestError):
                sync.push(small_model(3, out=5), version=8)  # shapes the replica refuses
        m = scrape(port)
    finally:
        metrics.close()
    assert value(m, "enginehooks_pushes_total", transport="gloo", outcome="ok") == 1
    assert value(m, "enginehooks_pushes_total", transport="gloo", outcome="failed") == 1
    assert value(m, "enginehooks_push_failures_total", transport="gloo", kind="ManifestError") == 1
    assert value(m, "enginehooks_pushed_bytes_total", transport="gloo") == report.bytes > 0
    assert value(m, "enginehooks_push_last_gbps", transport="gloo") == pytest.approx(report.gbps)
    assert report.gbps > 0
    for phase in ("plan", "group", "check", "transfer", "finish"):
        assert value(m, "enginehooks_push_phase_seconds_count", phase=phase, transport="gloo",
                     outcome="ok") >= 1
        assert value(m, "enginehooks_push_phase_running", phase=phase) == 0
    # The refused push failed in its check phase and never reached transfer.
    assert value(m, "enginehooks_push_phase_seconds_count", phase="check", transport="gloo",
                 outcome="failed") == 1
    assert ("enginehooks_push_phase_seconds_count", (("outcome", "failed"), ("phase", "transfer"),
                                                     ("transport", "gloo"))) not in m
    assert value(m, "enginehooks_push_seconds_sum", transport="gloo", outcome="ok") == \
        pytest.approx(report.seconds)
    # The replica still holds version 7: the refused push changed nothing there.
    assert value(m, "enginehooks_replica_version", replica="local-0") == 7
    assert value(m, "enginehooks_replica_version_info", replica="local-0", version="7") == 1
    assert value(m, "enginehooks_replica_up_to_date", replica="local-0") == 0


class BrokenStream(StateDictAdapter):
    """The trainer's stream breaks after the first tensor: data has moved."""

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        it = super().stream()
        yield next(it)
        raise RuntimeError("trainer lost a rank")


def test_replica_versions_follow_pushes_with_any_version_string(plugin: Any) -> None:
    from enginehooks.metrics import PrometheusMetrics

    metrics = plugin(PrometheusMetrics(), name="prometheus")
    port = metrics.serve(0)
    try:
        with WeightSync("gloo", timeout_s=20, bucket_bytes=256) as sync:
            sync.add_replica(LocalEngine(small_model(1), name="a"))
            sync.push(small_model(2), version=1)
            sync.push(small_model(3), version="step-2")
            m = scrape(port)
            with pytest.raises(RuntimeError, match="trainer lost a rank") as err:
                sync.push(BrokenStream(dict(small_model(4).state_dict())), version=3)
        after_failure = scrape(port)
    finally:
        metrics.close()
    assert value(m, "enginehooks_replica_version_info", replica="a", version="step-2") == 1
    assert ("enginehooks_replica_version_info", (("replica", "a"), ("version", "1"))) not in m
    assert str(value(m, "enginehooks_replica_version", replica="a")) == "nan"
    assert value(m, "enginehooks_replica_up_to_date", replica="a") == 1
    # Failed mid-transfer: the replica's version is unknown (torn), counted by kind.
    kind = type(err.value).__name__
    assert value(after_failure, "enginehooks_push_failures_total", transport="gloo", kind=kind) == 1
    assert value(after_failure, "enginehooks_replica_version_info", replica="a",
                 version="unknown") == 1
    assert value(after_failure, "enginehooks_replica_up_to_date", replica="a") == 0


class SlowStream(StateDictAdapter):
    """A trainer whose stream takes a while (a slow gather): a long transfer."""

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        time.sleep(2.5)
        yield from super().stream()


def test_hook_run_phase_progress_line_for_long_pushes_only(plugin: Any) -> None:
    out = io.StringIO()
    plugin(ProgressLine(out, after_s=1.5, interval_s=0.2), name="progress")
    with WeightSync("gloo", timeout_s=20) as sync:
        sync.add_replica(LocalEngine(small_model(1)))
        sync.push(small_model(2), version=1)
        assert out.getvalue() == ""  # short: nothing printed

        sync.push(SlowStream(dict(small_model(3).state_dict())), version=2)
    lines = out.getvalue().splitlines()
    assert any(ln.startswith("push v2 over gloo: transfer ") for ln in lines), lines
    assert "plan " in lines[-2] and "check " in lines[-2]  # phases done are listed
    assert lines[-1].startswith("push v2 over gloo: done in ") and "GB/s" in lines[-1]
    assert lines[-2].endswith(" B planned")  # 848 bytes: two small linear layers


def test_cli_registers_the_observers_it_is_asked_for() -> None:
    from enginehooks.cli import observers
    from enginehooks.metrics import PrometheusMetrics
    from enginehooks.plugins import get_plugin_manager, unregister_plugin

    added = observers(progress=True, metrics_port=0)
    try:
        assert [type(p) for p in added] == [ProgressLine, PrometheusMetrics]
        assert all(get_plugin_manager().is_registered(p) for p in added)
        with WeightSync("gloo", timeout_s=20) as sync:
            sync.add_replica(LocalEngine(small_model(1), name="cli"))
            sync.push(small_model(2), version=3)
        assert value(scrape(added[1].port), "enginehooks_replica_version", replica="cli") == 3
    finally:
        for p in added:
            unregister_plugin(p)
        added[1].close()
    assert observers(progress=False, metrics_port=None) == []

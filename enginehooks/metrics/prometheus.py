"""`PrometheusMetrics`: push metrics for Prometheus, from two hooks and nothing else.

Everything comes from what the coordinator already tells every plugin: `run_phase`
(wrapped, to time each phase as it runs, whatever its outcome) and `push_finished`
(the report: bytes, GB/s, the error's kind, each replica's result). No transport or
engine code knows this plugin exists.

Exported (prefix `enginehooks_`, labels in brackets):

- `push_phase_seconds` [phase, transport, outcome], histogram: each phase of each push;
- `push_phase_running` [phase], gauge: phases running now;
- `push_seconds` [transport, outcome], histogram: whole pushes;
- `pushes_total` [transport, outcome], counter: pushes, `ok` or `failed`;
- `push_failures_total` [transport, kind], counter: failed pushes by error class
  (`ManifestError`, `PushTimeout`, `ReplicaError`, `TransportError`, ...);
- `pushed_bytes_total` [transport], counter: payload bytes of successful pushes;
- `push_last_bytes`, `push_last_gbps` [transport], gauges: the last successful push's
  payload and its GB/s (1e9 bytes/s) in the transfer phase;
- `replica_version` [replica], gauge: the version a replica holds, when it is a number
  (NaN when unknown);
- `replica_version_info` [replica, version], gauge: 1 for the version a replica holds
  (any string; `unknown` after a push failed there once data moved);
- `replica_up_to_date` [replica], gauge: 1 if the last push reached the replica, 0 if
  it failed there;
- `replica_updates_total` [replica, outcome], counter: updates each replica applied, by
  what their verification found (`verified`, `repaired`, `unverified`; a replica whose
  workers disagree counts its worst), from the workers' receive replies.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from enginehooks.markers import hookimpl

if TYPE_CHECKING:
    from enginehooks.core.report import PushReport

#: seconds; a push phase spans milliseconds (plan) to minutes (a large transfer)
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


#: outcomes of an update's verification, best first (engine/verify.py)
OUTCOMES = ("verified", "repaired", "unverified")


def verification_outcome(stats: dict[str, Any]) -> str:
    """The worst outcome over a replica's workers' receive replies (`verification`):
    `unverified` when a worker says nothing."""
    worst = 0
    workers = stats.get("workers") or [{}]
    for w in workers:
        v = w.get("verification") if isinstance(w, dict) else None
        outcome = v.get("outcome") if isinstance(v, dict) and v.get("ok") else "unverified"
        worst = max(worst, OUTCOMES.index(outcome) if outcome in OUTCOMES else 2)
    return OUTCOMES[worst]


class PrometheusMetrics:
    """The plugin. `registry`: a `prometheus_client.CollectorRegistry` (default: a new
    one, so two instances never clash; pass `prometheus_client.REGISTRY` to export
    next to your process's other metrics). `serve(port)` exposes it over HTTP."""

    def __init__(self, registry: Any = None, namespace: str = "enginehooks") -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError as e:
            raise ImportError("PrometheusMetrics needs prometheus_client: pip install "
                              "'enginehooks[metrics]'") from e
        self.registry = registry if registry is not None else CollectorRegistry()
        ns, reg = namespace, self.registry
        self.phase_seconds = Histogram(f"{ns}_push_phase_seconds", "Duration of one push phase.",
                                       ["phase", "transport", "outcome"], buckets=BUCKETS,
                                       registry=reg)
        self.phase_running = Gauge(f"{ns}_push_phase_running", "Push phases running now.",
                                   ["phase"], registry=reg)
        self.push_seconds = Histogram(f"{ns}_push_seconds", "Duration of whole pushes.",
                                      ["transport", "outcome"], buckets=BUCKETS, registry=reg)
        self.pushes = Counter(f"{ns}_pushes", "Pushes, by outcome.", ["transport", "outcome"],
                              registry=reg)
        self.failures = Counter(f"{ns}_push_failures", "Failed pushes, by error class.",
                                ["transport", "kind"], registry=reg)
        self.bytes = Counter(f"{ns}_pushed_bytes", "Payload bytes of successful pushes.",
                             ["transport"], registry=reg)
        self.last_bytes = Gauge(f"{ns}_push_last_bytes", "Payload bytes of the last successful "
                                "push.", ["transport"], registry=reg)
        self.last_gbps = Gauge(f"{ns}_push_last_gbps", "GB/s (1e9 bytes/s) in the transfer "
                               "phase of the last successful push.", ["transport"], registry=reg)
        self.replica_version = Gauge(f"{ns}_replica_version", "Weight version a replica holds, "
                                     "when numeric (NaN when unknown).", ["replica"], registry=reg)
        self.replica_version_info = Gauge(f"{ns}_replica_version_info", "1 for the weight "
                                          "version each replica holds.", ["replica", "version"],
                                          registry=reg)
        self.replica_up_to_date = Gauge(f"{ns}_replica_up_to_date", "1 if the last push reached "
                                        "the replica, 0 if it failed there.", ["replica"],
                                        registry=reg)
        self.replica_updates = Counter(f"{ns}_replica_updates", "Updates a replica applied, "
                                       "by what their verification found.",
                                       ["replica", "outcome"], registry=reg)
        self._versions: dict[str, str] = {}
        self._lock = threading.Lock()
        self._server: Any = None
        self.port: int | None = None  # where `serve` listens

    # -- the hooks -------------------------------------------------------------------
    @hookimpl(wrapper=True)
    def run_phase(self, phase: str, report: PushReport, run: Callable[[], Any]) -> Generator:
        running = self.phase_running.labels(phase)
        running.inc()
        t0, outcome = time.perf_counter(), "failed"
        try:
            result = yield
            outcome = "ok"
            return result
        finally:
            running.dec()
            self.phase_seconds.labels(phase, report.transport, outcome).observe(
                time.perf_counter() - t0)

    @hookimpl
    def push_finished(self, report: PushReport) -> None:
        outcome = "ok" if report.ok else "failed"
        self.pushes.labels(report.transport, outcome).inc()
        self.push_seconds.labels(report.transport, outcome).observe(report.seconds)
        if report.ok:
            self.bytes.labels(report.transport).inc(report.bytes)
            self.last_bytes.labels(report.transport).set(report.bytes)
            self.last_gbps.labels(report.transport).set(report.gbps)
        else:
            self.failures.labels(report.transport, report.error_kind or "unknown").inc()
        # A push that failed before its transfer phase moved nothing: replicas keep
        # the version they held. One that failed later leaves failed replicas unknown.
        moved = "transfer" in report.phases
        for r in report.replicas:
            self.replica_up_to_date.labels(r.name).set(1 if r.ok else 0)
            if r.ok:
                self._set_version(r.name, str(report.version))
                self.replica_updates.labels(r.name, verification_outcome(r.stats)).inc()
            elif moved and r.error is not None:
                self._set_version(r.name, "unknown")

    def _set_version(self, replica: str, version: str) -> None:
        with self._lock:
            old = self._versions.get(replica)
            if old is not None and old != version:
                self.replica_version_info.remove(replica, old)
            self._versions[replica] = version
        self.replica_version_info.labels(replica, version).set(1)
        try:
            number = float(version)
        except ValueError:
            number = math.nan
        self.replica_version.labels(replica).set(number)

    # -- exposition ------------------------------------------------------------------
    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` on `addr:port` (0: a free port) in a daemon thread; returns
        the port. Loopback by default: expose it deliberately."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server, self.port = None, None

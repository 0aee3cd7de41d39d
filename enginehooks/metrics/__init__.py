"""Optional observability plugins, built only on the `run_phase` and `push_finished`
hooks, exactly as a third-party package would write them (docs/hooks.md walks
through `PrometheusMetrics`):

- `PrometheusMetrics`: a Prometheus exporter (needs `prometheus_client`, the
  `metrics` extra) of push duration per phase, bytes, GB/s, failures by kind and the
  version each replica holds;
- `ProgressLine`: one status line for pushes that run long (the CLI's `--progress`).

Neither is registered by default: `register_plugin(PrometheusMetrics())`, or ship it on
the `enginehooks` entry point.
"""

from __future__ import annotations

from enginehooks.metrics.progress import ProgressLine
from enginehooks.metrics.prometheus import PrometheusMetrics

__all__ = ["ProgressLine", "PrometheusMetrics"]

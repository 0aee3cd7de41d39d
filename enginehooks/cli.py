"""The `enginehooks` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="enginehooks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="push trained weights into a real engine, end to end")
    demo.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    demo.add_argument("--transport", default="gloo", help="gloo (default) or disk")
    demo.add_argument("--steps", type=int, default=30, help="training steps")
    demo.add_argument("--lr", type=float, default=1e-2)
    demo.add_argument("--timeout", type=float, default=120.0, help="seconds per push phase")
    demo.add_argument("--bucket-bytes", type=int, default=64 << 10)
    demo.add_argument("--start-timeout", type=float, default=300.0,
                      help="seconds to wait for the engine to start")
    demo.add_argument("--workdir", default=None, help="where the model and logs go")
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="a status line for pushes that run longer than 2 s "
                           "(default: when stderr is a terminal)")
    demo.add_argument("--metrics-port", type=int, default=None,
                      help="serve Prometheus metrics of the pushes on 127.0.0.1:PORT "
                           "(needs prometheus_client)")
    sub.add_parser("transports", help="list installed transports")
    args = parser.parse_args(argv)

    if args.command == "transports":
        from enginehooks.plugins import transports

        for name, cls in sorted(transports().items()):
            print(f"{name:<12} {cls.__module__}.{cls.__qualname__}")
        return 0
    observers(args.progress, args.metrics_port)
    if args.engine == "sglang":
        from enginehooks.demo import run_sglang_demo

        return run_sglang_demo(args)
    from enginehooks.demo import run_vllm_demo

    return run_vllm_demo(args)


def observers(progress: bool | None, metrics_port: int | None) -> list[object]:
    """Register the observability plugins the command line asks for: the progress line
    (`progress` None: when stderr is a terminal) and the Prometheus exporter, served on
    loopback at `metrics_port` (0: a free port, printed). Returns the plugins."""
    from enginehooks.plugins import register_plugin

    added: list[object] = []
    if progress or (progress is None and sys.stderr.isatty()):
        from enginehooks.metrics import ProgressLine

        added.append(ProgressLine())
        register_plugin(added[-1], name="enginehooks-cli-progress")
    if metrics_port is not None:
        from enginehooks.metrics import PrometheusMetrics

        metrics = PrometheusMetrics()
        port = metrics.serve(metrics_port)
        register_plugin(metrics, name="enginehooks-cli-metrics")
        print(f"[enginehooks] Prometheus metrics on http://127.0.0.1:{port}/metrics",
              file=sys.stderr)
        added.append(metrics)
    return added


if __name__ == "__main__":
    sys.exit(main())

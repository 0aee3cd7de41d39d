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
    sub.add_parser("transports", help="list installed transports")
    args = parser.parse_args(argv)

    if args.command == "transports":
        from enginehooks.plugins import transports

        for name, cls in sorted(transports().items()):
            print(f"{name:<12} {cls.__module__}.{cls.__qualname__}")
        return 0
    if args.engine == "sglang":
        from enginehooks.testing.demo import run_sglang_demo

        return run_sglang_demo(args)
    from enginehooks.testing.demo import run_vllm_demo

    return run_vllm_demo(args)


if __name__ == "__main__":
    sys.exit(main())

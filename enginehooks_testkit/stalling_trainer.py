"""A trainer that stops in the middle of a push and waits to be killed: the fault the
fail-closed tests and the soak inject. `python -m enginehooks_testkit.stalling_trainer
ENGINE URL MODEL_DIR VERSION TIMEOUT_S [AFTER]` pushes the model at MODEL_DIR (moved by a
seeded perturbation) to the server at URL, stalls after AFTER tensors (default 3) and
prints "stalled" once the engine is receiving. The secret, if any, comes from
ENGINEHOOKS_SECRET as for any trainer. With VERSION "-" it gets ready (imports, model),
prints "ready", and reads the version from stdin before it pushes: a caller on a busy
host can start it ahead of time. ENGINEHOOKS_STALLING_TRAINER_HOST is the trainer's
address the engines connect to (loopback by default; another host's engines need the
trainer host's own address)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import torch

HOST_ENV = "ENGINEHOOKS_STALLING_TRAINER_HOST"


def main() -> None:
    engine, url, model_dir, version, timeout_s = sys.argv[1:6]
    after = int(sys.argv[6]) if len(sys.argv) > 6 else 3
    from enginehooks import WeightSync
    from enginehooks.trainer_side import ModuleAdapter
    from enginehooks_testkit.servers import HANDLES
    from enginehooks_testkit.tiny import load_tiny, perturb

    class StallingAdapter(ModuleAdapter):
        def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(super().stream()):
                if i == after:
                    print("stalled", flush=True)
                    time.sleep(3600)  # killed here
                yield item

    model = perturb(load_tiny(model_dir), seed=int(time.time()) % 1000)
    if version == "-":
        print("ready", flush=True)
        version = sys.stdin.readline().strip()
    # The trainer's address, where its engines are on other hosts (tests/multihost).
    host = os.environ.get(HOST_ENV, "127.0.0.1")
    sync = WeightSync("gloo", host=host, bucket_bytes=4096, timeout_s=float(timeout_s))
    sync.add_replica(HANDLES[engine](url, name=engine))
    sync.push(StallingAdapter(model), version=version)


if __name__ == "__main__":
    main()

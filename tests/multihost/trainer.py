"""The trainer side of the tests across hosts, run inside the trainer's namespace:
`python -m tests.multihost.trainer SPEC_JSON`, then one JSON command per stdin line, one
JSON answer per stdout line.

SPEC: `{"model_dir", "host", "replica": {"kind", "url", "name"}, "timeout_s",
"bucket_bytes"}`: `host` is the trainer's address (where the store listens), `kind`
"module" or "vllm"; `"replicas": [{...}, ...]` instead of `"replica"` pushes to several.
One `WeightSync` serves every push of the session, as in a training loop.

Commands:
- `{"op": "push", "seed": s, "version": v}`: push `perturb(load_tiny(model_dir), s)`;
  answers `{"ok": true, "report": ...}` or `{"ok": false, "type", "error", "replica"}`,
  with `"seconds"` (how long `push` took);
- `{"op": "health"}`: whether the replica's `/health` answers 200 now;
- `{"op": "digests", "names": [...], "replica"?: name}`: the replica's (the first
  one's by default) crc32 of those weights;
- `{"op": "greedy", "prompts": [[...]], "max_tokens": n}`: greedy tokens from the vLLM
  server (a client on the trainer's host);
- `{"op": "exit"}`.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import Any

from enginehooks import WeightSync
from enginehooks.control._http import request_json
from enginehooks.control.handles import EngineHandle
from enginehooks_testkit.tiny import load_tiny, perturb


def handle_of(spec: dict[str, Any]) -> EngineHandle:
    if spec["kind"] == "module":
        from tests.multihost.replica import RemoteModule

        return RemoteModule(spec["url"], name=spec["name"])
    from enginehooks.vllm_ext import VLLMServer

    return VLLMServer(spec["url"], name=spec["name"])


def main(spec: dict[str, Any]) -> None:
    model = load_tiny(spec["model_dir"])
    base = {n: t.clone() for n, t in model.state_dict().items()}
    handles = {r["name"]: handle_of(r) for r in spec.get("replicas", [spec.get("replica")])}
    handle = next(iter(handles.values()))
    sync = WeightSync("gloo", host=spec["host"], timeout_s=spec["timeout_s"],
                      bucket_bytes=spec["bucket_bytes"])
    for h in handles.values():
        sync.add_replica(h)

    def answer(obj: dict[str, Any]) -> None:
        print(json.dumps(obj), flush=True)

    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "push":
            model.load_state_dict(base)
            perturb(model, seed=int(cmd["seed"]))
            t0 = time.monotonic()
            try:
                report = sync.push(model, version=cmd["version"])
            except Exception as e:
                answer({"ok": False, "type": type(e).__name__, "error": str(e),
                        "replica": getattr(e, "replica", None),
                        "seconds": time.monotonic() - t0})
                continue
            answer({"ok": True, "report": {"buckets": report.buckets, "ok": report.ok},
                    "seconds": time.monotonic() - t0})
        elif op == "health":
            url = spec["replica"]["url"]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    answer({"ok": r.status == 200})
            except OSError as e:
                answer({"ok": False, "error": str(e)})
        elif op == "digests":
            h = handles[cmd["replica"]] if "replica" in cmd else handle
            answer({"ok": True, "digests": h.digests(cmd["names"], timeout_s=60.0)})
        elif op == "greedy":
            url, out = spec["replica"]["url"], []
            request_json(f"{url}/reset_prefix_cache", {}, timeout_s=60, who=url)
            for p in cmd["prompts"]:
                body = {"model": spec["model_dir"], "prompt": p, "max_tokens": cmd["max_tokens"],
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                r = request_json(f"{url}/v1/completions", body, timeout_s=60, who=url)
                out.append(r["choices"][0]["token_ids"])
            answer({"ok": True, "tokens": out})
        else:
            answer({"ok": False, "type": "ValueError", "error": f"unknown op {op!r}"})
    sync.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

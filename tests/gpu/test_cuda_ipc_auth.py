"""`cuda_ipc` shares the colocated control messages (`transports/colocated.py`): with a
shared secret they are signed across a real CUDA IPC hand-off, and a forged `ok` ack is
ignored: no GPU slot is reused before the receiver's own ack. GPU only (the CPU twin is
`tests/library/transports/test_colocated_auth.py`, over `shm`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from enginehooks.control._futures import spawn
from enginehooks.core.auth import SECRET_ENV
from enginehooks.core.manifest import plan
from enginehooks.plugins import get_transport
from enginehooks.transports._rendezvous import client_store
from enginehooks.transports.base import Abort
from tests.gpu.test_gpu_transports import BUCKET, RECEIVER, ROOT, SPECS, crcs, gpus, make_weights
from tests.library.transports.test_colocated import DictTarget

SECRET = "cuda-ipc-control-secret"
pytestmark = [pytest.mark.gpu, gpus(1)]


def test_signed_cuda_ipc_pushes_to_another_process_are_bit_exact() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sender = get_transport("cuda_ipc").sender(host="127.0.0.1", port=0, timeout_s=60,
                                              device=device, secret=SECRET.encode())
    ep = dict(sender.endpoint(), world_size=2)
    manifests = [plan(SPECS, weight_version=v, bucket_bytes=BUCKET, checksum="sum64")
                 for v in range(2)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               **{SECRET_ENV: SECRET})
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, json.dumps(ep), "1", "cuda:0",
         json.dumps([m.to_json() for m in manifests])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        sender.connect(2)
        expected = []
        for v, m in enumerate(manifests):
            ws = make_weights(v, device)
            expected.append(crcs(ws))
            sender.send(m, iter(ws.items()), Abort())
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-4000:]
        results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        assert results == expected
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        sender.close()


def test_a_forged_ok_ack_is_ignored_on_cuda_ipc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever way `cuda_ipc` moves a bucket (its two slots, or the single copy from
    the trainer's own allocations), an ack frees what the receiver reads: a forged one
    must free nothing. Since issue 36 it is ignored (logged) rather than ending the
    update: the sender keeps waiting for the receiver's own ack, and the update lands
    bit-exact. Protective line: `ColocatedSender._wait_acks`'s
    `self.channel.open("ack", ...)` (without it the sender goes on while the receiver
    still reads bucket 0, and the test sees the send finish before the hold is released)."""
    import time

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    t = get_transport("cuda_ipc")
    sender = t.sender(host="127.0.0.1", port=0, timeout_s=20, device=device,
                      secret=SECRET.encode())
    ep = dict(sender.endpoint(), world_size=2)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    receiver = t.receiver(ep, 1, device)  # same process: maps the sender's own tensors
    receiver.connect()
    sender.connect(2)
    attacker = client_store("127.0.0.1", ep["port"], 10.0)
    m = plan(SPECS, weight_version=1, bucket_bytes=BUCKET, checksum="sum64")
    ws = make_weights(1, device)
    hold = threading.Event()
    target = DictTarget(hold=hold)
    fut = spawn(receiver.deliver, m, target)
    attacker.set(f"enginehooks/{ep['group']}/u1/ack/0/1", b"ok")
    try:
        send = spawn(sender.send, m, iter(ws.items()), Abort())
        time.sleep(2.0)
        assert not send.done()  # the forged ack freed nothing
    finally:
        hold.set()
    send.result(timeout=30)
    fut.result(timeout=30)
    assert crcs({n: target.got[n] for n in ws}) == crcs(ws)
    receiver.close()
    sender.close()

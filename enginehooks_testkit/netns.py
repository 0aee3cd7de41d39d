"""Several hosts on one machine, for tests across hosts: network namespaces joined by a
switch, with link faults on demand (not library code).

`Network(["trainer", "engine"])` makes, as root, one namespace per host and one for the
switch (a bridge), nothing in the machine's own namespace:

    host ns "trainer": lo, eth0 10.78.0.1/24 ──veth── p0 ┐
    host ns "engine":  lo, eth0 10.78.0.2/24 ──veth── p1 ┴ br0   (switch ns)

Each switch port `p<i>` also sends what it receives from its host through an `ifb<i>`
device (`tc` ingress redirect), so every fault of a link is made in the switch, on
both directions, and the hosts see a silent network (no local send error, no RST):

- `Host.shape(rate_kbit)`: a token-bucket rate limit (`tc tbf`) each way;
- `Host.blackhole()`: the link drops every packet, each way (a `tbf` whose bucket is
  smaller than any packet: this kernel family has `tbf` everywhere, `netem` not always);
- `Host.latency(seconds)`: `netem delay` where the kernel has netem; otherwise a `tbf`
  so slow that a full-size packet waits `seconds` in its queue (queueing latency: the
  same seconds-long round trips, and almost no bandwidth);
- `Host.down()` / `Host.up()`: the host's switch port, so the host disappears;
- `Host.heal()`: every fault of this host removed, port up.

`with host.entered():` moves the calling thread onto the host (`setns`): sockets it
opens, threads it starts and processes it forks from then on live there, so a test can
be the trainer of a host itself (the network namespace is per thread in Linux; threads
started earlier stay where they were).

The addresses (`10.78.0.0/24`) exist only inside these namespaces, which have no link to
the machine's own network: traffic can only flow between the harness's hosts. Processes
started with `Host.popen` run in the host's namespace (`ip netns exec`) in their own
session; `close()` (the context manager's exit, also on failure) kills them and deletes
every namespace, which deletes every link. Namespaces left by a killed test process
(names carry the creator's pid) are deleted by the next `Network`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

#: The harness's private subnet (only inside its namespaces): host i is `.{i + 1}`.
SUBNET = "10.78.0"
#: `setns(2)`'s flag for a network namespace.
CLONE_NEWNET = 0x40000000
#: Every namespace the harness makes starts with this, then the creator's pid.
PREFIX = "ehn"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_serial = 0


class NetnsUnavailable(RuntimeError):
    """Namespaces, veth pairs, bridges or `tc` cannot be used here."""


def _run(argv: list[str], check: bool = True, timeout_s: float = 20.0) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as e:
        raise NetnsUnavailable(f"{argv[0]} is not installed (apt-get install -y iproute2)") from e
    if check and out.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed ({out.returncode}): "
                               f"{(out.stderr or out.stdout).strip()}")
    return out.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of harnesses whose creating process is gone; their names."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


_REASON: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why no harness can be made here (None: it can). Probes once per process by making
    a two-host network and tearing it down."""
    if _REASON:
        return _REASON[0]
    reason: str | None = None
    if os.geteuid() != 0:
        reason = "network namespaces need root (CI runs these tests as root)"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "`ip` and `tc` are missing: apt-get install -y iproute2"
    else:
        try:
            with Network(["probe-a", "probe-b"]) as net:
                net.hosts["probe-b"].blackhole()
                net.hosts["probe-b"].heal()
        except NetnsUnavailable as e:
            reason = f"cannot make network namespaces here: {e}"
    _REASON.append(reason)
    return reason


def has_netem() -> bool:
    """Whether this kernel has `sch_netem` (many small VM kernels do not)."""
    ns = f"{PREFIX}{os.getpid()}-netem-probe"
    _run(["ip", "netns", "add", ns])
    try:
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        out = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                              "delay", "1ms"], capture_output=True, text=True, timeout=20)
        return out.returncode == 0
    finally:
        _run(["ip", "netns", "del", ns], check=False)


@dataclass
class Host:
    """One host of a `Network`: its namespace `ns`, address, and switch port."""

    net: Network
    name: str
    ns: str
    address: str
    port: str  # the switch's veth toward this host (traffic to the host leaves here)
    ifb: str  # traffic from the host leaves the switch port's ifb (ingress redirect)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, stdin: int | IO[Any] | None = None, stdout: int | IO[Any] | None = None,
              stderr: int | IO[Any] | None = None, text: bool = False) -> subprocess.Popen[Any]:
        """Start `argv` in this host's namespace, in its own session; the network kills
        it (and its children) when it closes."""
        proc = subprocess.Popen(self.argv(argv), env=env, cwd=cwd, stdin=stdin, stdout=stdout,
                                stderr=stderr, text=text, start_new_session=True)
        self.net.processes.append(proc)
        return proc

    @contextlib.contextmanager
    def entered(self) -> Iterator[Host]:
        """Run the calling thread on this host until the block ends (module docstring);
        it returns to the namespace it came from even when the block fails."""
        libc = ctypes.CDLL(None, use_errno=True)
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            here = os.open(f"/var/run/netns/{self.ns}", os.O_RDONLY)
            try:
                if libc.setns(here, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise NetnsUnavailable(f"setns into {self.ns}: {os.strerror(err)}")
            finally:
                os.close(here)
            try:
                yield self
            finally:
                if libc.setns(back, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise NetnsUnavailable(f"setns back from {self.ns}: {os.strerror(err)}")
        finally:
            os.close(back)

    def _tc(self, *args: str, check: bool = True) -> None:
        _run(["tc", "-n", self.net.switch, *args], check=check)

    def _both(self, *qdisc: str) -> None:
        for dev in (self.port, self.ifb):
            self._tc("qdisc", "replace", "dev", dev, "root", *qdisc)

    def shape(self, rate_kbit: int, burst_bytes: int = 32 * 1024) -> None:
        """Limit this host's link to `rate_kbit` each way."""
        self._both("tbf", "rate", f"{int(rate_kbit)}kbit", "burst", str(burst_bytes),
                   "latency", "400ms")

    def blackhole(self) -> None:
        """Drop every packet to and from this host, silently (no RST, no ICMP)."""
        # A bucket smaller than the smallest frame: tbf drops every packet.
        self._both("tbf", "rate", "8bit", "burst", "10", "limit", "10")

    def latency(self, seconds: float) -> None:
        """Round trips to this host take seconds (see the module docstring)."""
        if self.net.netem:
            self._both("netem", "delay", f"{int(seconds * 1000)}ms", "limit", "100000")
            return
        # A full-size (1514-byte) frame waits `seconds` behind one other in the queue.
        rate_bit = max(8, int(1514 * 8 / seconds))
        self._both("tbf", "rate", f"{rate_bit}bit", "burst", "1600", "latency", "120s")

    def down(self) -> None:
        """This host disappears: its switch port goes down."""
        _run(["ip", "-n", self.net.switch, "link", "set", self.port, "down"])

    def up(self) -> None:
        _run(["ip", "-n", self.net.switch, "link", "set", self.port, "up"])

    def heal(self) -> None:
        """Every fault of this host's link removed and its port up."""
        for dev in (self.port, self.ifb):
            self._tc("qdisc", "del", "dev", dev, "root", check=False)
        self.up()


@dataclass
class Network:
    """Hosts named `names`, each in its own namespace on one switch (module docstring)."""

    names: Sequence[str]
    switch: str = ""
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)
    netem: bool = False
    _made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _serial
        if len(self.names) > 250 or len(set(self.names)) != len(self.names):
            raise ValueError(f"host names must be distinct, at most 250: {self.names!r}")
        _serial += 1
        self.tag = f"{PREFIX}{os.getpid()}-{_serial}"
        self.switch = f"{self.tag}-switch"

    def __enter__(self) -> Network:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, name: str) -> str:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def open(self) -> None:
        sweep_stale()
        sw = self._ns(self.switch)
        ip = ["ip", "-n", sw]
        _run([*ip, "link", "add", "br0", "type", "bridge"])
        _run([*ip, "link", "set", "br0", "up"])
        for i, name in enumerate(self.names):
            ns = self._ns(f"{self.tag}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}")
            port, ifb, addr = f"p{i}", f"ifb{i}", f"{SUBNET}.{i + 1}"
            _run([*ip, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run([*ip, "link", "set", port, "master", "br0"])
            _run([*ip, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run([*ip, "link", "add", ifb, "type", "ifb"])
            _run([*ip, "link", "set", ifb, "up"])
            tc = ["tc", "-n", sw]
            _run([*tc, "qdisc", "add", "dev", port, "handle", "ffff:", "ingress"])
            _run([*tc, "filter", "add", "dev", port, "parent", "ffff:", "protocol", "all",
                  "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect",
                  "dev", ifb])
            self.hosts[name] = Host(self, name, ns, addr, port, ifb)
        self.netem = has_netem()

    def close(self) -> None:
        """Kill every process started in the hosts, then delete every namespace. Safe to
        call twice, and after a failed `open()`."""
        # Each process leads its own session: signal the whole group (a server's
        # children too), even where the leader has already exited.
        for proc in self.processes:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        deadline = time.monotonic() + 20.0
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.processes.clear()
        for name in reversed(self._made):
            _run(["ip", "netns", "del", name], check=False)
        self._made.clear()
        self.hosts.clear()

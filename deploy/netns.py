"""Several "hosts" on one machine: network namespaces on a private bridge, shaped by `tc tbf`.

Each host is a network namespace ``swd-<tag>-<i>`` with one interface, ``eth0``, holding
``<subnet>.<i+1>/24``; its other end is port ``p<i>`` of bridge ``br0`` in a namespace of its own,
``swd-<tag>-br``, so the machine's default namespace is never touched beyond the namespaces
themselves (no links, routes or firewall rules appear there). Each tag is a separate swarm, so
parallel runs with different tags do not see each other.

Bandwidth: a `tbf` qdisc on both ends of every host's veth pair limits what the host sends
(``eth0`` egress) and what it receives (``p<i>`` egress), like a symmetric access line. `netem`
is not available on these kernels, so there is no latency or loss shaping here.

NAT (issue 27): with ``nated=K`` the last K hosts sit behind a home router instead, namespace
``swd-<tag>-nat``: its ``wan0`` is a port of the public bridge holding ``<subnet>.250``, its
bridge ``lan0`` holds ``<lan>.1`` and one port ``q<i>`` per NATed host, which gets
``<lan>.<i+1>`` and a default route through the router. The router forwards and rewrites the
source of everything leaving ``wan0`` (iptables MASQUERADE) and forwards nothing in: a
connection to ``<subnet>.250`` finds no listener and the kernel refuses it, and the public hosts
have no route to the LAN at all, which is how a volunteer behind a home router looks.

Cutting a host sets its switch port ``p<i>`` down: the host's ``eth0`` loses carrier and every
packet to or from it vanishes, so both sides see silence and time out, the way an internet
outage looks to a peer (an administratively-down ``eth0`` would instead fail the host's own
sends at once with "network unreachable", which is a kinder failure than real outages are).

    python deploy/netns.py up --tag demo --hosts 4 --rate 20mbit
    ip netns exec swd-demo-0 swarmd dht --listen 10.77.0.1:7000
    python deploy/netns.py cut --tag demo 3 ; python deploy/netns.py heal --tag demo 3
    python deploy/netns.py down --tag demo

    python deploy/netns.py up --tag nat --hosts 4 --nated 2

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2 (`ip`, `tc`); NAT needs `iptables`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "swd"
BRIDGE = "br0"
HOST_IF = "eth0"
_TAG = re.compile(r"^[a-z0-9]{1,8}$")
# tc's rate/size/time syntax: a number and a unit (tc rejects what this lets through, loudly).
_TC_VALUE = re.compile(r"^[0-9]+(\.[0-9]+)?[a-z]*$")


class NetnsError(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, no netns support), or a command
    failed; the message says which command and what it printed."""


@dataclass(frozen=True)
class Shaping:
    """A `tc qdisc ... tbf rate R burst B latency L` on both ends of each host's link."""

    rate: str = "20mbit"
    #: Bucket size: at least rate/HZ; 32 KiB lets a 20 mbit link reach its rate at HZ=250.
    burst: str = "32kb"
    #: How long a packet may wait in the queue before tbf drops it.
    latency: str = "100ms"

    def __post_init__(self) -> None:
        for name in ("rate", "burst", "latency"):
            if not _TC_VALUE.match(getattr(self, name)):
                raise ValueError(f"Shaping.{name} {getattr(self, name)!r} is not a tc value")


@dataclass(frozen=True)
class NetnsConfig:
    tag: str
    hosts: int
    #: The /24 the hosts share; host i gets .i+1.
    subnet: str = "10.77.0.0/24"
    #: None: no bandwidth limit.
    shaping: Shaping | None = Shaping()
    #: The last `nated` hosts sit behind a NAT router, on the private `lan` /24.
    nated: int = 0
    lan: str = "192.168.77.0/24"

    def __post_init__(self) -> None:
        if not _TAG.match(self.tag):
            # Interface and namespace names are short (15 bytes for links); a tag is 1-8 of a-z0-9.
            raise ValueError(f"tag {self.tag!r} must be 1-8 characters of a-z and 0-9")
        if not 1 <= self.hosts <= 200:
            raise ValueError("hosts must be in 1..200")
        net = ipaddress.IPv4Network(self.subnet)
        if net.prefixlen != 24 or not net.is_private:
            raise ValueError(f"subnet {self.subnet!r} must be a private /24")
        lan = ipaddress.IPv4Network(self.lan)
        if lan.prefixlen != 24 or not lan.is_private or lan.overlaps(net):
            raise ValueError(f"lan {self.lan!r} must be a private /24 apart from the subnet")
        if not 0 <= self.nated < self.hosts or self.nated > 200:
            raise ValueError("nated must be in 0..hosts-1 (someone must be reachable)")


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def check_usable() -> None:
    """Raises NetnsError saying why namespaces cannot be made here; returns if they can."""
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root (run the test as root, as CI does)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsError(f"`{tool}` not found: install iproute2 (apt-get install iproute2)")


def check_nat_usable() -> None:
    check_usable()
    if shutil.which("iptables") is None:
        raise NetnsError("`iptables` not found: install it (apt-get install iptables)")


class Network:
    """One test network; use as a context manager so it is torn down even on failure."""

    def __init__(self, config: NetnsConfig) -> None:
        self.config = config
        net = ipaddress.IPv4Network(config.subnet)
        lan = ipaddress.IPv4Network(config.lan)
        self._hosts = [
            str((lan if self.is_nated(i) else net).network_address + i + 1)
            for i in range(config.hosts)
        ]
        #: The NAT router's public address (what NATed hosts' calls come from).
        self.router_ip = str(net.network_address + 250)
        self._lan_gateway = str(lan.network_address + 1)

    def is_nated(self, i: int) -> bool:
        return i >= self.config.hosts - self.config.nated

    # -- names ------------------------------------------------------------------------------

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}-{self.config.tag}-br"

    @property
    def router_ns(self) -> str:
        return f"{PREFIX}-{self.config.tag}-nat"

    def ns(self, i: int) -> str:
        """The namespace of host ``i``."""
        self._check_host(i)
        return f"{PREFIX}-{self.config.tag}-{i}"

    def ip(self, i: int) -> str:
        """Host ``i``'s address (no prefix length; a NATed host's private one)."""
        self._check_host(i)
        return self._hosts[i]

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix for a command line that runs inside host ``i``. `ip netns exec` execs the
        command in place, so the child's pid is the command's own (signals reach it directly)."""
        return ["ip", "netns", "exec", self.ns(i)]

    def _check_host(self, i: int) -> None:
        if not 0 <= i < self.config.hosts:
            raise IndexError(f"host {i} out of range 0..{self.config.hosts - 1}")

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Network:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Creates the bridge and the hosts; on any failure removes what it made and raises."""
        check_nat_usable() if self.config.nated else check_usable()
        taken = set(self.namespaces()) & set(list_namespaces())
        if taken:
            # Someone else's (or a leftover of a killed run: `netns.py down --tag` removes it).
            raise NetnsError(f"namespaces {sorted(taken)} already exist; use another tag")
        try:
            self._up()
        except BaseException:
            self.down()
            raise

    def _up(self) -> None:
        br = self.bridge_ns
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        if self.config.nated:
            self._up_router()
        for i in range(self.config.hosts):
            ns = self.ns(i)
            switch, port = (self.router_ns, f"q{i}") if self.is_nated(i) else (br, f"p{i}")
            _run(["ip", "netns", "add", ns])
            # Made inside the switch's namespace, its other end moved straight into the host's:
            # the default namespace never holds either end, even for a moment.
            self._plug(switch, port, ns, HOST_IF, "lan0" if self.is_nated(i) else BRIDGE)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self._hosts[i]}/24", "dev", HOST_IF])
            _run(["ip", "-n", ns, "link", "set", HOST_IF, "up"])
            if self.is_nated(i):
                _run(["ip", "-n", ns, "route", "add", "default", "via", self._lan_gateway])
            if self.config.shaping is not None:
                self._shape(ns, HOST_IF)
                self._shape(switch, port)

    def _plug(self, switch: str, port: str, ns: str, dev: str, bridge: str) -> None:
        """A veth pair: `port` on `bridge` in `switch`'s namespace, `dev` in `ns`."""
        peer = ["peer", "name", dev, "netns", ns]
        _run(["ip", "-n", switch, "link", "add", port, "type", "veth", *peer])
        _run(["ip", "-n", switch, "link", "set", port, "master", bridge])
        _run(["ip", "-n", switch, "link", "set", port, "up"])

    def _up_router(self) -> None:
        """The home router: wan0 on the public bridge, a LAN bridge for the NATed hosts,
        forwarding on, MASQUERADE out of wan0, nothing forwarded in."""
        nat, subnet_len = self.router_ns, "/24"
        _run(["ip", "netns", "add", nat])
        _run(["ip", "-n", nat, "link", "set", "lo", "up"])
        self._plug(self.bridge_ns, "pnat", nat, "wan0", BRIDGE)
        _run(["ip", "-n", nat, "addr", "add", self.router_ip + subnet_len, "dev", "wan0"])
        _run(["ip", "-n", nat, "link", "set", "wan0", "up"])
        _run(["ip", "-n", nat, "link", "add", "lan0", "type", "bridge"])
        _run(["ip", "-n", nat, "addr", "add", self._lan_gateway + subnet_len, "dev", "lan0"])
        _run(["ip", "-n", nat, "link", "set", "lan0", "up"])
        inside = ["ip", "netns", "exec", nat]
        _run([*inside, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        _run([*inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0",
              "-j", "MASQUERADE"])  # fmt: skip
        # Replies to connections the LAN opened pass; nothing else is forwarded in.
        _run([*inside, "iptables", "-A", "FORWARD", "-i", "wan0", "-m", "conntrack",
              "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"])  # fmt: skip
        _run([*inside, "iptables", "-A", "FORWARD", "-i", "wan0", "-j", "DROP"])

    def _shape(self, ns: str, dev: str) -> None:
        s = self.config.shaping
        assert s is not None
        tbf = ["tbf", "rate", s.rate, "burst", s.burst, "latency", s.latency]
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf])

    def namespaces(self) -> list[str]:
        router = [self.router_ns] if self.config.nated else []
        return [self.bridge_ns, *router] + [self.ns(i) for i in range(self.config.hosts)]

    def down(self) -> None:
        """Kills what still runs inside this network's namespaces, then deletes them. Safe to
        call twice, or after a partial `up`: what is already gone is skipped."""
        existing = set(list_namespaces())
        # The router's too when this Network was made without `nated` (`netns.py down`).
        named = dict.fromkeys([*self.namespaces(), self.router_ns])
        mine = [ns for ns in named if ns in existing]
        for ns in mine:
            kill_namespace_processes(ns)
        for ns in mine:
            _run(["ip", "netns", "del", ns], check=False)
        left = set(list_namespaces()) & set(mine)
        if left:
            raise NetnsError(f"could not delete namespaces {sorted(left)}")

    # -- faults -----------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Unplugs host ``i``: its switch port goes down; nothing gets in or out."""
        _run(["ip", "-n", *self._port(i), "down"])

    def heal(self, i: int) -> None:
        """Plugs host ``i`` back in."""
        _run(["ip", "-n", *self._port(i), "up"])

    def _port(self, i: int) -> list[str]:
        """`NS link set PORT` of host ``i``'s switch port."""
        self._check_host(i)
        if self.is_nated(i):
            return [self.router_ns, "link", "set", f"q{i}"]
        return [self.bridge_ns, "link", "set", f"p{i}"]

    def qdisc(self, i: int) -> str:
        """`tc qdisc show` of host ``i``'s interface (for checks and for humans)."""
        show = ["tc", "qdisc", "show", "dev", HOST_IF]
        return _run(["ip", "netns", "exec", self.ns(i), *show]).stdout


def list_namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def kill_namespace_processes(ns: str, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, every process inside ``ns`` (only processes started in it, which
    for a tagged namespace are the ones its owner started)."""

    def pids() -> list[int]:
        done = _run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids():
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create the bridge and N hosts")
    up.add_argument("--hosts", type=int, default=4)
    up.add_argument("--subnet", default="10.77.0.0/24")
    up.add_argument("--rate", default="20mbit", help="tbf rate per direction; 'none': no limit")
    up.add_argument("--burst", default="32kb")
    up.add_argument("--latency", default="100ms")
    up.add_argument("--nated", type=int, default=0, help="the last N hosts sit behind a NAT")
    for name in ("cut", "heal"):
        p = sub.add_parser(name, help=f"{name} host I")
        p.add_argument("host", type=int)
    down = sub.add_parser("down", help="kill what runs inside and delete the namespaces")
    down.add_argument("--hosts", type=int, default=200, help="(an upper bound is enough)")
    for p in sub.choices.values():
        p.add_argument("--tag", required=True)
    args = parser.parse_args(argv)
    try:
        hosts = args.hosts if args.command in ("up", "down") else 200
        shaping = (
            None
            if args.command != "up" or args.rate == "none"
            else Shaping(args.rate, args.burst, args.latency)
        )
        subnet = getattr(args, "subnet", "10.77.0.0/24")
        net = Network(NetnsConfig(args.tag, hosts, subnet, shaping, getattr(args, "nated", 0)))
        if args.command == "up":
            net.up()
            for i in range(hosts):
                print(f"{net.ns(i)} {net.ip(i)}")
        elif args.command == "down":
            net.down()
        elif args.command == "cut":
            net.cut(args.host)
        else:
            net.heal(args.host)
    except (NetnsError, ValueError, IndexError) as exc:
        print(f"netns: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

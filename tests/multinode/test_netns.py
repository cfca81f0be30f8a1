"""Four hosts with their own addresses on a shaped bridge: a run survives one host's outage.

The first test checks the harness itself (deploy/netns.py): addresses, the tbf rate, cut and
heal, teardown. In the second, each host is a network namespace on a private /24, every link
limited to 20 mbit/s each way by `tc tbf`. Host 0 runs the DHT bootstrap and the run's creator;
hosts 1-3 join. Once all four average together, host 3's switch port goes down: the other three
must keep completing outer steps without it, and after the port comes back host 3 must take the
group's state (a `synced` outer step or `state_synced`) and then average with all four again,
holding the same state hash as the others at that round. Needs root and iproute2; it fails
(never skips) where namespaces cannot be made, because CI runs as root and a skipped
multi-host test would pass by saying nothing.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.netns import NetnsConfig, NetnsError, Network, Shaping, check_usable
from tests.harness.netns import RUN, Event, Hosts, peers
from tests.harness.processes import HARNESS, ProcessGroup, swarmd_cmd

__all__ = ["peers"]  # the fixture

RATE_MBIT = 20
RATE = f"{RATE_MBIT}mbit"
HOSTS = 4
CUT = 3


def make_network(hosts: int) -> Network:
    try:
        check_usable()
    except NetnsError as exc:
        pytest.fail(f"multi-host test cannot run here: {exc}")
    # A fresh tag per run: parallel runs (or a leftover from a killed one) never clash.
    network = Network(NetnsConfig(secrets.token_hex(4), hosts, shaping=Shaping(rate=RATE)))
    try:
        network.up()  # removes what it made if it fails
    except NetnsError as exc:
        pytest.fail(f"multi-host test cannot run here: {exc}")
    return network


@pytest.fixture
def net() -> Iterator[Network]:
    network = make_network(HOSTS)
    try:
        yield network
    finally:
        network.down()


PROBE = [sys.executable, str(HARNESS / "netns_probe.py")]


def test_hosts_have_addresses_a_shaped_link_and_can_be_cut_and_healed(
    processes: ProcessGroup,
) -> None:
    net = make_network(2)
    try:
        assert f"rate {RATE.removesuffix('mbit')}Mbit" in net.qdisc(0)

        def transfer(nbytes: int) -> tuple[int, dict[str, Any]]:
            server = processes.start([*net.exec_prefix(1), *PROBE, "serve", net.ip(1), "5001"])
            send = [*PROBE, "send", net.ip(1), "5001", str(nbytes)]
            done = subprocess.run(net.exec_prefix(0) + send, capture_output=True, timeout=60)
            if done.returncode != 0:
                server.process.kill()
                return done.returncode, {}
            return 0, server.receive(timeout=30)

        # 2.5 MB over 20 mbit/s: about a second (measured 19.4 mbit/s).
        nbytes = 2_500_000
        code, got = transfer(nbytes)
        assert code == 0 and got["bytes"] == nbytes
        mbit_s = nbytes * 8 / got["seconds"] / 1e6
        print(f"host 0 -> host 1 through tbf {RATE}: {mbit_s:.1f} mbit/s")
        assert 0.3 * RATE_MBIT < mbit_s < 1.1 * RATE_MBIT
        net.cut(1)
        code, _ = transfer(1000)
        assert code == 3  # no connection within 2 s: the packets vanish
        net.heal(1)
        code, got = transfer(1000)
        assert code == 0 and got["bytes"] == 1000
    finally:
        net.down()
        net.down()  # idempotent
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in net.namespaces())


# 90-120 s measured on 2 cores shared with other work (load average ~15): over the default
# 120 s limit. Most of it is five processes starting (torch) and DiLoCo's 10 s gather deadline
# for the rounds that wait on a cut-off or lone peer.
@pytest.mark.timeout(400)
def test_four_hosts_one_cut_off_and_healed(
    net: Network, peers: ProcessGroup, tmp_path: Path
) -> None:
    assert f"rate {RATE.removesuffix('mbit')}Mbit" in net.qdisc(0)
    (tmp_path / "run.toml").write_text(RUN)
    boot = peers.start(
        net.exec_prefix(0)
        + swarmd_cmd("dht", "--listen", f"{net.ip(0)}:0", "--state-dir", str(tmp_path / "boot"))
    )
    assert boot.address.startswith(net.ip(0) + ":"), boot.info

    def join(i: int, *extra: str) -> list[str]:
        # Hosts 1 and 2 listen on every interface, as a server usually would.
        listen = "0.0.0.0:0" if i in (1, 2) else f"{net.ip(i)}:0"
        return net.exec_prefix(i) + swarmd_cmd(
            "join", "--run", "netns", "--peers", boot.address, "--listen", listen,
            "--log-format", "json", "--state-dir", str(tmp_path / f"h{i}"),
            "--progress-interval", "600", *extra,
        )  # fmt: skip

    procs = peers.start_many(
        [join(0, "--create-run", str(tmp_path / "run.toml"))] + [join(i) for i in range(1, HOSTS)]
    )
    for i, proc in enumerate(procs):
        # Each host advertises its own address on the bridge, not loopback nor 0.0.0.0.
        assert proc.info["address"].startswith(net.ip(i) + ":"), proc.info
    hosts = Hosts(procs)

    # 1. All four average together.
    hosts.wait(
        "an outer step averaged by all four hosts",
        lambda: all(
            any(e["status"] == "averaged" and e["group_size"] == HOSTS for e in hosts.outer(i))
            for i in range(HOSTS)
        ),
        timeout=150,
    )

    # 2. Host 3 is cut off; the others go on without it, and it goes on alone.
    net.cut(CUT)
    cut_at = time.time()
    rest = [i for i in range(HOSTS) if i != CUT]
    hosts.wait(
        "two outer steps averaged without the cut-off host on every other host, and one "
        "outer step of its own on the cut-off host",
        lambda: (
            all(
                sum(
                    e["status"] == "averaged" and 2 <= e["group_size"] < HOSTS
                    for e in hosts.outer(i, cut_at)
                )
                >= 2
                for i in rest
            )
            and any(e["status"] == "local" for e in hosts.outer(CUT, cut_at))
        ),
        timeout=90,
    )

    # 3. Healed, host 3 takes the group's state, then averages with all four again.
    net.heal(CUT)
    healed_at = time.time()

    def synced_at() -> float | None:
        return next(
            (
                e["time"]
                for e in hosts.events[CUT]
                if e["time"] >= healed_at
                and (e["event"] == "state_synced" or e.get("status") == "synced")
            ),
            None,
        )

    def rejoined() -> list[Event]:
        """Host 3's outer steps after its sync, averaged by all four, with the state hash
        another host logged for the same round."""
        after = synced_at()
        if after is None:
            return []
        theirs = {(e["round"], e["state_hash"]) for i in rest for e in hosts.outer(i)}
        return [
            e
            for e in hosts.outer(CUT, after)
            if e["status"] == "averaged"
            and e["group_size"] == HOSTS
            and (e["round"], e["state_hash"]) in theirs
        ]

    hosts.wait("the healed host catches up and averages with all", lambda: bool(rejoined()), 120)
    print(hosts.timeline())
    # The group never took up a state host 3 made alone: it follows the group, not the reverse.
    # (Only while the others stayed a group: had they all gone alone too, say a failed
    # all-reduce under load, any one lone state is as good as another.)
    lone = {e["state_hash"] for e in hosts.outer(CUT, cut_at) if e["status"] == "local"}
    held = {e["state_hash"] for i in rest for e in hosts.outer(i)}
    assert lone, hosts.timeline()
    if all(e["status"] in ("averaged", "synced") for i in rest for e in hosts.outer(i, cut_at)):
        assert not lone & held, hosts.timeline()

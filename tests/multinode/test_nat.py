"""Volunteers behind a real NAT (issue 27): network namespaces, a router with iptables
MASQUERADE in front of two of four hosts (deploy/netns.py), so the kernel refuses every
connection to them from outside. Nobody tells the NATed peers they are behind a NAT: the
bootstrap node dials each joiner back, fails for those two, and they train in client mode.

All four average together and agree on the state after every such round; the public peer that
is not the creator dies mid-run and the other three keep averaging (one reachable member
reduces everything); a NATed peer killed and restarted from its state directory resumes and
averages with the group again. Needs root, iproute2 and iptables; fails (never skips) without.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.netns import NetnsConfig, NetnsError, Network, Shaping
from tests.harness.join import events_until_exit
from tests.harness.netns import RUN, Event, Hosts, peers
from tests.harness.processes import ProcessGroup, swarmd_cmd

__all__ = ["peers"]  # the fixture, re-used

HOSTS, NATED = 4, 2
PUBLIC_VICTIM, NAT_VICTIM = 1, 3


@pytest.fixture
def net() -> Iterator[Network]:
    config = NetnsConfig(secrets.token_hex(4), HOSTS, shaping=Shaping(rate="50mbit"), nated=NATED)
    network = Network(config)
    try:
        network.up()
    except NetnsError as exc:
        pytest.fail(f"NAT test cannot run here: {exc}")
    try:
        yield network
    finally:
        network.down()


def _averaged_together(hosts: Hosts, members: list[int], size: int, since: float) -> set[int]:
    """Rounds after `since` that every host in `members` averaged in a group of `size`, each
    ending in one state."""
    by_round: dict[int, set[str]] = {}
    counts: dict[int, int] = {}
    for i in members:
        for e in hosts.outer(i, since):
            if e["status"] == "averaged" and e["group_size"] == size:
                by_round.setdefault(e["round"], set()).add(e["state_hash"])
                counts[e["round"]] = counts.get(e["round"], 0) + 1
    mismatched = {r for r, hashes in by_round.items() if len(hashes) > 1}
    assert not mismatched, hosts.timeline()
    return {r for r, n in counts.items() if n == len(members)}


class _Joiner:
    """Starts the bootstrap node on host 0; called with a host, the command that joins it."""

    def __init__(
        self, net: Network, peers: ProcessGroup, tmp: Path, run: str, *common: str
    ) -> None:
        self.net, self.tmp, self.run, self.common = net, tmp, run, common
        self.boot = peers.start(
            net.exec_prefix(0)
            + swarmd_cmd("dht", "--listen", f"{net.ip(0)}:0", "--state-dir", str(tmp / "boot"))
        ).address

    def __call__(self, i: int, *extra: str) -> list[str]:
        return self.net.exec_prefix(i) + swarmd_cmd(
            "join", "--run", self.run, "--peers", self.boot, "--listen", f"{self.net.ip(i)}:0",
            "--log-format", "json", "--state-dir", str(self.tmp / f"h{i}"),
            "--progress-interval", "600", *self.common, *extra,
        )  # fmt: skip


# Slow tier; default suite: one NATed peer with a public one, DiLoCo and DeMo (above).
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_of_four_behind_nat_train_with_the_rest(
    net: Network, peers: ProcessGroup, tmp_path: Path
) -> None:
    assert [net.is_nated(i) for i in range(HOSTS)] == [False, False, True, True]
    (tmp_path / "run.toml").write_text(RUN.replace("min_group_size = 2", "min_group_size = 3"))
    join = _Joiner(net, peers, tmp_path, "nat")

    procs = peers.start_many(
        [join(0, "--create-run", str(tmp_path / "run.toml"))] + [join(i) for i in range(1, HOSTS)]
    )
    hosts = Hosts(procs)

    def mode(i: int, since: float = 0.0) -> Event | None:
        return next(
            (e for e in hosts.events[i] if e["event"] == "reachability" and e["time"] >= since),
            None,
        )

    hosts.wait("every host's reachability", lambda: all(mode(i) for i in range(HOSTS)), 120)
    found = [mode(i) for i in range(HOSTS)]
    assert [m and m["mode"] for m in found] == ["server", "server", "client", "client"], found
    # The bootstrap saw the NATed hosts' calls come from the router's public address.
    for m in found[2:]:
        assert m is not None and m["observed"].startswith(net.router_ip + ":"), m

    # 1. All four average together, and agree.
    everyone = list(range(HOSTS))
    hosts.wait(
        "two rounds averaged by all four hosts",
        lambda: len(_averaged_together(hosts, everyone, HOSTS, 0.0)) >= 2,
        timeout=150,
    )

    # `swarmd status` shows who is in client mode (from each peer's signed state advert).
    status = subprocess.run(
        net.exec_prefix(0) + swarmd_cmd("status", "--run", "nat", "--peers", join.boot, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    shown = {p["peer_id"]: p["mode"] for p in json.loads(status.stdout)["peers"]}
    assert {shown.get(procs[i].info["peer_id"]) for i in (2, 3)} == {"client"}, shown
    assert {shown.get(procs[i].info["peer_id"]) for i in (0, 1)} == {"server"}, shown

    # 2. The public peer that is not the creator dies: the NATed peers depend on the one
    # reachable member left, and keep averaging with it.
    procs[PUBLIC_VICTIM].process.send_signal(signal.SIGKILL)
    procs[PUBLIC_VICTIM].process.wait(10)
    hosts.procs, hosts.events = (
        [p for i, p in enumerate(procs) if i != PUBLIC_VICTIM],
        [e for i, e in enumerate(hosts.events) if i != PUBLIC_VICTIM],
    )  # host indices below: 0 = host 0, 1 = host 2, 2 = host 3
    killed_at = time.time()
    hosts.wait(
        "two rounds averaged by host 0 and both NATed hosts without the dead public peer",
        lambda: len(_averaged_together(hosts, [0, 1, 2], 3, killed_at)) >= 2,
        timeout=120,
    )

    # 3. A NATed peer is killed and restarted from its state directory: it finds itself
    # unreachable again, resumes, and averages with the other two.
    procs[NAT_VICTIM].process.send_signal(signal.SIGKILL)
    procs[NAT_VICTIM].process.wait(10)
    restarted = peers.start(join(NAT_VICTIM))
    hosts.procs[2], hosts.events[2] = restarted, []
    back_at = time.time()
    hosts.wait(
        "the restarted NATed peer averages with the other two again",
        lambda: len(_averaged_together(hosts, [0, 1, 2], 3, back_at)) >= 1,
        timeout=150,
    )
    again = mode(2)
    assert again is not None and again["mode"] == "client", again
    print(hosts.timeline())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", ["diloco", "demo"])
def test_one_nated_peer_alone_with_one_public_peer(
    peers: ProcessGroup, tmp_path: Path, algo: str
) -> None:
    """The smallest group client mode allows: one peer to reduce everything (DiLoCo) or to
    pass every payload on (DeMo: the NATed peer pulls each step's), one behind NAT."""
    net = Network(NetnsConfig(secrets.token_hex(4), 2, shaping=None, nated=1))
    try:
        net.up()
    except NetnsError as exc:
        pytest.fail(f"NAT test cannot run here: {exc}")
    try:
        extra = 'algo = "demo"\ndemo_topk = 8\ndemo_chunk = 16\n' if algo == "demo" else ""
        (tmp_path / "run.toml").write_text(RUN + extra)
        join = _Joiner(net, peers, tmp_path, "pair", "--max-steps", "30")
        procs = peers.start_many([join(0, "--create-run", str(tmp_path / "run.toml")), join(1)])
        runs = [events_until_exit(p, timeout=180) for p in procs]
        assert all(p.process.returncode == 0 for p in procs), [p.stderr_tail for p in procs]
        modes = [next(e["mode"] for e in ev if e["event"] == "reachability") for ev in runs]
        assert modes == ["server", "client"], modes
        paired: dict[int, set[str]] = {}
        for events in runs:
            for e in events:
                if e["event"] == "outer_step" and e["status"] == "averaged":
                    paired.setdefault(e["round"], set()).add(e["state_hash"])
        both = {r: h for r, h in paired.items() if len(h) == 1}
        assert len(both) >= 3 and len(both) == len(paired), paired
    finally:
        net.down()

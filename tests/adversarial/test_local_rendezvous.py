"""A peer's local ranks are reachable from its own machine only (issue 47, item 7).

`--local-workers` used torchrun's TCPStore as the ranks' rendezvous. It listened on every
interface (`*:PORT`, whatever host it was given) and served any client's reads and writes,
so another host could read and set the ranks' keys. The rendezvous is now a file in the
peer's own directory, readable by its user alone, and gloo talks over loopback. This test
looks at every socket the peer and its rank listen on while they train, from /proc.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

from tests.harness.join import join_cmd, start_bootstrap, wait_for
from tests.harness.processes import ProcessGroup
from tests.harness.runs import TINY_RUN

#: /proc/net/tcp's state for a listening socket.
LISTEN = "0A"


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A /proc/net/tcp{,6} local address (each 32-bit word in host byte order)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the processes `pids` listen on."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except FileNotFoundError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                addr, port = local.split(":")
                found.append((str(_address(addr)), int(port, 16)))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def test_a_two_rank_peer_listens_on_loopback_only_and_keeps_its_rendezvous_private(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    (tmp_path / "run.toml").write_text(TINY_RUN)
    boot = start_bootstrap(processes, tmp_path)
    (peer,) = processes.start_many(
        [
            join_cmd(
                tmp_path, "p0", boot, "--create-run", str(tmp_path / "run.toml"),
                "--local-workers", "2", steps=100_000,
            )
        ]
    )  # fmt: skip
    ranks = wait_for(peer, "local_ranks", timeout=120)
    # The ranks' process group is up once the peer takes its first inner steps.
    wait_for(peer, "training", timeout=120)
    pids = [peer.pid, *ranks["pids"]]
    sockets = _listening(pids)
    # The peer's own RPC port is there (tests listen on 127.0.0.1), and nothing else is
    # reachable from another host: the old TCPStore showed up here as `::` (every interface).
    assert sockets, "the peer listens on nothing?"
    exposed = [(a, p) for a, p in sockets if not _loopback(a)]
    assert not exposed, (exposed, sockets)
    local = tmp_path / "p0" / "local"
    assert stat.S_IMODE(local.stat().st_mode) == 0o700, oct(local.stat().st_mode)
    stores = list(local.glob("rendezvous-*"))
    assert len(stores) == 1, stores

"""The address a peer tells others to call it at, when it listens on every interface.

`--listen 0.0.0.0:7000` (or `[::]:7000`) is how a server is usually told to accept calls from
anywhere, but 0.0.0.0 is no address to give to others: a peer that advertised it in its state
adverts and matchmaking announcements was called by every other host at *their own* 0.0.0.0,
so each host trained alone (seen on network-namespace hosts: every state sync failed with
"connection refused", every round was local). The DHT is not affected, since it takes the IP a
call comes from. So a peer listening on an unspecified address advertises the local address
its host uses to reach its bootstrap peers: the kernel's route lookup for a UDP socket
`connect` (no packet is sent) names the interface that faces them.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence

from swarmd.protocol.address import Address, parse_address

log = logging.getLogger("swarmd.advertise")


def _local_ip_towards(peer: Address, ipv6_ok: bool) -> str | None:
    try:
        infos = socket.getaddrinfo(peer.host, peer.port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        if family == socket.AF_INET6 and not ipv6_ok:
            continue
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return None


def advertised_address(bound: Address, peers: Sequence[str]) -> Address:
    """``bound`` (where the server listens), with an unspecified host (0.0.0.0, ::) replaced
    by this host's address towards the first of ``peers`` that has a route; unchanged if the
    host is a specific address or a name, or if no peer has a route (then a warning says so).
    Blocking (it may resolve names): call it from a worker thread."""
    try:
        ip = ipaddress.ip_address(bound.host)
    except ValueError:
        return bound  # a host name: others resolve it themselves
    if not ip.is_unspecified:
        return bound
    for text in peers:
        try:
            peer = parse_address(text)
        except ValueError:
            continue
        # A socket bound to 0.0.0.0 takes IPv4 only; one bound to :: takes both.
        local = _local_ip_towards(peer, ipv6_ok=ip.version == 6)
        if local is not None:
            return Address(local, bound.port)
    log.warning(
        "listening on %s but no bootstrap peer to find this host's address from: other hosts "
        "cannot reach %s; pass --listen with this host's address",
        bound,
        bound,
    )
    return bound

"""HOST:PORT parsing with errors a user can act on."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, *, allow_port_zero: bool = False) -> Address:
    """Parses ``host:port`` or ``[v6]:port``; raises ValueError saying what is wrong."""
    text = text.strip()
    if not text:
        raise ValueError("empty address; expected HOST:PORT")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad address {text!r}; expected [IPv6]:PORT")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bad address {text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"bad address {text!r}; expected HOST:PORT, e.g. 127.0.0.1:7000")
        if ":" in host:
            raise ValueError(f"bad address {text!r}; write IPv6 addresses as [ADDR]:PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"bad address {text!r}: port {port_text!r} is not a number") from None
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"bad address {text!r}: port must be in {low}..65535")
    return Address(host, port)


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def peer_ip(transport_peer: str) -> IPAddress | None:
    """The IP a call came from, as a transport names its peer: gRPC's "ipv4:1.2.3.4:5" and
    "ipv6:[::1]:5" (or %5B-escaped), the bulk listener's "ipv6:::1:5", a plain "1.2.3.4:5".
    None if it names no IP (a Unix socket). A dual-stack listener sees IPv4 callers as
    ::ffff:a.b.c.d: they are returned as the IPv4 they are, so that quotas and rate limits
    keyed by address do not lump every IPv4 caller into one IPv6 network."""
    scheme, rest = transport_peer[:4], transport_peer[5:]
    if scheme not in ("ipv4", "ipv6"):
        scheme, rest = "", transport_peer
    rest = rest.replace("%5B", "[").replace("%5D", "]")
    if rest.startswith("["):
        host = rest[1 : rest.find("]")]
    elif scheme or rest.count(":") == 1:
        host = rest.rpartition(":")[0]
    else:
        host = rest
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def address_key(peer: str) -> str:
    """The key a transport peer is limited by (see `peer_ip`): its IP, or its IPv6 /64, which
    one subscriber usually holds whole."""
    ip = peer_ip(peer)
    if ip is None:
        return peer
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)

"""Token buckets per address and per peer (issue 31, item 4)."""

from __future__ import annotations

import pytest

from swarmd.protocol._rate_limit import RateLimiter, RateLimits
from swarmd.protocol.address import address_key
from swarmd.protocol.calls import RpcError, StatusCode, rate_limited, retry_after


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _served(allow: object, n: int) -> int:
    return sum(1 for _ in range(n) if allow())  # type: ignore[operator]


def test_a_peer_gets_its_burst_then_its_rate() -> None:
    clock = _Clock()
    limiter = RateLimiter(RateLimits(per_peer_rate=10, per_peer_burst=50), clock)
    assert _served(lambda: limiter.allow_peer("p"), 80) == 50
    clock.now += 2.0  # 20 tokens back, not more
    assert _served(lambda: limiter.allow_peer("p"), 80) == 20
    clock.now += 1000.0  # never more than the burst
    assert _served(lambda: limiter.allow_peer("p"), 80) == 50
    assert limiter.peak_use["peer"] == 1.0


def test_a_refusal_names_the_wait_until_the_bucket_holds_a_token() -> None:
    clock = _Clock()
    limiter = RateLimiter(RateLimits(per_peer_rate=10, per_peer_burst=2), clock)
    assert limiter.peer_wait("p") == limiter.peer_wait("p") == 0.0
    assert limiter.peer_wait("p") == pytest.approx(0.1)
    clock.now += 0.04
    assert limiter.peer_wait("p") == pytest.approx(0.06)
    clock.now += 0.06
    assert limiter.peer_wait("p") == 0.0


def test_the_wait_travels_in_the_refusal_and_only_a_rate_limit_names_one() -> None:
    refusal = rate_limited("peer", 0.0123)
    assert refusal.code is StatusCode.RESOURCE_EXHAUSTED
    assert retry_after(refusal) == pytest.approx(0.013)  # whole milliseconds, rounded up
    assert retry_after(rate_limited("address", 0.0)) == pytest.approx(0.001)
    assert retry_after(RpcError(StatusCode.RESOURCE_EXHAUSTED, "stage server busy")) is None
    assert retry_after(RpcError(StatusCode.UNAVAILABLE, refusal.details)) is None
    # A server naming an absurd wait is not parsed into one (the client caps it too).
    assert retry_after(RpcError(StatusCode.RESOURCE_EXHAUSTED, "x: retry in 99999999 ms")) is None


def test_peers_and_addresses_have_their_own_buckets() -> None:
    limiter = RateLimiter(
        RateLimits(per_peer_rate=1, per_peer_burst=5, per_address_rate=1, per_address_burst=7),
        _Clock(),
    )
    assert _served(lambda: limiter.allow_peer("greedy"), 10) == 5
    assert _served(lambda: limiter.allow_peer("honest"), 10) == 5
    # One host's ports share a bucket; another host has its own.
    assert _served(lambda: limiter.allow_address("ipv4:127.0.0.2:4000"), 5) == 5
    assert _served(lambda: limiter.allow_address("ipv4:127.0.0.2:4001"), 5) == 2
    assert _served(lambda: limiter.allow_address("ipv4:127.0.0.1:4000"), 5) == 5


def test_peak_use_reports_how_near_honest_traffic_came() -> None:
    limiter = RateLimiter(RateLimits(per_peer_burst=100), _Clock())
    _served(lambda: limiter.allow_peer("p"), 25)
    assert limiter.peak_use == {"peer": pytest.approx(0.25), "address": 0.0}


def test_forgotten_keys_are_bounded() -> None:
    clock = _Clock()
    limiter = RateLimiter(RateLimits(per_peer_burst=2, max_tracked=3), clock)
    for i in range(1000):  # a flood of fresh identities
        limiter.allow_peer(f"fresh{i}")
    assert len(limiter._buckets) == 3


def test_disabled_limits_allow_everything() -> None:
    limiter = RateLimiter(RateLimits(per_peer_burst=1, enabled=False), _Clock())
    assert _served(lambda: limiter.allow_peer("p"), 100) == 100


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        ("ipv4:127.0.0.1:5000", "127.0.0.1"),
        ("ipv6:[2001:db8:1:2:3::1]:80", "2001:db8:1:2::/64"),
        ("ipv6:%5B2001:db8::5%5D:80", "2001:db8::/64"),
        ("ipv6:2001:db8:1:2:3::1:443", "2001:db8:1:2::/64"),  # the bulk listener's form
        ("ipv6:[::ffff:10.0.0.7]:9", "10.0.0.7"),
        ("10.1.2.3:5", "10.1.2.3"),
    ],
)
def test_address_keys(peer: str, key: str) -> None:
    assert address_key(peer) == key


@pytest.mark.parametrize(
    "changes",
    [
        {"per_peer_rate": 0.5},
        {"per_address_burst": float("nan")},
        {"per_peer_rate": 100, "per_address_rate": 10},
        {"max_tracked": 0},
    ],
)
def test_limits_are_validated(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RateLimits(**changes)  # type: ignore[arg-type]

"""Bans (swarmd/node/bans.py): evidence bans at once and for longer on each repeat, strikes
ban only when they gather, and bans run out; on a fake clock."""

from __future__ import annotations

import pytest

from swarmd.node.bans import BanConfig, Bans, Rejection
from swarmd.protocol.identity import Identity, PeerId


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Seen:
    def __init__(self) -> None:
        self.offences: list[str] = []
        self.bans: list[tuple[PeerId, float, str]] = []

    def on_ban(self, offence: str) -> None:
        self.offences.append(offence)


def make() -> tuple[Bans, Clock, Seen, PeerId]:
    clock, seen = Clock(), Seen()
    cfg = BanConfig(first_s=60, growth=4, max_s=3600, strikes=3, strike_window_s=600)
    bans = Bans(
        cfg, clock=clock, observer=seen, on_ban=lambda p, s, w: seen.bans.append((p, s, str(w)))
    )
    return bans, clock, seen, Identity.generate().peer_id


NAN = Rejection("non-finite values", "non_finite")
OUTLIER = Rejection("norm 40 > 10 x group median 1", "outlier")


def test_evidence_bans_at_once_and_longer_each_time() -> None:
    bans, clock, seen, peer = make()
    other = Identity.generate().peer_id
    assert bans.offence(peer, NAN) == 60
    assert bans.banned(peer) and not bans.banned(other) and bans.active() == 1
    assert bans.reason(peer) == "non-finite values"
    clock.now += 30
    assert bans.offence(peer, NAN) == pytest.approx(30)  # already banned: the same episode
    clock.now += 31
    assert not bans.banned(peer) and bans.active() == 0 and bans.reason(peer) == ""
    assert bans.offence(peer, NAN) == 240  # second ban: 4x
    clock.now += 241
    assert bans.offence(peer, NAN) == 960
    clock.now += 961
    assert bans.offence(peer, NAN) == 3600  # capped
    assert seen.offences == ["non_finite"] * 4
    assert [s for _, s, _ in seen.bans] == [60, 240, 960, 3600]
    assert seen.bans[0][0] == peer and "non-finite" in seen.bans[0][2]


def test_strikes_ban_only_when_they_gather() -> None:
    bans, clock, seen, peer = make()
    for _ in range(2):
        assert bans.offence(peer, OUTLIER) == 0
        clock.now += 400
    # The first strike is 800 s old: out of the 600 s window, so this is the second again.
    assert bans.offence(peer, OUTLIER) == 0 and not bans.banned(peer)
    assert bans.offence(peer, OUTLIER) == 60 and bans.banned(peer)
    assert seen.offences == ["outlier"]
    clock.now += 61
    assert bans.offence(peer, OUTLIER) == 0  # strikes start over after a ban


def test_bad_config_is_refused() -> None:
    for bad in (
        {"first_s": 0},
        {"first_s": 10, "max_s": 5},
        {"growth": 0.5},
        {"strikes": -1},
        {"strike_window_s": 0},
    ):
        with pytest.raises(ValueError):
            BanConfig(**bad)  # type: ignore[arg-type]


def test_one_episode_is_one_strike() -> None:
    """A reducer and a member may both see one bad update in one round: one strike."""
    bans, _, _, peer = make()
    for _ in range(5):
        assert bans.offence(peer, OUTLIER, episode="round-a") == 0
    assert bans.offence(peer, OUTLIER, episode="round-b") == 0
    assert bans.offence(peer, OUTLIER, episode="round-c") == 60


def test_by_default_outliers_never_ban() -> None:
    """An honest peer can be a steady outlier: only evidence bans unless strikes are set."""
    bans, peer = Bans(clock=Clock()), Identity.generate().peer_id
    for k in range(10):
        assert bans.offence(peer, OUTLIER, episode=f"round-{k}") == 0
    assert not bans.banned(peer)
    assert bans.offence(peer, NAN) == BanConfig().first_s


def test_a_peer_never_bans_itself() -> None:
    """A reducer checks its own contribution too: a liar's own weight is refused, but it
    does not log a ban of itself (seen in `swarmd chaos --byzantine`)."""
    me, other = Identity.generate().peer_id, Identity.generate().peer_id
    bans = Bans(own=me)
    evidence = Rejection("weight 1e+09 > bound 2.56e+03", "bad_weight")
    assert bans.offence(me, evidence) == 0.0 and not bans.banned(me)
    assert bans.offence(other, evidence) > 0 and bans.banned(other)

"""SharedState.catch_up with a DHT of canned adverts: which adverts it reads, and which it hands
to the download (swarmd.node.peer.sharedstate; the rule itself is test_catchup's)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import trio
import trio.testing

from swarmd.node.algorithms.demo.timings import DemoTimings
from swarmd.node.algorithms.swarm.timings import SwarmTimings
from swarmd.node.averaging.matchmaking import MatchmakingConfig
from swarmd.node.bans import Bans, Rejection
from swarmd.node.dht.values import Value
from swarmd.node.peer import sharedstate
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.membership import MembershipTimings
from swarmd.node.peer.runend import leave_on_one_state
from swarmd.node.peer.sharedstate import SharedState, SyncedState
from swarmd.node.peer.state_timings import StateTimings
from swarmd.node.statesync.donor import StateAdvert
from swarmd.node.statesync.snapshot import HASH_BYTES
from swarmd.node.timing import TimingProfile
from swarmd.protocol.identity import Identity, PeerId


def h(name: str) -> bytes:
    return name.encode().ljust(HASH_BYTES, b"\0")


class FakeDHT:
    def __init__(self, adverts: dict[PeerId, StateAdvert]) -> None:
        self.adverts = adverts

    async def get_map(self, key: str) -> dict[str, Value]:
        return {str(p): Value(a.to_bytes(), 1e12, p) for p, a in self.adverts.items()}


def shared_state(
    tmp_path: Path,
    adverts: dict[PeerId, StateAdvert],
    creator: PeerId,
    live: set[PeerId] | None = None,
    timings: TimingProfile | None = None,
) -> tuple[SharedState, list[list[StateAdvert]]]:
    """``live``: the peers whose heartbeats are live (default: every advert's owner)."""
    alive = set(adverts) if live is None else live

    async def addresses() -> dict[PeerId, str]:
        return {p: "127.0.0.1:1" for p in alive}

    async def count() -> int:
        return len(alive) + 1  # and this peer

    peer = SimpleNamespace(
        live=SimpleNamespace(addresses=addresses, count=count),
        opts=SimpleNamespace(state_dir=tmp_path),
        identity=Identity.generate(),
        creator=creator,
        config=SimpleNamespace(name="r", hash="h"),
        dht=FakeDHT(adverts),
        averager=SimpleNamespace(bans=Bans()),  # whom the peer refuses: nobody here
        timings=timings or TimingProfile(),
    )
    opt = SimpleNamespace(age=5)
    state = SharedState(cast(PeerContext, peer), cast(SyncedState, opt))
    state.last_hash, state.shared_round, state.proven = h("mine"), 5, True
    synced: list[list[StateAdvert]] = []

    async def sync(donors: list[StateAdvert]) -> bool:
        synced.append(donors)
        return True

    cast(Any, state)._sync_from_group = sync
    return state, synced


def test_a_peer_that_met_nobody_downloads_the_creators_state_from_the_creator(
    tmp_path: Path,
) -> None:
    # A peer whose state is shared only in the sense that it started from the seeded init
    # (it met nobody yet) sees the creator's shared state, which only the creator holds, and
    # two strangers' other state: the creator's is taken, and from the creator (the filter
    # for peers that met nobody keeps only states several keys hold: it must not empty the
    # donor list).
    creator = Identity.generate().peer_id
    strangers = [Identity.generate().peer_id for _ in range(2)]
    adverts = {creator: StateAdvert(5, h("c"), "127.0.0.1:1", 10, shared=True)}
    adverts |= {
        p: StateAdvert(5, h("x"), f"127.0.0.{i + 2}:1", 10) for i, p in enumerate(strangers)
    }
    state, synced = shared_state(tmp_path, adverts, creator)
    assert trio.run(state.catch_up)
    assert [[(a.owner, a.state_hash) for a in donors] for donors in synced] == [
        [(str(creator), h("c"))]
    ]


def test_strangers_are_ignored_but_the_creator_is_read(tmp_path: Path) -> None:
    creator, friend, stranger = (Identity.generate().peer_id for _ in range(3))
    adverts = {
        creator: StateAdvert(5, h("mine"), "127.0.0.1:1", 10, shared=True),
        friend: StateAdvert(5, h("mine"), "127.0.0.2:1", 10, shared=True),
        stranger: StateAdvert(6, h("s"), "127.0.0.3:1", 10, shared=True),
    }
    state, synced = shared_state(tmp_path, adverts, creator)
    state.met = {str(friend)}
    assert not trio.run(state.catch_up)  # the creator holds this peer's state: nothing to take
    assert synced == []
    owners = {a.owner for a in trio.run(lambda: state.adverts(known_only=True))}
    assert owners == {str(creator), str(friend)}


def test_a_peer_whose_met_peers_all_left_follows_what_several_others_hold(
    tmp_path: Path,
) -> None:
    """The creator's only partner, the creator killed: it never met the two peers that joined
    meanwhile and average together, and made lone rounds since. It follows their state (two
    hold it), as a joiner would; while a peer it met is live, strangers stay ignored."""
    creator, joiners = Identity.generate().peer_id, [Identity.generate().peer_id for _ in range(2)]
    adverts = {p: StateAdvert(5, h("g"), f"127.0.0.{i}:1", 10) for i, p in enumerate(joiners)}
    state, synced = shared_state(tmp_path, adverts, creator, live=set(joiners))
    state.met, state.shared_round = {str(creator)}, 3  # rounds 4 and 5 alone
    assert trio.run(state.catch_up)
    assert [{a.owner for a in donors} for donors in synced] == [{str(p) for p in joiners}]
    # The creator still heartbeats (killed less than 30 s ago, or alive): strangers ignored.
    state, synced = shared_state(tmp_path, adverts, creator, live={creator, *joiners})
    state.met, state.shared_round = {str(creator)}, 3
    # It waits out `lone_wait_s` for the creator's advert of the round: in virtual time.
    assert not trio.run(state.catch_up, clock=trio.testing.MockClock(autojump_threshold=0))
    assert synced == []


@pytest.mark.parametrize("other", ["stranger", "banned"])
def test_a_peer_does_not_wait_for_adverts_it_would_not_read(tmp_path: Path, other: str) -> None:
    """An honest member of a group of three whose all-reduce left its partner's contribution
    out of a part (opposed to both others' for a round) did not count that round as shared,
    and waited for the adverts of every live peer, the liar included: a peer it never
    averaged with, whose adverts it does not read. It sat out all of `lone_wait_s` although
    its partner had advertised their common state, and the two others met the next round
    as a pair without it (CI: the run's last round then ended on two states)."""
    creator, liar = Identity.generate().peer_id, Identity.generate().peer_id
    adverts = {
        creator: StateAdvert(5, h("mine"), "127.0.0.1:1", 10, shared=True),
        liar: StateAdvert(5, h("mine"), "127.0.0.2:1", 10, shared=True),
    }
    state, synced = shared_state(tmp_path, adverts, creator, live={creator, liar})
    state.met, state.shared_round = {str(creator)}, 4  # round 5 counted as not shared
    if other == "banned":
        state.met.add(str(liar))  # met in an earlier round, banned since
        bans: Bans = cast(Any, state.peer).averager.bans
        assert bans.offence(liar, Rejection("signed two different proofs", "false_data"))

    async def main() -> float:
        t0 = trio.current_time()
        assert not await state.catch_up()  # the creator holds this peer's state
        return trio.current_time() - t0

    waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert waited < state.timings.lone_poll_s, waited
    assert synced == []


def test_the_runs_end_does_not_wait_for_a_peer_banned_since_it_was_met(tmp_path: Path) -> None:
    """At the run's end a peer waits until every live peer it met advertises the last round's
    state; one it banned since (an equivocator it averaged with before it lied) advertises
    nothing `adverts` shows, and held it all of `end_wait_s`, then warned that the run had
    not ended on one state although every peer it reads had."""
    creator, liar = Identity.generate().peer_id, Identity.generate().peer_id
    adverts = {
        creator: StateAdvert(5, h("mine"), "127.0.0.1:1", 10, shared=True),
        liar: StateAdvert(5, h("lie"), "127.0.0.2:1", 10, shared=True),
    }
    state, synced = shared_state(tmp_path, adverts, creator, live={creator, liar})
    state.met = {str(creator), str(liar)}
    bans: Bans = cast(Any, state.peer).averager.bans
    assert bans.offence(liar, Rejection("signed two different proofs", "false_data"))

    async def took() -> None:
        raise AssertionError("nothing to take: every peer it reads holds its state")

    async def main() -> tuple[bool, float]:
        t0 = trio.current_time()
        return await leave_on_one_state(state, took), trio.current_time() - t0

    ended, waited = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ended and waited < state.timings.lone_poll_s, waited
    assert synced == []


def test_a_lone_peer_waits_as_long_as_its_timing_profile_says(tmp_path: Path) -> None:
    """The wait for the others' adverts is the profile's `lone_wait_s`, not a constant: a
    simulated or tuned run changes it in one place (node/timing.py)."""
    creator, joiner = Identity.generate().peer_id, Identity.generate().peer_id
    adverts = {joiner: StateAdvert(5, h("g"), "127.0.0.1:1", 10)}
    waited = []
    for lone_wait_s in (2.0, 6.0):
        timings = TimingProfile(state=StateTimings(lone_wait_s=lone_wait_s, lone_poll_s=0.5))
        state, synced = shared_state(
            tmp_path, adverts, creator, live={creator, joiner}, timings=timings
        )
        state.met, state.shared_round = {str(creator)}, 3

        async def main(state: SharedState = state) -> None:
            t0 = trio.current_time()
            assert not await state.catch_up()
            waited.append(trio.current_time() - t0)

        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        assert synced == []
    assert waited == [pytest.approx(2.0, abs=0.5), pytest.approx(6.0, abs=0.5)]


def test_timings_that_contradict_each_other_fail_when_the_profile_is_made() -> None:
    TimingProfile()  # the defaults hold
    with pytest.raises(ValueError, match="heartbeat"):
        MembershipTimings(live_max_age_s=45.0)  # counts peers whose heartbeats lapsed
    with pytest.raises(ValueError, match="end_wait_s"):
        StateTimings(lone_wait_s=40.0)  # the run's end gives up before a lone peer settles
    with pytest.raises(ValueError, match="outlast"):
        TimingProfile(matchmaking=MatchmakingConfig(gather_s=10.0, ttl_s=15.0))
    with pytest.raises(ValueError, match="two refreshes"):
        SwarmTimings(record_ttl_s=5.0, refresh_s=3.0)  # one late refresh drops a live server
    with pytest.raises(ValueError, match="regroup_wait_s"):
        DemoTimings(retry_gather_s=90.0)  # no retry fits in the regrouping wait
    with pytest.raises(ValueError, match="drain_s"):
        SwarmTimings(drain_s=0.0)


@pytest.mark.parametrize("donor", ["creator", "met peer"])
def test_the_creators_state_is_taken_however_worse_on_this_peers_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, donor: str
) -> None:
    """A creator that trained its shard alone after a failed first round held a state whose
    validation loss was 4.8 against the others' 3.3; each peer refused it every round as
    worse than its own, and four peers stayed on four lines after a cut healed (simulated).
    The creator's state is taken (its advert is as trusted as its config); a state only a
    peer met before holds, as much worse, is still refused."""
    creator, friend = Identity.generate().peer_id, Identity.generate().peer_id
    owner = creator if donor == "creator" else friend
    advert = StateAdvert(6, h("w"), "127.0.0.1:1", 10, owner=str(owner), shared=True)
    state, _ = shared_state(tmp_path, {owner: advert}, creator)
    offered = {"w": torch.ones(3)}
    loaded: list[dict[str, torch.Tensor]] = []
    opt = cast(Any, state.opt)
    opt.state_dict, opt.load_state_dict = (lambda: {"w": torch.zeros(3)}), loaded.append
    cast(Any, state.peer).out = SimpleNamespace(event=lambda *a, **k: None)
    cast(Any, state.peer).client = None
    state.judge = lambda s: (4.8, 3.3)

    async def download(*args: object, **kwargs: object) -> object:
        meta = {"config": "h"}
        return SimpleNamespace(meta=meta, round=6, to_state_dict=lambda: offered)

    monkeypatch.setattr(sharedstate, "download_state", download)
    took = trio.run(SharedState._sync_from_group, state, [advert])
    assert took == (donor == "creator")
    assert loaded == ([offered] if took else [])
    assert (h("w") in state.refused) == (not took)

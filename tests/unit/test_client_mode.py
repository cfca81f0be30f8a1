"""Client-mode pieces that need no network (issue 27): who reduces which part, which adverts
are donors, which strategies take a peer nobody can dial, and the dial-back's limits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from swarmd.node.algorithms.registry import strategy_for
from swarmd.node.averaging.allreduce import AllReduceConfig
from swarmd.node.averaging.announcements import Commitment, View
from swarmd.node.averaging.group import Group, Member, part_bounds
from swarmd.node.averaging.round import Round
from swarmd.node.dht.dialback import DialBackLimits, Reachability
from swarmd.node.peer.options import JoinOptions
from swarmd.node.statesync.donor import StateAdvert, choose_donors
from swarmd.protocol.identity import Identity


def _group(clients: list[bool]) -> Group:
    ids = sorted(Identity.generate().peer_id for _ in clients)
    members = tuple(
        Member(p, f"127.0.0.1:{7000 + i}", client=c)
        for i, (p, c) in enumerate(zip(ids, clients, strict=True))
    )
    return Group(b"r" * 32, members)


def test_clients_get_empty_parts_and_are_never_reducers() -> None:
    group = _group([True, False, True, False])
    assert group.servers == (1, 3)
    rnd = Round(group, 0, 1000, AllReduceConfig(codec="fp32"), "fp32")
    assert [e - s for s, e in rnd.bounds] == [0, 500, 0, 500]
    assert [rnd.exchanged(j) for j in range(4)] == [False, True, False, True]
    assert rnd.attempts == 2
    # Part 1's fallback is member 3, and back; never a client.
    assert [rnd.reducer_of(1, a) for a in range(2)] == [1, 3]
    assert [rnd.reducer_of(3, a) for a in range(2)] == [3, 1]


def test_a_group_of_only_clients_and_an_all_zero_split_are_refused() -> None:
    with pytest.raises(ValueError, match="only unreachable"):
        _group([True, True])
    with pytest.raises(ValueError, match="positive total bandwidth"):
        part_bounds(10, [0.0, 0.0])
    assert part_bounds(10, [0.0, 1.0, 1.0]) == [(0, 0), (0, 5), (5, 10)]


def test_client_adverts_count_but_are_not_donors() -> None:
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    client = StateAdvert(7, h2, "192.168.1.5:7000", 10, client=True)
    assert StateAdvert.from_bytes(client.to_bytes()) == client
    adverts = [StateAdvert(6, h1, "10.0.0.1:7000", 10), client]
    # The newest state is a client's only: the newest a donor serves is chosen instead.
    assert choose_donors(adverts) == (h1, ["10.0.0.1:7000"])
    with pytest.raises(ValueError, match="dialled"):
        choose_donors([client])


def test_which_strategies_take_a_peer_nobody_can_dial(tmp_path: Path) -> None:
    opts = JoinOptions(run="r", state_dir=tmp_path)
    assert strategy_for("diloco").needs_reachable(opts) is None
    assert strategy_for("streaming-diloco").needs_reachable(opts) is None
    assert strategy_for("demo").needs_reachable(opts) is None
    assert "--role trainer" in (strategy_for("swarm").needs_reachable(opts) or "")
    trainer = JoinOptions(run="r", state_dir=tmp_path, role="trainer")
    assert strategy_for("swarm").needs_reachable(trainer) is None
    with pytest.raises(ValueError, match="reachable"):
        JoinOptions(run="r", state_dir=tmp_path, reachable="maybe")


def test_dial_back_limits_and_verdicts() -> None:
    with pytest.raises(ValueError):
        DialBackLimits(per_address=0)
    with pytest.raises(ValueError):
        DialBackLimits(dial_timeout_s=0)
    assert Reachability("unreachable").client_mode
    assert not Reachability("unknown").client_mode and not Reachability("reachable").client_mode


def test_a_leader_that_misstates_a_members_announcement_is_not_followed() -> None:
    """A leader that marked the other reachable member a client would reduce everything
    alone, with no fallback and nobody to cross-check it."""
    me, leader, other = _group([False, False, False]).members
    view = View.__new__(View)  # its reads need a DHT; the check needs only what was read
    view.visible = {m.peer_id: m for m in (me, leader, other)}
    honest = Commitment(leader.peer_id, b"", (me, leader, other))
    lying = Commitment(leader.peer_id, b"", (me, leader, replace(other, client=True)))
    assert view._faithful(honest)
    assert not view._faithful(lying)
    # Members not read yet cannot be checked (the others read them).
    del view.visible[other.peer_id]
    assert view._faithful(lying)

"""The stage follow rule: every unsure server of a split stage picks the same state."""

from __future__ import annotations

from dataclasses import dataclass

from swarmd.node.algorithms.swarm.follow import countable, state_to_follow

X, Y, Z = b"x" * 32, b"y" * 32, b"z" * 32


def test_a_lone_server_takes_the_majority_state() -> None:
    assert state_to_follow(Y, 7, [(X, 7), (X, 7)]) == X


def test_a_server_ahead_of_its_stage_in_rounds_still_takes_the_majority_state() -> None:
    # The CI split: the majority's round overran a period, the lone server's did not, so its
    # round counter ran ahead. It must come back, and the majority must not go to it.
    assert state_to_follow(Y, 23, [(X, 21), (X, 21)]) == X
    assert state_to_follow(X, 21, [(X, 21), (Y, 23)]) == X


def test_every_server_of_a_two_way_split_picks_the_same_state() -> None:
    # Two servers each on their own state: both pick by the later round, then the higher hash.
    assert state_to_follow(X, 5, [(Y, 6)]) == Y
    assert state_to_follow(Y, 6, [(X, 5)]) == Y
    assert state_to_follow(X, 5, [(Z, 5)]) == Z
    assert state_to_follow(Z, 5, [(X, 5)]) == Z


def test_a_server_with_no_other_advert_keeps_its_own() -> None:
    assert state_to_follow(X, 3, []) == X


def test_three_states_the_most_held_wins() -> None:
    others = [(X, 4), (Y, 9), (Z, 4), (Z, 4)]
    assert state_to_follow(X, 4, others) == Z


@dataclass(frozen=True)
class Ad:
    owner: str
    state_hash: bytes
    round: int


def test_a_strangers_advert_counts_only_for_a_state_a_met_server_holds() -> None:
    # The joiner c grouped with b; a met only b. c's advert of b's state counts for it, so a
    # (alone on Y) takes X instead of keeping Y on a hash tie-break.
    ads = [Ad("b", X, 7), Ad("c", X, 7)]
    counted = countable(ads, {"b"}, Y)
    assert counted == ads and state_to_follow(Y, 7, ((a.state_hash, a.round) for a in counted)) == X
    # Strangers agreeing on a state nobody met holds do not count, however many.
    sybils = [Ad(f"s{i}", Z, 99) for i in range(5)]
    assert countable([Ad("b", X, 7), *sybils], {"b"}, Y) == [Ad("b", X, 7)]
    # A stranger holding this server's own state counts for it.
    assert countable([Ad("s", Y, 7)], {"b"}, Y) == [Ad("s", Y, 7)]
    # A server that has met nobody (a joiner before its first round) counts every advert.
    assert countable(sybils, set(), Y) == sybils

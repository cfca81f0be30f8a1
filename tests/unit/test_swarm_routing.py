"""SWARM's decisions without a network: which server a trainer calls, when a server moves."""

from __future__ import annotations

import random
import types
from collections.abc import Generator
from typing import cast

import pytest
import torch

from swarmd.node.algorithms.swarm import audit
from swarmd.node.algorithms.swarm.directory import StageRecord, by_stage
from swarmd.node.algorithms.swarm.rebalance import choose_move, contest, stage_rates
from swarmd.node.algorithms.swarm.router import MAX_BAN_S, Router
from swarmd.node.algorithms.swarm.stage_service import RATE_WINDOW_S, StageJob, StageShape
from swarmd.optim.stage import StageTrainer
from swarmd.protocol.identity import Identity, PeerId

PEERS = [Identity.generate().peer_id for _ in range(6)]


def rec(stage: int, rate: float, queue: int = 0, state: str = "serving") -> StageRecord:
    return StageRecord(
        stage=stage, address=f"127.0.0.1:{1000 + stage}", rate=rate, queue=queue, state=state
    )


def test_router_prefers_fast_and_idle_servers_in_proportion() -> None:
    router = Router(random.Random(0))
    fast, slow = PEERS[:2]
    servers = {fast: rec(0, 30.0), slow: rec(0, 10.0)}
    picks = {fast: 0, slow: 0}
    for _ in range(400):
        choice = router.pick(servers)
        assert choice is not None
        picks[choice.peer] += 1
        router.started(choice.peer)
        if sum(picks.values()) % 4 == 0:  # calls finish: keep ~4 in flight
            for p in (fast, slow):
                while router._of(p).inflight > 0:
                    router.succeeded(p, 1.0 / servers[p].rate)
    share = picks[fast] / 400
    assert 0.6 < share < 0.9, picks  # ~3:1 by rate, never all on one


def test_a_published_queue_sends_calls_elsewhere() -> None:
    router = Router(random.Random(1))
    a, b = PEERS[:2]
    servers = {a: rec(0, 10.0, queue=20), b: rec(0, 10.0, queue=0)}
    picks = [router.pick(servers).peer for _ in range(200)]  # type: ignore[union-attr]
    assert picks.count(b) >= 190  # all but the few exploring calls (router.EXPLORE)


def test_a_timed_call_is_a_floor_on_the_estimate_not_multiplied_by_the_queue() -> None:
    now = [0.0]
    router = Router(random.Random(5), clock=lambda: now[0])
    a = PEERS[0]
    router.started(a)
    router.succeeded(a, 1.0)  # it met a queue: 1 s for a call its compute does in 0.1 s
    assert router.expected_s(a, rec(0, 10.0, queue=4)) == 1.0  # not 5 x 1.0
    assert router.expected_s(a, rec(0, 10.0, queue=19)) == 2.0  # 20 calls at 0.1 s each
    router.started(a)
    router.succeeded(a, 0.1)  # the queue drained: the estimate follows (EMA)
    assert router.expected_s(a, rec(0, 10.0)) == pytest.approx(0.73)


def test_a_server_timed_slow_once_is_still_called_now_and_then_and_recovers() -> None:
    router = Router(random.Random(7))
    slow_once, other = PEERS[:2]
    servers = {slow_once: rec(0, 10.0), other: rec(0, 10.0)}
    router.started(slow_once)
    router.succeeded(slow_once, 2.0)  # one call met a round's averaging: 2 s
    router.started(other)
    router.succeeded(other, 0.1)
    picks = [router.pick(servers).peer for _ in range(400)]  # type: ignore[union-attr]
    # Its estimate alone never picks it again; a few exploring calls still do ...
    assert 0 < picks.count(slow_once) <= 40, picks.count(slow_once)
    # ... and each one that comes back fast brings its timing back down (EMA).
    for _ in range(15):
        router.started(slow_once)
        router.succeeded(slow_once, 0.1)
    assert router.expected_s(slow_once, servers[slow_once]) < 0.11
    picks = [router.pick(servers).peer for _ in range(400)]  # type: ignore[union-attr]
    assert picks.count(slow_once) > 100, picks.count(slow_once)


def test_failures_ban_with_backoff_but_never_empty_a_stage() -> None:
    router = Router(random.Random(2))
    a, b = PEERS[:2]
    servers = {a: rec(0, 10.0), b: rec(0, 10.0)}
    router.started(a)
    assert router.failed(a, now=0.0) == 2.0
    assert {router.pick(servers, now=1.0).peer for _ in range(20)} == {b}  # type: ignore[union-attr]
    for _ in range(10):
        router.started(a)
        ban = router.failed(a, now=0.0)
    assert ban == MAX_BAN_S
    # Every server banned: the one banned least long is tried rather than nothing.
    router.started(b)
    router.failed(b, now=0.0)
    assert router.pick(servers, now=1.0).peer == b  # type: ignore[union-attr]
    assert router.pick({}, now=1.0) is None


def test_the_bottleneck_gets_one_server_of_the_best_served_stage() -> None:
    # Stage 0 has three servers, stage 1 one: the pipeline runs at stage 1's 10/s.
    records = {
        PEERS[0]: rec(0, 10),
        PEERS[1]: rec(0, 10),
        PEERS[2]: rec(0, 10),
        PEERS[3]: rec(1, 10),
    }
    assert stage_rates(records, 2) == [30, 10]
    movers = [p for p in PEERS[:4] if choose_move(records, p, 2, gain=1.25) is not None]
    assert len(movers) == 1 and records[movers[0]].stage == 0  # one mover, from stage 0
    move = choose_move(records, movers[0], 2, gain=1.25)
    assert move is not None and (move.source, move.target) == (0, 1)
    assert (move.before, move.after) == (10, 20)


def test_no_move_without_enough_gain_or_from_a_lone_server() -> None:
    balanced = {PEERS[0]: rec(0, 10), PEERS[1]: rec(0, 10), PEERS[2]: rec(1, 18)}
    assert all(choose_move(balanced, p, 2, 1.25) is None for p in PEERS[:3])
    lone = {PEERS[0]: rec(0, 10), PEERS[1]: rec(1, 1)}
    assert choose_move(lone, PEERS[0], 2, 1.25) is None  # stage 0 would be left empty
    # A server already joining the bottleneck counts there: nobody else follows it.
    joining = {
        **{p: rec(0, 10) for p in PEERS[:3]},
        PEERS[3]: rec(1, 10, state="joining"),
        PEERS[4]: rec(1, 10),
    }
    assert all(choose_move(joining, p, 2, 1.25) is None for p in PEERS[:3])


def test_stages_equally_slow_still_get_servers_from_the_best_served_and_none_comes_back() -> None:
    # Stage 0 has four servers, stages 1 and 2 one each: no one move raises the slowest total
    # (10) while two stages share it, yet moving is what balances the pipeline. Seen in the
    # simulator: 40 servers on 4 stages kept a stage at 1.5x the mean for a whole run.
    ids = [Identity.generate().peer_id for _ in range(6)]
    records = {p: rec(0, 10) for p in ids[:4]} | {ids[4]: rec(1, 10), ids[5]: rec(2, 10)}
    for target in (1, 2):
        movers = [(p, m) for p in ids if (m := choose_move(records, p, 3, 1.25)) is not None]
        assert len(movers) == 1, movers
        peer, move = movers[0]
        assert (move.source, move.target) == (0, target)
        records[peer] = rec(target, 10)
    assert stage_rates(records, 3) == [20, 20, 20]
    assert all(choose_move(records, p, 3, 1.25) is None for p in ids)


def test_an_empty_stage_is_filled() -> None:
    records = {PEERS[0]: rec(0, 10), PEERS[1]: rec(0, 10), PEERS[2]: rec(2, 10)}
    moves = [choose_move(records, p, 3, 1.25) for p in PEERS[:2]]
    (move,) = [m for m in moves if m is not None]
    assert move.target == 1 and move.before == 0


def test_records_parse_strictly() -> None:
    r = rec(1, 12.5, queue=3)
    assert StageRecord.from_bytes(r.to_bytes()) == r
    for raw in (b"[]", b"{}", b'{"stage": -1}', b"x" * 600, b"\xff"):
        try:
            StageRecord.from_bytes(raw)
        except ValueError:
            continue
        raise AssertionError(raw)
    bad = r.to_bytes().replace(b"12.5", b"1e309")
    try:
        StageRecord.from_bytes(bad)
        raise AssertionError("infinite rate accepted")
    except ValueError:
        pass
    grouped = by_stage({PEERS[0]: r}, 3)
    assert [len(g) for g in grouped] == [0, 1, 0]


def test_a_busy_server_rests_briefly_without_a_failure() -> None:
    router = Router(random.Random(3))
    a, b = PEERS[:2]
    servers = {a: rec(0, 10.0), b: rec(0, 10.0)}
    router.started(a)
    router.busy(a, now=0.0)
    assert {router.pick(servers, now=0.1).peer for _ in range(20)} == {b}  # type: ignore[union-attr]
    assert router.pick({a: servers[a]}, now=0.3).peer == a  # type: ignore[union-attr]
    # It was not counted as a failure: the next failure bans for the first step only.
    router.started(a)
    assert router.failed(a, now=1.0) == 2.0


def test_the_fastest_server_is_the_mover() -> None:
    records = {PEERS[0]: rec(0, 5), PEERS[1]: rec(0, 20), PEERS[2]: rec(0, 5), PEERS[3]: rec(1, 4)}
    movers = [p for p in PEERS[:3] if choose_move(records, p, 2, 1.25) is not None]
    assert movers == [PEERS[1]]  # moving it gives min(10, 24) = 10; a slow one min(25, 9)


def test_a_server_that_fails_forever_is_banned_at_most_the_cap() -> None:
    router = Router(random.Random(4))
    for _ in range(5000):  # a stage whose only server is dead: retried for a long time
        router.started(PEERS[0])
        ban = router.failed(PEERS[0], now=0.0)
    assert ban == MAX_BAN_S


def test_a_named_mover_stays_named_while_the_rates_swing() -> None:
    # Three equal servers whose measured rates swing by 10% from look to look: the strict
    # best changes, but the server named at the first look is still the mover at the second.
    first = {PEERS[0]: rec(0, 10), PEERS[1]: rec(0, 11), PEERS[2]: rec(0, 10), PEERS[3]: rec(1, 2)}
    (named,) = [p for p in PEERS[:3] if choose_move(first, p, 2, 1.25) is not None]
    assert named == PEERS[1]
    second = {**first, PEERS[1]: rec(0, 9.5), PEERS[2]: rec(0, 10.5)}
    assert choose_move(second, named, 2, 1.25) is None  # not the strict best any more
    move = choose_move(second, named, 2, 1.25, named=True)
    assert move is not None and (move.source, move.target) == (0, 1)
    # The others were not named: the strict rule holds for them.
    assert choose_move(second, PEERS[0], 2, 1.25, named=False) is None
    # A named server that fell far behind the best (beyond the gain) is not the mover.
    far = {**first, PEERS[1]: rec(0, 3)}
    assert choose_move(far, named, 2, 1.25, named=True) is None


Directory = dict[PeerId, StageRecord]


def _claimer(store: Directory, me: PeerId) -> Generator[None, None, bool]:
    """StageServer._claim as steps on a shared directory: each `yield` is where another
    server may act (a DHT store or read in between)."""
    store[me] = rec(1, 10, state="joining")
    yield
    verdict = contest(dict(store), me, 1)
    yield
    if verdict == "wait":
        yield  # contest_wait_s: long enough for a rival's read and publish (two steps)
        yield
        verdict = "go" if contest(dict(store), me, 1) == "go" else "yield"
        yield
    if verdict != "go":
        store[me] = rec(0, 10)
        yield
    return verdict == "go"


def _outcomes(schedule: list[int], pair: tuple[PeerId, PeerId]) -> list[bool]:
    """Runs two claimers, taking a step of server schedule[k] at step k (a finished server's
    turns are skipped), and returns whether each went."""
    store: Directory = {p: rec(0, 10) for p in pair}
    runs = [_claimer(store, p) for p in pair]
    went: list[bool | None] = [None, None]
    turns = iter(schedule)
    while None in went:
        k = next(turns, went.index(None))
        if went[k] is not None:
            continue
        try:
            next(runs[k])
        except StopIteration as done:
            went[k] = done.value
    return [bool(w) for w in went]


def test_two_servers_claiming_one_move_never_both_go() -> None:
    """Every interleaving of two servers' claims (publish, read, maybe read again, maybe
    publish a yield): at most one moves. In CI both spare stage-0 servers moved when they
    looked after the same round with no claim step."""
    pair = (PEERS[0], PEERS[1])
    for bits in range(1 << 12):
        schedule = [(bits >> i) & 1 for i in range(12)]
        assert sum(_outcomes(schedule, pair)) <= 1, schedule
    # One after the other: the first goes, the second sees it joining and stays.
    assert _outcomes([0] * 7 + [1] * 7, pair) == [True, False]
    assert _outcomes([1] * 7 + [0] * 7, pair) == [False, True]
    # In lockstep (both publish, then both read) each sees the other; exactly one goes.
    assert sum(_outcomes([0, 1] * 7, pair)) == 1
    assert sum(_outcomes([1, 0] * 7, pair)) == 1


def test_answers_agree_within_the_tolerance_and_the_odd_one_is_named() -> None:
    h = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    drift = h + 0.05 * torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    assert audit.agree_all([h], [drift])  # a step or two apart
    for lie in (-20 * h, -h, 2.2 * h, torch.zeros_like(h), torch.randn_like(h)):
        assert not audit.agree_all([h], [lie]), lie
    assert audit.distance_all([h], [h[:1]]) == float("inf")  # another shape
    loss, grad = torch.tensor(3.2), h
    assert audit.agree_all([loss, grad], [torch.tensor(3.21), drift])
    assert not audit.agree_all([loss, grad], [torch.tensor(-64.0), -20 * grad])
    assert audit.odd_one_out([h], [-20 * h], [drift]) == 1
    assert audit.odd_one_out([-20 * h], [h], [drift]) == 0
    assert audit.odd_one_out([h], [-20 * h], [-h]) is None  # the third backs neither
    assert audit.odd_one_out([h], [drift], [h]) is None  # ... or both


def test_a_distrusted_server_is_never_picked_even_as_the_last_resort() -> None:
    router = Router(random.Random(6))
    liar, honest = PEERS[:2]
    servers = {liar: rec(0, 100.0), honest: rec(0, 1.0)}
    router.distrust(liar, 1800.0, now=0.0)
    assert {router.pick(servers, now=1.0).peer for _ in range(20)} == {honest}  # type: ignore[union-attr]
    router.started(honest)
    router.failed(honest, now=1.0)  # every trusted server banned: the banned one, not the liar
    assert router.pick(servers, now=1.5).peer == honest  # type: ignore[union-attr]
    assert router.pick({liar: servers[liar]}, now=2.0) is None  # a stage of liars: no server
    assert router.pick({liar: servers[liar]}, now=1801.0).peer == liar  # type: ignore[union-attr]


def test_an_audit_s_opinion_is_drawn_at_random_not_by_speed() -> None:
    """The second opinion of an audit is any open server of the stage, equally likely: by
    speed, a fast liar's fast accomplice was asked for most of its hops and agreed with it."""
    router = Router(random.Random(3))
    fast, *slow = PEERS[:4]
    servers = {fast: rec(0, 100.0), **{p: rec(0, 1.0) for p in slow}}
    by_speed = [router.pick(servers).peer for _ in range(400)]  # type: ignore[union-attr]
    drawn = [router.pick(servers, drawn=True).peer for _ in range(400)]  # type: ignore[union-attr]
    assert by_speed.count(fast) >= 360  # all but the exploring calls (5%, ~15 of 400 elsewhere)
    assert all(60 < drawn.count(p) < 140 for p in servers), [drawn.count(p) for p in servers]
    router.distrust(fast, 60.0)
    assert fast not in {router.pick(servers, drawn=True).peer for _ in range(50)}  # type: ignore[union-attr]


def _job() -> StageJob:
    shape = StageShape(batch=1, block=1, width=1, vocab=1)
    # Only the rate is read: of a last stage, whose one call is `last`.
    return StageJob(cast(StageTrainer, types.SimpleNamespace(last_stage=True)), shape)


def test_a_server_s_rate_is_its_recent_compute_not_its_last_few_calls() -> None:
    """Servers move by their published rates: a few slow calls on a busy host must not make
    a server look twice as slow (CI: with a 5-call average, equal servers read 28-99/s and a
    second server left a stage one move had balanced)."""
    job = _job()
    job.observe("last", 0.03)  # the warm-up: averaged in, not kept
    job.observe("last", 0.01)
    assert job.seconds["last"] == pytest.approx(0.02)
    for _ in range(1000):
        job.observe("last", 0.02)
    steady = job.rate
    assert steady == pytest.approx(50, rel=1e-3)
    for _ in range(5):  # a moment of contention: five calls three times as slow
        job.observe("last", 0.06)
    # 0.3 s of 5 s: ~10% slower (an average of the last 5 calls read 21/s, 0.43x).
    assert job.rate > 0.85 * steady
    for _ in range(int(3 * RATE_WINDOW_S / 0.04)):  # the device now is slower for good
        job.observe("last", 0.04)
    assert job.rate == pytest.approx(25, rel=0.05)

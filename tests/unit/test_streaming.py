"""Streaming DiLoCo's schedule and math, with simulated peers in one process.

The driver below does what the daemon does with the network: a fragment's averaging runs as a
background trio task from `begin_round` on while the trainer keeps stepping; at the outer step
the trainer waits only if the answer has not come (or, eager, applies a stand-in). The
averaging function is a rendezvous of the simulated peers of one (turn, fragment): the weighted
mean of what they sent, or a failure for everyone on the turns chosen to fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
import trio
import trio.testing

from swarmd.node.statesync.catchup import state_to_take
from swarmd.node.statesync.donor import StateAdvert
from swarmd.node.statesync.snapshot import StateSnapshot
from swarmd.optim import (
    DiLoCo,
    DiLoCoConfig,
    FragmentReport,
    FragmentRound,
    StreamingConfig,
    StreamingDiLoCo,
)
from swarmd.optim.streaming import layer_units, split_fragments, state_age
from swarmd.workloads import GPT, GPTConfig, builtin_corpus, evaluate
from tests.harness.batches import random_batches

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
Batch = tuple[torch.Tensor, torch.Tensor]
Average = Callable[[FragmentRound], Awaitable[torch.Tensor | None]]


def _batches(n: int, seed: int, batch: int = 2, block: int = 16) -> list[Batch]:
    return random_batches(n, seed, batch, block)


def _config(h: int, p: int = 1, tau: int = 0, alpha: float = 0.0, **kw: object) -> StreamingConfig:
    base = DiLoCoConfig(inner_steps=h, inner_lr=3e-3, on_failure="defer")
    return StreamingConfig(base, fragments=p, overlap_steps=tau, mix_alpha=alpha, **kw)  # type: ignore[arg-type]


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- the in-process peers -------------------------------------------------------------------


class Rendezvous:
    """Averaging among simulated peers: one meeting per turn, the weighted mean once all
    `expected` peers sent (or the deadline passed: peers that never came are dropped), None
    for everyone on `fail_turns`. Tracks how many rounds each peer has in flight."""

    def __init__(self, peers: int, fail_turns: Sequence[int] = (), deadline_s: float = 1e9):
        self.peers = peers
        self.fail_turns = set(fail_turns)
        self.deadline_s = deadline_s
        self.meetings: dict[int, tuple[dict[int, tuple[torch.Tensor, float]], trio.Event]] = {}
        self.in_flight = [0] * peers
        self.max_in_flight = [0] * peers
        self.results: dict[int, torch.Tensor | None] = {}

    async def average(self, peer: int, rnd: FragmentRound) -> torch.Tensor | None:
        self.in_flight[peer] += 1
        self.max_in_flight[peer] = max(self.max_in_flight[peer], self.in_flight[peer])
        try:
            sent, done = self.meetings.setdefault(rnd.turn, ({}, trio.Event()))
            sent[peer] = (rnd.pseudo_grad.clone(), rnd.weight)
            if len(sent) == self.peers:
                done.set()
            with trio.move_on_after(self.deadline_s):
                await done.wait()
            if rnd.turn not in self.results:
                # In peer order, so the float sum does not depend on who came first.
                ordered = [sent[i] for i in sorted(sent)]
                total = sum(w for _, w in ordered)
                mean = sum(t * (w / total) for t, w in ordered)
                assert isinstance(mean, torch.Tensor)
                self.results[rnd.turn] = None if rnd.turn in self.fail_turns else mean
            result = self.results[rnd.turn]
            return None if result is None else result.clone()
        finally:
            self.in_flight[peer] -= 1


@dataclass
class InFlight:
    round: FragmentRound
    done: trio.Event = field(default_factory=trio.Event)
    result: torch.Tensor | None = None
    arrived_after_steps: int | None = None


@dataclass
class Trace:
    reports: list[FragmentReport] = field(default_factory=list)
    #: Inner steps the trainer took between a round's begin and its answer's arrival.
    steps_in_flight: list[int] = field(default_factory=list)


async def drive(
    opt: StreamingDiLoCo, batches: Sequence[Batch], average: Average, nursery: trio.Nursery
) -> Trace:
    """The daemon's trainer loop, with `average` instead of matchmaking + all-reduce."""
    trace = Trace()
    flight: InFlight | None = None

    async def run(f: InFlight) -> None:
        f.result = await average(f.round)
        f.arrived_after_steps = opt.steps - f.round.began_at_step
        trace.steps_in_flight.append(f.arrived_after_steps)
        f.done.set()

    async def finish(f: InFlight) -> None:
        await f.done.wait()  # the trainer waits only here: the round is late
        trace.reports.append(opt.finish_round(f.result))

    for batch in batches:
        opt.inner_step(batch)
        await trio.sleep(0)  # the other peers (and the rounds) run between inner steps
        if flight is not None and flight.done.is_set() and flight.round.stand_in_applied:
            await finish(flight)  # an eager stand-in's average came: replace the stand-in
            flight = None
        if opt.round_due():
            if flight is not None:  # a stand-in still waits for its average: wait now
                await finish(flight)
            flight = InFlight(opt.begin_round())
            nursery.start_soon(run, flight)
        if opt.outer_due():
            assert flight is not None
            if opt.config.eager and not flight.done.is_set():
                trace.reports.append(opt.apply_stand_in())
            else:
                await finish(flight)
                flight = None
    if flight is not None:
        assert flight.round.stand_in_applied
        await finish(flight)
    assert opt.pending is None
    return trace


def run_peers(
    peers: Sequence[StreamingDiLoCo],
    data: Sequence[Sequence[Batch]],
    meet: Rendezvous,
    *,
    delay: Callable[[int, FragmentRound], Awaitable[None]] | None = None,
) -> list[Trace]:
    traces: list[Trace | None] = [None] * len(peers)

    async def one(i: int, nursery: trio.Nursery) -> None:
        async def average(rnd: FragmentRound) -> torch.Tensor | None:
            result = await meet.average(i, rnd)
            if delay is not None:
                await delay(i, rnd)
            return result

        traces[i] = await drive(peers[i], data[i], average, nursery)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(len(peers)):
                nursery.start_soon(one, i, nursery)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(t is not None for t in traces)
    return [t for t in traces if t is not None]


# -- tests ----------------------------------------------------------------------------------


def test_one_fragment_no_overlap_no_mixing_is_exactly_diloco() -> None:
    """P=1, τ=0, α=0 against DiLoCo on the same data and averaging, a failed round included:
    every global tensor, momentum buffer and local weight is bit-identical, every round."""
    h, k, turns, failed = 3, 2, 5, 2
    for policy in ("defer", "local"):
        base = DiLoCoConfig(inner_steps=h, inner_lr=3e-3, on_failure=policy)  # type: ignore[arg-type]
        stream = [StreamingDiLoCo(GPT(TINY, seed=0), StreamingConfig(base)) for _ in range(k)]
        plain = [DiLoCo(GPT(TINY, seed=0), base) for _ in range(k)]
        data = [_batches(h * turns, seed=20 + i, batch=2 + i) for i in range(k)]
        traces = run_peers(stream, data, Rendezvous(k, fail_turns=[failed]))

        async def plain_run(plain: list[DiLoCo], data: list[list[Batch]]) -> None:
            meet = Rendezvous(k, fail_turns=[failed])

            async def peer(i: int) -> None:
                for t in range(turns):
                    for s in range(h):
                        plain[i].inner_step(data[i][t * h + s])
                        await trio.sleep(0)
                    assert plain[i].should_sync()
                    pg = plain[i].pseudo_gradient()
                    rnd = FragmentRound(0, t, plain[i].round, pg, plain[i].weight(), 0)
                    plain[i].apply_outer(pg, await meet.average(i, rnd))

            async with trio.open_nursery() as nursery:
                for i in range(k):
                    nursery.start_soon(peer, i)

        trio.run(plain_run, plain, data)
        for s, d, trace in zip(stream, plain, traces, strict=True):
            assert [r.status for r in trace.reports].count("averaged") == turns - 1
            common = {key: v for key, v in s.state_dict().items() if key in d.state_dict()}
            _assert_same_state(common, d.state_dict())
            assert s.round == d.round == (turns - 1 if policy == "defer" else turns)
            assert torch.equal(s.flat_params(), d.flat_params())


@pytest.mark.parametrize(
    ("fragments", "tau", "alpha"), list(itertools.product([1, 2, 4], [0, 1], [0.0, 0.5, 1.0]))
)
def test_matrix_with_a_failed_round_ends_identical(fragments: int, tau: int, alpha: float) -> None:
    """3 peers, 2 full cycles (2P fragment rounds); one round fails for everyone. The failed
    fragment is deferred (its global copy untouched), the others go on, and every peer ends
    with the same global state; at most one round in flight per peer; with τ > 0 each peer
    took τ inner steps while its round was on the wire."""
    h, k, cycles = 8, 3, 2
    failed = 1 if fragments > 1 else 0  # fragment 1's first round (P=1: the first round)
    config = _config(h, fragments, tau, alpha)
    peers = [StreamingDiLoCo(GPT(TINY, seed=0), config) for _ in range(k)]
    initial = peers[0].state_dict()
    data = [_batches(h * cycles, seed=100 + i, batch=1 + i) for i in range(k)]
    meet = Rendezvous(k, fail_turns=[failed])
    traces = run_peers(peers, data, meet)

    turns = cycles * fragments
    for trace in traces:
        assert [r.turn for r in trace.reports] == list(range(1, turns + 1))
        assert [r.fragment for r in trace.reports] == [t % fragments for t in range(turns)]
        assert [r.status for r in trace.reports] == [
            "deferred" if t == failed else "averaged" for t in range(turns)
        ]
        assert all(r.steps_since_begin == tau for r in trace.reports)
        assert trace.steps_in_flight == [tau] * turns
    assert meet.max_in_flight == [1] * k
    reference = peers[0].state_dict()
    for peer in peers[1:]:
        _assert_same_state(peer.state_dict(), reference)
    rounds = [int(reference[f"fragment_round.{f}"]) for f in range(fragments)]
    assert rounds == [cycles - (f == failed % fragments) for f in range(fragments)]
    assert int(reference["turn"]) == turns and int(reference["round"]) == turns - 1
    for name in peers[0].names:  # every parameter's global copy moved
        assert not torch.equal(reference[f"global.{name}"], initial[f"global.{name}"]), name
    if alpha == 1.0:  # the local weights never take the outer result: they stay apart
        assert not torch.equal(peers[0].flat_params(), peers[1].flat_params())


def test_trainer_keeps_stepping_while_the_round_is_on_the_wire() -> None:
    """The average arrives only after the peer took τ more inner steps: a driver that waited
    for the network at the round's start would deadlock (and the mock clock would jump to the
    deadline, failing the round)."""
    h, p = 12, 2
    for tau in (1, 3):
        opt = StreamingDiLoCo(GPT(TINY, seed=0), _config(h, p, tau, 0.5))
        meet = Rendezvous(1)

        async def late(i: int, rnd: FragmentRound, opt: StreamingDiLoCo = opt) -> None:
            for _ in range(100_000):
                if opt.steps >= rnd.began_at_step + opt.config.overlap_steps:
                    return
                await trio.sleep(0)
            raise AssertionError("the trainer did not step while its round was in flight")

        (trace,) = run_peers([opt], [_batches(2 * h, seed=5)], meet, delay=late)
        assert trace.steps_in_flight == [tau] * 4
        assert [r.status for r in trace.reports] == ["averaged"] * 4


def test_begin_refuses_a_second_round_in_flight() -> None:
    opt = StreamingDiLoCo(GPT(TINY, seed=0), _config(4, 2, 1, eager=True))
    for batch in _batches(1, seed=1):
        opt.inner_step(batch)
    assert opt.round_due() and not opt.outer_due()
    rnd = opt.begin_round()
    assert rnd.fragment == 0 and rnd.turn == 0 and opt.fragment_numel(0) == rnd.pseudo_grad.numel()
    with pytest.raises(RuntimeError, match="at most one fragment"):
        opt.begin_round()
    with pytest.raises(RuntimeError, match="not due yet"):
        opt.finish_round(rnd.pseudo_grad)
    opt.inner_step(_batches(1, seed=2)[0])
    opt.apply_stand_in()  # eager: the turn moves on, the round stays pending
    for batch in _batches(1, seed=3):
        opt.inner_step(batch)
    assert opt.round_due() and opt.pending is rnd
    with pytest.raises(RuntimeError, match="at most one fragment"):
        opt.begin_round()
    with pytest.raises(RuntimeError, match="stand-in"):
        opt.state_dict()
    opt.finish_round(rnd.pseudo_grad)
    assert opt.pending is None and opt.begin_round().fragment == 1


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_eager_stand_in_replaced_equals_applying_the_average(alpha: float) -> None:
    """Stand-in at the outer step, the real average right after: the same global state
    (bit-identical) and local weights (to rounding) as applying the average directly."""
    batches = _batches(4, seed=7)
    eager = StreamingDiLoCo(GPT(TINY, seed=0), _config(4, 2, 1, alpha, eager=True))
    plain = StreamingDiLoCo(GPT(TINY, seed=0), _config(4, 2, 1, alpha))
    average = torch.full((eager.fragment_numel(0),), 1e-3)
    for opt in (eager, plain):
        for batch in batches[:1]:
            opt.inner_step(batch)
        opt.begin_round()
        opt.inner_step(batches[1])
        assert opt.outer_due()
    stand_in = eager.apply_stand_in()
    report = eager.finish_round(average)
    direct = plain.finish_round(average)
    assert stand_in.status == "eager" and report.replaced_stand_in
    assert report.status == direct.status == "averaged"
    _assert_same_state(eager.state_dict(), plain.state_dict())
    torch.testing.assert_close(eager.flat_params(), plain.flat_params(), rtol=0, atol=1e-6)


def test_eager_peers_with_late_rounds_end_identical() -> None:
    """Rounds arrive 2 steps after the outer step: every peer applies stand-ins, replaces
    them when the average comes, and all end with the same global state."""
    h, p, tau, k = 8, 2, 1, 3
    config = _config(h, p, tau, 0.5, eager=True)
    peers = [StreamingDiLoCo(GPT(TINY, seed=0), config) for _ in range(k)]
    # Two steps past the last outer step, so its stand-in is replaced within the run.
    data = [_batches(2 * h + 2, seed=40 + i) for i in range(k)]

    async def late(i: int, rnd: FragmentRound) -> None:
        for _ in range(100_000):
            if peers[i].steps >= rnd.began_at_step + tau + 2:
                return
            await trio.sleep(0)
        raise AssertionError("the trainer did not keep stepping after its stand-in")

    traces = run_peers(peers, data, Rendezvous(k, fail_turns=[2]), delay=late)
    for trace in traces:
        statuses = [r.status for r in trace.reports]
        assert statuses == ["eager", "averaged"] * 2 + ["eager", "deferred", "eager", "averaged"]
        assert [r.replaced_stand_in for r in trace.reports] == [False, True] * 4
        # It stepped past the outer step (τ + 2 at least: the rendezvous may complete later
        # when another peer was scheduled late) and waited at the next round's start at most.
        stride = h // p
        assert all(tau + 2 <= s <= stride for s in trace.steps_in_flight), trace.steps_in_flight
        assert len(trace.steps_in_flight) == 4
    reference = peers[0].state_dict()
    for peer in peers[1:]:
        _assert_same_state(peer.state_dict(), reference)
    assert [int(reference[f"fragment_round.{f}"]) for f in range(p)] == [1, 2]


def test_a_dead_peer_does_not_stall_the_others() -> None:
    """Peer 2 stops training after its first round; the rendezvous (like the all-reduce) drops
    it by its deadline, and the survivors complete every round and agree."""
    h, p, tau, k = 4, 2, 1, 3
    config = _config(h, p, tau, 0.5)
    peers = [StreamingDiLoCo(GPT(TINY, seed=0), config) for _ in range(k)]
    data = [_batches(3 * h, seed=60 + i) for i in range(k)]
    data[2] = data[2][: h // p]  # one turn, then it is gone
    meet = Rendezvous(k, deadline_s=5.0)
    traces = run_peers(peers, data, meet)
    for trace in traces[:2]:
        assert [r.status for r in trace.reports] == ["averaged"] * 6
        assert [r.turn for r in trace.reports] == list(range(1, 7))
    _assert_same_state(peers[0].state_dict(), peers[1].state_dict())
    assert int(peers[2].state_dict()["turn"]) == 1


def _advert(opt: StreamingDiLoCo, port: int) -> StateAdvert:
    """What the daemon advertises for `opt`'s global state (`round` is the state's age)."""
    snap = StateSnapshot.build(opt.state_dict(), round=opt.age)
    assert state_age(opt.state_dict()) == opt.age
    return StateAdvert.of(snap, f"10.77.0.{port}:7000")


def test_a_peer_that_deferred_a_turn_alone_does_not_step_back_to_the_turn_before() -> None:
    """Seen in CI: peers 0 and 1 averaged turn 1 while peer 2, late, found no group and
    deferred it. The turn is in the state (and its hash) but the round is not; compared by
    round, peer 2's catch-up took the group's not yet replaced adverts of turn 0 (same round, two
    holders), stepped back a turn, deferred turn 1 alone again, and so on for the whole run.
    Compared by age (the turn) those adverts are its past; the group's turn-1 state is taken."""
    h, p = 4, 2
    peers = [StreamingDiLoCo(GPT(TINY, seed=0), _config(h, p)) for _ in range(3)]
    before = [_advert(peers[0], 1), _advert(peers[1], 2)]
    rounds = []
    for i, opt in enumerate(peers):
        for batch in _batches(h // p, seed=70 + i):
            opt.inner_step(batch)
        assert opt.round_due()
        rounds.append(opt.begin_round())
    mean = (rounds[0].pseudo_grad + rounds[1].pseudo_grad) / 2
    assert [peers[0].finish_round(mean.clone()).status, peers[1].finish_round(mean.clone()).status,
            peers[2].finish_round(None).status] == ["averaged", "averaged", "deferred"]  # fmt: skip
    lone = peers[2]
    assert (lone.round, lone.age) == (0, 1)
    mine = StateSnapshot.build(lone.state_dict(), round=lone.age).state_hash
    assert mine not in {a.state_hash for a in before}  # the turn moved: another state
    assert state_to_take(before, lone.age, mine, shared_round=0) is None
    after = [_advert(peers[0], 1), _advert(peers[1], 2)]
    assert after[0].state_hash == after[1].state_hash
    assert state_to_take(after, lone.age, mine, shared_round=0) == after[0].state_hash
    # And the group's peers keep their state against the lone one's advert.
    theirs = after[0].state_hash
    assert state_to_take([after[1], _advert(lone, 3)], 1, theirs, shared_round=1) is None


@pytest.mark.parametrize("layout", ["strided", "balanced"])
def test_joiner_and_restart_take_every_fragment_state(layout: str) -> None:
    h, p, tau = 4, 2, 1
    config = _config(h, p, tau, 0.5, layout=layout)
    data = _batches(6 * h, seed=8)
    ref = StreamingDiLoCo(GPT(TINY, seed=0), config)
    meet = Rendezvous(1)
    run_peers([ref], [data[: 3 * h // p]], meet)  # three turns: mid-cycle, fragment 1 next
    state, local = ref.state_dict(), ref.local_state_dict()
    assert int(state["turn"]) == 3 and ref.current_fragment == 1
    assert any(state["outer_momentum." + n].abs().sum() > 0 for n in ref.fragment_names(1))

    joiner = StreamingDiLoCo(GPT(TINY, seed=1), config)
    joiner.load_state_dict(state)
    _assert_same_state(joiner.state_dict(), state)
    assert joiner.current_fragment == 1 and joiner.round == 3
    assert torch.equal(joiner.flat_params(), joiner.global_flat())

    # A restart (global + local state) continues bit-identically with the uninterrupted peer.
    again = StreamingDiLoCo(GPT(TINY, seed=1), config)
    again.load_state_dict(state)
    again.load_local_state_dict(local)
    rest = data[3 * h // p :]
    run_peers([ref], [rest], Rendezvous(1))
    run_peers([again], [rest], Rendezvous(1))
    _assert_same_state(again.state_dict(), ref.state_dict())
    assert torch.equal(again.flat_params(), ref.flat_params())


def test_load_state_dict_refuses_bad_states() -> None:
    opt = StreamingDiLoCo(GPT(TINY, seed=0), _config(4, 2))
    good = opt.state_dict()
    with pytest.raises(ValueError, match="not the sum"):
        opt.load_state_dict({**good, "round": torch.tensor(5)})
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict({k: v for k, v in good.items() if k != "fragment_round.1"})
    one = StreamingDiLoCo(GPT(TINY, seed=0), _config(4, 1))
    with pytest.raises(ValueError, match="unexpected"):
        one.load_state_dict(good)  # another fragment count
    nan = dict(good, **{"global.head.ln_f.weight": torch.full((32,), float("nan"))})
    with pytest.raises(ValueError, match="NaN"):
        opt.load_state_dict(nan)
    _assert_same_state(opt.state_dict(), good)


def test_layouts() -> None:
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16), seed=0)
    names = [n for n, _ in model.named_parameters()]
    units = [k for k, _ in layer_units(names)]
    assert units == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]

    sizes = [p.numel() for p in model.parameters()]

    def prefixes(layout: str) -> list[set[str]]:
        frags = split_fragments(names, sizes, 2, layout)  # type: ignore[arg-type]
        assert sorted(i for f in frags for i in f) == list(range(len(names)))
        return [{".".join(names[i].split(".")[:2]) for i in f} for f in frags]

    strided = prefixes("strided")
    assert {"blocks.0", "blocks.2"} <= strided[0] and {"blocks.1", "blocks.3"} <= strided[1]
    sequential = prefixes("sequential")
    assert {"blocks.0", "blocks.1"} <= sequential[0] and {"blocks.2", "blocks.3"} <= sequential[1]
    with pytest.raises(ValueError, match="too few to split into 9 fragments"):
        StreamingDiLoCo(model, _config(9, 9))


def test_fragments_are_balanced_by_size() -> None:
    """The peak of a streaming sync is its largest fragment: the embeddings go where they
    even out the load instead of riding whole with one layer."""
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128), seed=0)
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    for layout in ("strided", "sequential"):
        frags = split_fragments(names, sizes, 4, layout)  # type: ignore[arg-type]
        assert sorted(i for f in frags for i in f) == list(range(len(names)))
        loads = [sum(sizes[i] for i in f) for f in frags]
        # Each fragment holds one block; the two embedding tables land on different ones.
        assert max(loads) / sum(sizes) < 0.28, loads
        assert all(sum(1 for i in f if names[i].startswith("blocks.")) > 0 for f in frags)
    # Balanced: single tensors by size, so within one tensor of 1/P, and still across depth.
    frags = split_fragments(names, sizes, 4, "balanced")
    assert sorted(i for f in frags for i in f) == list(range(len(names)))
    loads = [sum(sizes[i] for i in f) for f in frags]
    assert max(loads) - min(loads) <= max(sizes), loads
    assert max(loads) / sum(sizes) < 0.26, loads
    for f in frags:
        assert len({names[i].split(".")[1] for i in f if names[i].startswith("blocks.")}) >= 2
    assert split_fragments(names, sizes, 4, "balanced") == frags  # every peer agrees
    with pytest.raises(ValueError, match="too few to split"):
        split_fragments(names[:3], sizes[:3], 4, "balanced")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"h": 10, "p": 4}, "H=10 must be divisible by fragments P=4"),
        ({"h": 8, "p": 2, "tau": 4}, "τ=4 must be < H/P=4"),
        ({"h": 8, "p": 2, "tau": -1}, "overlap_steps must be an int >= 0"),
        ({"h": 8, "alpha": 1.5}, r"α=1.5 must be in \[0, 1\]"),
        ({"h": 8, "alpha": -0.1}, r"must be in \[0, 1\]"),
        ({"h": 8, "p": 0}, "fragments must be a positive int"),
        ({"h": 8, "layout": "random"}, "layout must be one of strided, sequential, balanced"),
        ({"h": 8, "eager": 1}, "eager must be a bool"),
    ],
)
def test_config_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)  # type: ignore[arg-type]


def test_two_peers_learn_the_builtin_corpus() -> None:
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    source = builtin_corpus(512 << 10)
    val = source.validation_batches(8, 64, max_batches=4)
    stream = StreamingConfig(
        DiLoCoConfig(inner_steps=8, inner_lr=3e-3), fragments=2, overlap_steps=1, mix_alpha=0.5
    )
    peers = [StreamingDiLoCo(GPT(config, seed=0), stream) for _ in range(2)]
    data = [list(itertools.islice(source.train_batches(i, 2, 8, 64, seed=0), 40)) for i in range(2)]
    before = evaluate(peers[0].model, val)
    run_peers(peers, data, Rendezvous(2))
    after = evaluate(peers[0].model, val)
    print(f"validation loss {before:.3f} -> {after:.3f} in 40 steps")
    assert after < before - 1.5, (before, after)

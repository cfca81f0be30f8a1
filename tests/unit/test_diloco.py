"""DiLoCo's optimizer math, with the averaging done in-process (the networked averaging layer
is tested on its own): equivalences, sign, group consistency, state, failures, learning."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from swarmd.node.averaging.allreduce import AllReduceResult
from swarmd.optim import DiLoCo, DiLoCoConfig, OuterStepReport
from swarmd.workloads import GPT, GPTConfig, builtin_corpus, evaluate
from tests.harness.diloco import (
    TINY_GPT,
    Batch,
    average_alone,
    outer_step_together,
    run_outer_step,
    tiny_batches,
)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


async def _fail(pg: torch.Tensor, weight: float) -> None:
    return None


def test_one_peer_h1_lr1_no_momentum_is_plain_adamw() -> None:
    config = DiLoCoConfig(inner_steps=1, inner_lr=3e-3, outer_lr=1.0, outer_momentum=0.0)
    model = GPT(TINY_GPT, seed=0)
    opt = DiLoCo(model, config)
    reference = GPT(TINY_GPT, seed=0)
    adamw = torch.optim.AdamW(
        reference.parameters(),
        lr=config.inner_lr,
        betas=config.inner_betas,
        eps=config.inner_eps,
        weight_decay=config.inner_weight_decay,
    )
    for batch in tiny_batches(6, seed=1):
        loss = opt.inner_step(batch)
        assert opt.should_sync()
        report = run_outer_step(opt, average_alone)
        assert report.status == "averaged" and not opt.should_sync()

        adamw.zero_grad()
        _, ref_loss = reference(*batch)
        assert ref_loss is not None
        ref_loss.backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        adamw.step()
        # Same loss at every step: DiLoCo's local model saw exactly AdamW's weights.
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        # global - (global - local) rounds in fp32; nothing else differs.
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert opt.round == 6


def test_pseudo_gradient_sign_and_outer_step() -> None:
    model = GPT(TINY_GPT, seed=0)
    opt = DiLoCo(
        model, DiLoCoConfig(inner_steps=2, inner_lr=1e-2, outer_lr=0.5, outer_momentum=0.0)
    )
    start = opt.flat_params()
    for batch in tiny_batches(2, seed=2):
        opt.inner_step(batch)
    local = opt.flat_params()
    pg = opt.pseudo_gradient()
    # global - local: it points back uphill, like a gradient, so SGD's minus sign moves the
    # global weights towards where the inner steps went.
    assert torch.equal(pg, start - local)
    assert float(pg.abs().max()) > 0
    opt.apply_outer(pg, pg)
    torch.testing.assert_close(opt.global_flat(), start - 0.5 * (start - local))
    assert torch.equal(opt.flat_params(), opt.global_flat())


def test_outer_nesterov_momentum_matches_the_formula() -> None:
    model = GPT(TINY_GPT, seed=0)
    opt = DiLoCo(model, DiLoCoConfig(inner_steps=1, inner_lr=1e-2))
    assert opt.config.outer_lr == 0.7 and opt.config.outer_momentum == 0.9
    theta = opt.global_flat()
    buf = torch.zeros_like(theta)
    for batch in tiny_batches(3, seed=3):
        opt.inner_step(batch)
        pg = opt.pseudo_gradient()
        run_outer_step(opt, average_alone)
        buf = 0.9 * buf + pg
        theta = theta - 0.7 * (pg + 0.9 * buf)
        torch.testing.assert_close(opt.global_flat(), theta, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            opt.state_dict()["outer_momentum.embed.wte.weight"],
            buf[: 256 * 32].view(256, 32),
            rtol=0,
            atol=1e-6,
        )


def test_four_peers_stay_identical_after_each_outer_step() -> None:
    k, h = 4, 3
    config = DiLoCoConfig(inner_steps=h, inner_lr=3e-3)
    peers = [DiLoCo(GPT(TINY_GPT, seed=0), config) for _ in range(k)]
    data = [tiny_batches(3 * h, seed=10 + i, batch=2 + i) for i in range(k)]  # unequal batches
    initial = peers[0].global_flat()
    for rnd in range(3):
        for i, peer in enumerate(peers):
            for step in range(h):
                peer.inner_step(data[i][rnd * h + step])
            assert peer.should_sync()
        # Before the outer step the local models differ (different data).
        assert not torch.equal(peers[0].flat_params(), peers[1].flat_params())
        group, reports = outer_step_together(peers)
        assert [r.weight for r in reports] == [float(h * (2 + i)) for i in range(k)]
        assert {r.round for r in reports} == {rnd + 1}
        assert all(r.status == "averaged" for r in reports)
        reference = peers[0].global_flat()
        for peer in peers:
            assert torch.equal(peer.global_flat(), reference)
            assert torch.equal(peer.flat_params(), reference)
            assert torch.equal(
                peer.state_dict()["outer_momentum.head.ln_f.weight"],
                peers[0].state_dict()["outer_momentum.head.ln_f.weight"],
            )
        # The mean is weighted by samples.
        weights = [w for _, w in group.contributions.values()]
        assert group.mean is not None
        expected = sum(t * w for t, w in group.contributions.values()) / sum(weights)
        torch.testing.assert_close(group.mean, expected)
    assert not torch.equal(reference, initial)


def _train(opt: DiLoCo, batches: Sequence[Batch]) -> None:
    for batch in batches:
        opt.inner_step(batch)
        if opt.should_sync():
            run_outer_step(opt, average_alone)


def test_state_round_trip_resumes_bit_identically() -> None:
    config = DiLoCoConfig(inner_steps=3, inner_lr=3e-3)
    data = tiny_batches(20, seed=4)
    uninterrupted = DiLoCo(GPT(TINY_GPT, seed=0), config)
    _train(uninterrupted, data)

    first = DiLoCo(GPT(TINY_GPT, seed=0), config)
    _train(first, data[:10])  # three rounds and one step into the fourth
    assert first.round == 3 and first.steps_since_sync == 1
    global_state, local_state = first.state_dict(), first.local_state_dict()
    assert all(isinstance(v, torch.Tensor) for v in global_state.values())
    assert set(global_state) == (
        {"round"}
        | {f"global.{n}" for n in first.names}
        | {f"outer_momentum.{n}" for n in first.names}
    )

    resumed = DiLoCo(GPT(TINY_GPT, seed=99), config)  # different init: everything must come back
    resumed.load_state_dict(global_state)
    resumed.load_local_state_dict(local_state)
    _train(resumed, data[10:])
    assert resumed.round == uninterrupted.round == 6
    for a, b in zip(resumed.model.parameters(), uninterrupted.model.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = resumed.state_dict(), uninterrupted.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_local_state_is_a_cpu_copy() -> None:
    """Saved local state must not alias the live tensors (the daemon writes it to disk while
    training goes on) and is on the CPU, so a peer can restart on another device."""
    opt = DiLoCo(GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=5))
    _train(opt, tiny_batches(2, seed=1))
    saved = opt.local_state_dict()
    before = {k: v.clone() for k, v in saved.items()}
    assert all(v.device.type == "cpu" for v in saved.values())
    _train(opt, tiny_batches(2, seed=2))  # moves the parameters and the AdamW moments
    assert all(torch.equal(saved[k], before[k]) for k in saved)
    restored = DiLoCo(GPT(TINY_GPT, seed=3), DiLoCoConfig(inner_steps=5))
    restored.load_state_dict(opt.state_dict())
    restored.load_local_state_dict(saved)
    for p in restored.model.parameters():
        state = restored.inner_optimizer.state[p]
        assert state["exp_avg"].device == p.device and state["step"].device.type == "cpu"


def test_joiner_adopts_the_global_state() -> None:
    config = DiLoCoConfig(inner_steps=2, inner_lr=3e-3)
    donor = DiLoCo(GPT(TINY_GPT, seed=0), config)
    _train(donor, tiny_batches(4, seed=5))
    donor.inner_step(tiny_batches(1, seed=6)[0])  # local progress is not part of the global state
    joiner = DiLoCo(GPT(TINY_GPT, seed=1), config)
    joiner.load_state_dict(donor.state_dict())
    assert joiner.round == donor.round == 2
    assert torch.equal(joiner.global_flat(), donor.global_flat())
    assert torch.equal(joiner.flat_params(), donor.global_flat())
    assert joiner.steps_since_sync == 0 and not joiner.inner_optimizer.state
    # Same next pseudo-gradient -> same outer step as a donor that had just synced.
    donor.load_state_dict(donor.state_dict())
    b = tiny_batches(2, seed=7)
    _train(donor, b)
    donor_inner = {id(p): s for p, s in donor.inner_optimizer.state.items()}
    assert donor_inner  # the donor's reload kept AdamW's state; the joiner started fresh
    _train(joiner, b)
    assert joiner.round == donor.round == 3


def test_load_state_dict_refuses_bad_states() -> None:
    opt = DiLoCo(GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=1))
    good = opt.state_dict()
    before = opt.global_flat()
    missing = dict(good)
    del missing["global.embed.wte.weight"]
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict(missing)
    wrong = dict(good, **{"global.embed.wte.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="has shape"):
        opt.load_state_dict(wrong)
    nan = dict(good, **{"outer_momentum.head.ln_f.weight": torch.full((32,), math.nan)})
    with pytest.raises(ValueError, match="NaN"):
        opt.load_state_dict(nan)
    with pytest.raises(ValueError, match="round"):
        opt.load_state_dict(dict(good, round=torch.tensor(1.5)))
    assert torch.equal(before, opt.global_flat())  # nothing was half-applied


def test_failed_averaging_applies_the_local_pseudo_gradient() -> None:
    config = DiLoCoConfig(inner_steps=2, inner_lr=3e-3)
    data = tiny_batches(2, seed=8)
    failed, alone = DiLoCo(GPT(TINY_GPT, seed=0), config), DiLoCo(GPT(TINY_GPT, seed=0), config)
    for opt in (failed, alone):
        for b in data:
            opt.inner_step(b)
    report = run_outer_step(failed, _fail)
    assert report.status == "local" and report.reason == "averaging failed"
    assert report.round == 1
    run_outer_step(alone, average_alone)
    assert torch.equal(failed.global_flat(), alone.global_flat())
    assert failed.steps_since_sync == 0


def test_non_finite_average_falls_back_to_local() -> None:
    opt = DiLoCo(GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=1, inner_lr=3e-3))
    opt.inner_step(tiny_batches(1, seed=9)[0])

    async def poisoned(pg: torch.Tensor, weight: float) -> torch.Tensor:
        return torch.full_like(pg, math.inf)

    report = run_outer_step(opt, poisoned)
    assert report.status == "local" and report.reason is not None
    assert bool(torch.isfinite(opt.global_flat()).all())


def test_deferred_failure_keeps_training_and_carries_the_weight() -> None:
    h = 2
    config = DiLoCoConfig(inner_steps=h, inner_lr=3e-3, on_failure="defer")
    opt = DiLoCo(GPT(TINY_GPT, seed=0), config)
    start = opt.global_flat()
    data = tiny_batches(2 * h, seed=11)
    for b in data[:h]:
        opt.inner_step(b)
    local = opt.flat_params()
    report = run_outer_step(opt, _fail)
    assert report.status == "deferred" and report.round == 0 and opt.round == 0
    assert torch.equal(opt.global_flat(), start) and torch.equal(opt.flat_params(), local)
    assert not opt.should_sync()  # trains another H steps before trying again
    for b in data[h:]:
        opt.inner_step(b)
    assert opt.should_sync()
    report, weight = _outer_step_checking_pg(opt, start)
    assert weight == 2 * h * 4.0 and report.inner_steps == 2 * h and opt.round == 1


def _outer_step_checking_pg(opt: DiLoCo, start: torch.Tensor) -> tuple[OuterStepReport, float]:
    """An outer step that checks its pseudo-gradient is ``start`` - local (all the steps
    since ``start``); the report, and the weight it was averaged with."""
    seen: list[float] = []

    async def record(pg: torch.Tensor, weight: float) -> torch.Tensor:
        seen.append(weight)
        torch.testing.assert_close(pg, start - opt.flat_params())
        return pg

    report = run_outer_step(opt, record)
    assert len(seen) == 1
    return report, seen[0]


def test_a_carried_round_keeps_one_state_and_the_next_pseudo_gradient_covers_both() -> None:
    """Two peers of one state that both sit a round out and carry it stay identical (their
    own pseudo-gradients, applied, differ), the round and the run's clock move on, and the
    next pseudo-gradient covers both rounds with both rounds' samples as its weight."""
    h = 2
    config = DiLoCoConfig(inner_steps=h, inner_lr=3e-3)
    peers = [DiLoCo(GPT(TINY_GPT, seed=0), config) for _ in range(2)]
    start = peers[0].global_flat()
    for seed, opt in enumerate(peers):
        for b in tiny_batches(h, seed=20 + seed):
            opt.inner_step(b)
    assert not torch.equal(peers[0].pseudo_gradient(), peers[1].pseudo_gradient())
    for opt in peers:
        report = opt.carry(opt.pseudo_gradient())
        assert report.status == "carried" and report.round == 1 and report.inner_steps == h
        assert torch.equal(opt.global_flat(), start) and opt.progress == h
        assert not opt.should_sync()
    assert peers[0].state_dict().keys() == peers[1].state_dict().keys()
    for name, value in peers[0].state_dict().items():
        assert torch.equal(value, peers[1].state_dict()[name]), name
    opt = peers[0]
    for b in tiny_batches(h, seed=30):
        opt.inner_step(b)
    assert opt.should_sync() and opt.progress == 2 * h
    _, weight = _outer_step_checking_pg(opt, start)
    assert weight == 2 * h * 4.0 and opt.round == 2 and opt.progress == 2 * h


def test_exception_in_averaging_leaves_state_unchanged() -> None:
    opt = DiLoCo(GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=1, inner_lr=3e-3))
    opt.inner_step(tiny_batches(1, seed=12)[0])
    before = (opt.global_flat(), opt.flat_params(), opt.round, opt.steps_since_sync)

    async def boom(pg: torch.Tensor, weight: float) -> torch.Tensor:
        raise RuntimeError("no group")

    with pytest.raises(RuntimeError, match="no group"):
        run_outer_step(opt, boom)
    assert torch.equal(before[0], opt.global_flat()) and torch.equal(before[1], opt.flat_params())
    assert (opt.round, opt.steps_since_sync) == before[2:]


def test_accepts_the_all_reduce_result() -> None:
    opt = DiLoCo(GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=1, inner_lr=3e-3))
    opt.inner_step(tiny_batches(1, seed=13)[0])

    async def partial(pg: torch.Tensor, weight: float) -> AllReduceResult:
        return AllReduceResult(
            pg * 0.5, dropped=set(), failed_parts=[1], recovered_parts=[], duration_s=0.0
        )

    report = run_outer_step(opt, partial)
    assert report.status == "partial" and report.round == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"inner_lr": -1.0}, "inner_lr"),
        ({"inner_betas": (0.9, 1.0)}, "inner_betas"),
        ({"outer_lr": math.nan}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"on_failure": "skip"}, "on_failure"),
        ({"nesterov": "yes"}, "nesterov"),
    ],
)
def test_config_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DiLoCoConfig(**kwargs)  # type: ignore[arg-type]


def test_loss_decreases_on_the_builtin_corpus() -> None:
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    source = builtin_corpus(512 << 10)
    val = source.validation_batches(8, 64, max_batches=4)
    opt = DiLoCo(GPT(config, seed=0), DiLoCoConfig(inner_steps=8, inner_lr=3e-3))
    before = evaluate(opt.model, val)
    for batch in source.train_batches(0, 1, 8, 64, seed=0):
        opt.inner_step(batch)
        if opt.should_sync():
            run_outer_step(opt, average_alone)
        if opt.round == 5:
            break
    after = evaluate(opt.model, val)
    assert before == pytest.approx(math.log(256), abs=0.2)
    print(f"validation loss {before:.3f} -> {after:.3f} in 40 steps")
    assert after < before - 1.5, (before, after)


def test_dependency_rule() -> None:
    """optim and workloads never import the daemon or the wire (nor numpy at runtime)."""
    code = (
        "import sys, swarmd.optim, swarmd.workloads\n"
        "bad = [m for m in sys.modules if m.startswith(('swarmd.node', 'swarmd.protocol', "
        "'grpc', 'trio'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_inner_seconds_end_a_round_before_h_and_weigh_it_by_its_samples() -> None:
    """With `inner_seconds`, a slow peer's round ends on time with fewer than H steps, weighted
    by the samples it trained; the next round's time counts from its own first step (not from
    the outer step, however long the averaging took), and a deferred round gets its own."""
    clock = _Clock()
    config = DiLoCoConfig(inner_steps=50, inner_lr=3e-3, inner_seconds=10.0)
    opt = DiLoCo(GPT(TINY_GPT, seed=0), config, clock=clock)
    assert not opt.should_sync()  # no step yet: nothing to send, whatever the time
    for b in tiny_batches(3, seed=40):
        opt.inner_step(b)
        clock.now += 4.0  # one step of a slow peer
        assert opt.should_sync() == (opt.steps_since_sync == 3)
    seen: list[float] = []

    async def record(pg: torch.Tensor, weight: float) -> torch.Tensor:
        seen.append(weight)
        return pg

    report = run_outer_step(opt, record)
    assert report.inner_steps == 3 and seen == [3 * 4.0] and opt.round == 1  # 4 a batch
    assert opt.progress == 50  # the run's clock moves by H a round, whatever the steps
    clock.now += 60.0  # a long all-reduce, then the next round
    assert not opt.should_sync()
    opt.inner_step(tiny_batches(1, seed=41)[0])
    clock.now += 9.0
    assert not opt.should_sync()
    clock.now += 1.0
    assert opt.should_sync()

    deferring = DiLoCo(
        GPT(TINY_GPT, seed=0),
        DiLoCoConfig(inner_steps=50, inner_seconds=10.0, on_failure="defer"),
        clock=clock,
    )
    deferring.inner_step(tiny_batches(1, seed=42)[0])
    clock.now += 10.0
    assert deferring.should_sync()
    assert run_outer_step(deferring, _fail).status == "deferred"
    assert not deferring.should_sync()
    deferring.inner_step(tiny_batches(1, seed=43)[0])
    clock.now += 10.0
    assert deferring.should_sync() and deferring.steps_since_sync == 2


def test_a_fast_peer_still_ends_at_h_steps_and_a_downloaded_state_restarts_the_time() -> None:
    clock = _Clock()
    opt = DiLoCo(
        GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=2, inner_seconds=10.0), clock=clock
    )
    opt.inner_step(tiny_batches(1, seed=44)[0])
    assert not opt.should_sync()
    opt.inner_step(tiny_batches(1, seed=45)[0])
    assert opt.should_sync()  # H before the time is up
    state = opt.state_dict()
    clock.now += 30.0
    opt.load_state_dict(state)  # a catch-up: this round's steps are dropped
    assert not opt.should_sync()
    opt.inner_step(tiny_batches(1, seed=46)[0])
    assert not opt.should_sync()


@pytest.mark.parametrize("seconds", [-1.0, math.inf, math.nan])
def test_inner_seconds_must_be_a_finite_non_negative_time(seconds: float) -> None:
    with pytest.raises(ValueError, match="inner_seconds"):
        DiLoCoConfig(inner_seconds=seconds)


def test_a_peer_at_h_before_the_rounds_time_is_told_how_long_to_wait() -> None:
    """H caps a fast peer's steps, and the round's inner_seconds still set when it syncs: it
    waits the rest out (ending at H, it reached the round's roll call ahead of everyone)."""
    clock = _Clock()
    opt = DiLoCo(
        GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=2, inner_seconds=10.0), clock=clock
    )
    assert opt.time_left() == 0.0  # no step yet: the round's time has not begun
    opt.inner_step(tiny_batches(1, seed=47)[0])
    clock.now += 3.0
    opt.inner_step(tiny_batches(1, seed=48)[0])
    assert opt.should_sync() and opt.time_left() == pytest.approx(7.0)
    clock.now += 8.0
    assert opt.time_left() == 0.0
    steps_only = DiLoCo(GPT(TINY_GPT, seed=0), DiLoCoConfig(inner_steps=1), clock=clock)
    steps_only.inner_step(tiny_batches(1, seed=49)[0])
    assert steps_only.should_sync() and steps_only.time_left() == 0.0

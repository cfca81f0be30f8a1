"""`--local-workers`: local ranks (real processes, gloo on loopback) take a peer's inner steps.

The test process is rank 0 here, as the daemon is in a run: LocalRanks starts rank 1 with
`python -m swarmd.node.peer.local.worker`, exactly as `swarmd join` does.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmd.node.peer.local.attach import attach_local
from swarmd.node.peer.local.config import LocalConfig
from swarmd.node.peer.local.ranks import LocalRankError, LocalRanks
from swarmd.node.peer.model import build_model
from swarmd.node.peer.runconfig import RunConfig
from swarmd.node.peer.strategy import LocalTarget
from swarmd.optim.demo_state import DeMoRun
from swarmd.optim.diloco import DiLoCo, trainable
from swarmd.workloads import TokenSource, load_source

CONFIG = RunConfig(
    name="t", n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4, inner_steps=3,
    inner_lr=0.003,
)  # fmt: skip
SHARD = 5


@pytest.fixture(scope="module")
def source() -> TokenSource:
    return load_source(CONFIG.data)


def batch(source: TokenSource, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = CONFIG
    return source.train_batch(SHARD, c.data_shards, c.batch_size, c.block_size, c.seed, index)


def combined(source: TokenSource, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What one process would train on to take the step N ranks take together."""
    parts = [batch(source, step * world + r) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


@pytest.fixture
def ranks_of(tmp_path: Path) -> Iterator[list[LocalRanks]]:
    started: list[LocalRanks] = []
    try:
        yield started
    finally:
        for ranks in started:
            ranks.close()


def start(target: LocalTarget, tmp: Path, started: list[LocalRanks]) -> LocalRanks:
    ranks = attach_local(target, LocalConfig(workers=2, timeout_s=60.0), CONFIG, tmp)
    assert ranks is not None
    started.append(ranks)
    return ranks


def diloco_on_two_ranks(tmp: Path, started: list[LocalRanks]) -> tuple[DiLoCo, LocalRanks]:
    model = build_model(CONFIG, "cpu")
    opt = DiLoCo(model, CONFIG.diloco_config())
    _, params = trainable(model)
    target = LocalTarget(model, params, opt, SHARD, opt.local_state_dict())
    return opt, start(target, tmp, started)


def test_diloco_on_two_ranks_equals_one_process_on_the_combined_batch(
    tmp_path: Path, source: TokenSource, ranks_of: list[LocalRanks]
) -> None:
    opt, ranks = diloco_on_two_ranks(tmp_path, ranks_of)
    ref = DiLoCo(build_model(CONFIG, "cpu"), CONFIG.diloco_config())
    for step in range(2 * CONFIG.inner_steps + 1):
        opt.inner_step(batch(source, ranks.data_index(step)))
        ref.inner_step(combined(source, step, 2))
        digests = ranks.digests()
        # Identical replicas after every inner step, including the first after the outer
        # step below changed rank 0's parameters (they reach rank 1 before that step).
        assert digests[0] == digests[1], step
        if opt.should_sync():
            assert ref.should_sync()
            # The outer contribution: the same pseudo-gradient and weight as one process
            # with both ranks' batches would send.
            pg, ref_pg = opt.pseudo_gradient(), ref.pseudo_gradient()
            assert opt.weight() == ref.weight() == 2 * CONFIG.batch_size * CONFIG.inner_steps
            assert float(pg.norm()) > 0
            assert_same_vector(pg, ref_pg)
            opt.apply_outer(pg, None)
            ref.apply_outer(ref_pg, None)
    assert_same_vector(opt.flat_params(), ref.flat_params())


def assert_same_vector(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float rounding, as vectors rather than element by element: two ranks and
    one process sum the batch's gradients in different orders, and AdamW divides each element
    by its own gradient scale, so an element whose gradient nearly cancels carries that
    rounding up to 1e-3 of its value (one of 21,600 on an AVX-512 machine, none on the AVX2
    ones before). Relative to the whole vector they differ by ~1e-6; with rank 1 training
    rank 0's batch instead of its own, by 0.6."""
    err = float((got - want).norm() / want.norm())
    assert err < 1e-4, err


def test_demo_ranks_average_gradients_and_take_rank_0s_step(
    tmp_path: Path, source: TokenSource, ranks_of: list[LocalRanks]
) -> None:
    config = CONFIG
    run = DeMoRun(build_model(config, "cpu"), config.demo_config(), config.lr_schedule_config())
    ref = DeMoRun(build_model(config, "cpu"), config.demo_config(), config.lr_schedule_config())
    _, params = trainable(run.model)
    _, ref_params = trainable(ref.model)
    ranks = start(LocalTarget(run.model, params, run, SHARD, None), tmp_path, ranks_of)
    for step in range(3):
        run.gradients(batch(source, ranks.data_index(step)))
        ref.gradients(combined(source, step, 2))
        for p, q in zip(params, ref_params, strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7)
        # DeMo's step is rank 0's alone (a group of one here): the parameters it changes
        # are broadcast to rank 1 before the next step.
        run.apply([run.prepare()])
        ref.apply([ref.prepare()])
        torch.testing.assert_close(
            torch.cat([p.detach().reshape(-1) for p in params]),
            torch.cat([p.detach().reshape(-1) for p in ref_params]),
            rtol=1e-4, atol=1e-6,
        )  # fmt: skip
    ranks.data_index(3)
    ranks.begin(0.0, optimizer_step=False)  # the SYNC a fourth step would start with
    model, x_y = run.model, batch(source, 6)
    _, loss = ranks.module(*x_y)  # rank 1 computes the same step's gradients
    torch.autograd.backward(loss)
    ranks.end()
    digests = ranks.digests()
    assert digests[0] == digests[1]
    assert model.training


def test_a_dead_rank_is_reported_by_rank_and_cause(
    tmp_path: Path, source: TokenSource, ranks_of: list[LocalRanks]
) -> None:
    opt, ranks = diloco_on_two_ranks(tmp_path, ranks_of)
    opt.inner_step(batch(source, ranks.data_index(0)))
    before = opt.flat_params()

    def model_error() -> None:
        raise ValueError("the model's own error")

    def lost_peer() -> None:  # what gloo raises inside DDP's backward when a rank is gone
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset")

    # An error of the step itself stays what it is (no restart would fix it); the group
    # still works after it.
    with pytest.raises(ValueError, match="own error"):
        ranks.run(model_error)
    assert len(set(ranks.digests())) == 1
    os.kill(ranks.pids[0], signal.SIGKILL)
    ranks.procs[0].wait(timeout=10)
    # Mid-step (the collective inside the backward fails): blamed on the dead rank.
    with pytest.raises(LocalRankError, match="local rank 1 was killed by SIGKILL"):
        ranks.run(lost_peer)
    with pytest.raises(LocalRankError, match="local rank 1 was killed by SIGKILL"):
        opt.inner_step(batch(source, ranks.data_index(1)))
    # Refused before anything was computed: rank 0's parameters are the last step's.
    assert torch.equal(opt.flat_params(), before)
    ranks.close()
    assert all(p.poll() is not None for p in ranks.procs)

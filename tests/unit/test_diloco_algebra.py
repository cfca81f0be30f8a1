"""DiLoCo's degenerate cases are the optimisers they generalise (the issue's algebra tests)."""

from __future__ import annotations

import torch

from swarmd.optim import DiLoCo, DiLoCoConfig
from swarmd.workloads import GPT
from tests.harness.diloco import (
    TINY_GPT,
    average_alone,
    outer_step_together,
    run_outer_step,
    tiny_batches,
)


def test_inner_sgd_h1_outer_lr1_no_momentum_is_data_parallel_sgd() -> None:
    lr, k = 0.05, 3
    config = DiLoCoConfig(
        inner_steps=1,
        inner_optimizer="sgd",
        inner_lr=lr,
        inner_weight_decay=0.0,
        grad_clip=None,
        outer_lr=1.0,
        outer_momentum=0.0,
    )
    peers = [DiLoCo(GPT(TINY_GPT, seed=0), config) for _ in range(k)]
    reference = GPT(TINY_GPT, seed=0)
    sgd = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(4):
        batches = [tiny_batches(1, seed=100 * step + i)[0] for i in range(k)]
        for peer, batch in zip(peers, batches, strict=True):
            peer.inner_step(batch)
        outer_step_together(peers)
        # Data parallel: every worker's gradient on its own batch, averaged, one SGD step.
        sgd.zero_grad()
        for x, y in batches:
            _, loss = reference(x, y)
            assert loss is not None
            (loss / k).backward()
        sgd.step()
    for peer in peers:
        for p, q in zip(peer.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_one_peer_outer_lr1_no_momentum_is_the_identity() -> None:
    config = DiLoCoConfig(inner_steps=3, outer_lr=1.0, outer_momentum=0.0)
    opt = DiLoCo(GPT(TINY_GPT, seed=0), config)
    for batch in tiny_batches(3, seed=7):
        opt.inner_step(batch)
    before = [p.detach().clone() for p in opt.model.parameters()]
    run_outer_step(opt, average_alone)
    # The outer step moved the global weights exactly onto where the inner steps went.
    for p, q in zip(opt.model.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert torch.allclose(opt.global_flat(), torch.cat([b.reshape(-1) for b in before]), atol=1e-6)

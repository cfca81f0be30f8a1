"""CheckFree's rebuild of a lost stage on hand-made weights, its layout checks, and when a
stage counts as lost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarmd.node.algorithms.swarm.directory import StageRecord
from swarmd.node.algorithms.swarm.recovery import lost
from swarmd.optim.checkfree import NORM_EPS, LayoutMismatch, recover
from swarmd.optim.stage import StageOptConfig, StageTrainer
from swarmd.protocol.identity import Identity
from swarmd.workloads import GPT, GPTConfig, lm_loss


def filled(value: float, extra: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Embedding(4, 3)] if extra else []
    layers += [nn.Linear(3, 3), nn.LayerNorm(3)]
    module = nn.Sequential(*layers)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)
    return module


def test_the_average_is_weighted_by_the_neighbours_gradient_norms() -> None:
    target, before, after = filled(0.0), filled(1.0, extra=True), filled(4.0)
    rec = recover(target, before, after, norm_before=3.0, norm_after=1.0)
    b, a = 3.0 + NORM_EPS, 1.0 + NORM_EPS
    want = (a * 4.0 + b * 1.0) / (a + b)  # the paper's: W_i = (a W_i+1 + b W_i-1) / (a + b)
    for p in target.parameters():
        torch.testing.assert_close(p, torch.full_like(p, want))
    assert rec.weight_before == pytest.approx(b / (a + b))
    # Zero norms (a neighbour that never stepped) still average, evenly.
    recover(target, filled(2.0), filled(6.0), 0.0, 0.0)
    assert all(torch.allclose(p, torch.full_like(p, 4.0)) for p in target.parameters())


def test_layers_that_do_not_fit_are_refused() -> None:
    with pytest.raises(LayoutMismatch):
        recover(filled(0.0), nn.Sequential(nn.Linear(3, 3)), filled(1.0), 1.0, 1.0)
    wider = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(3))
    with pytest.raises(LayoutMismatch):
        recover(filled(0.0), wider, filled(1.0), 1.0, 1.0)


def test_a_gpt_middle_stage_is_rebuilt_from_its_neighbours_blocks() -> None:
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, tie_weights=False)
    a, b = GPT(cfg, seed=1).stages(3), GPT(cfg, seed=2).stages(3)
    recover(b[1], a[0], a[2], 1.0, 1.0)  # stage 0 = embedding + block, stage 2 = block + head
    for (name, w), w0, w2 in zip(
        b[1].named_parameters(), a[0][1].parameters(), a[2][0].parameters(), strict=True
    ):
        torch.testing.assert_close(w, (w0 + w2) / 2, msg=name)


def test_lr_scale_travels_with_the_stage_state() -> None:
    opt = StageOptConfig(lr=1e-3)
    lin = [nn.Sequential(nn.Linear(2, 2)) for _ in range(2)]
    src, dst = (StageTrainer(m, 0, 1, opt, lm_loss) for m in lin)
    src.set_lr_scale(1.1)
    dst.load_state_dict(src.state_dict())
    assert dst.lr_scale == pytest.approx(1.1)
    assert dst.opt.param_groups[0]["lr"] == pytest.approx(1.1e-3)


def test_a_stage_is_lost_only_when_the_run_has_trained_and_nobody_serves_it() -> None:
    ids = [Identity.generate().peer_id for _ in range(3)]

    def rec(stage: int, norm: float, state: str = "serving") -> StageRecord:
        return StageRecord(stage, "127.0.0.1:1", 1.0, 0, state, 5, norm)

    assert lost({ids[0]: rec(0, 0.7), ids[1]: rec(2, 0.5)}, 1)
    assert not lost({ids[0]: rec(0, 0.0), ids[1]: rec(2, 0.0)}, 1)  # the run's start: idle
    assert not lost({ids[0]: rec(0, 0.7), ids[2]: rec(1, 0.2, "joining")}, 1)

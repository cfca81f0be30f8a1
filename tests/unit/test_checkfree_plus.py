"""CheckFree+ (issue 23): the swapped routes, an end stage's parts computing exactly what the
swapped model does, the rebuild of an end stage from its partner and the edge copy, and the
copies' wire form."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from torch import nn

from swarmd.node.algorithms.swarm import copies, wire
from swarmd.node.algorithms.swarm.copies import decode, kept_by
from swarmd.node.algorithms.swarm.recovery import build_all
from swarmd.node.algorithms.swarm.route import Hop, parse, route, swap_for
from swarmd.node.algorithms.swarm.stage_service import rows
from swarmd.node.peer.context import PeerContext
from swarmd.node.peer.options import JoinError
from swarmd.optim.checkfree import (
    LayoutMismatch,
    edge_layers,
    flat_parameters,
    recover_end,
)
from swarmd.optim.stage import StageOptConfig, StageTrainer
from swarmd.protocol.identity import PeerId
from swarmd.workloads import GPT, GPTConfig, lm_loss

CFG = GPTConfig(n_layer=6, n_head=2, n_embd=16, block_size=8, tie_weights=False)


def trainers(model: GPT, n: int) -> list[StageTrainer]:
    modules = model.stages(n)
    opt = StageOptConfig(lr=1e-2, grad_clip=None)
    out = [StageTrainer(m, i, n, opt, lm_loss) for i, m in enumerate(modules)]
    out[0].set_edge(edge_layers(modules[0], modules[1], first=True))
    out[-1].set_edge(edge_layers(modules[-1], modules[-2], first=False))
    return out


def run(stages: list[StageTrainer], hops: list[Hop], x: torch.Tensor, y: torch.Tensor) -> float:
    """One micro-batch along `hops`, as algorithms/swarm/trainer.py drives it (in process)."""
    *through, last = hops
    inputs = [x]
    for hop in through:
        inputs.append(stages[hop.stage].forward(inputs[-1], part=hop.part))
    loss, grad = stages[last.stage].last(inputs[-1], y, part=last.part)
    for i in range(len(through) - 1, -1, -1):
        hop = through[i]
        grad = stages[hop.stage].backward(inputs[i], grad, part=hop.part)  # type: ignore[arg-type]
    return loss


def test_routes_visit_every_stage_once_and_swap_the_end_pairs() -> None:
    names = {n: [h.name for h in route(4, s)] for n, s in [(0, ""), (1, "first"), (2, "both")]}
    assert names[0] == ["0", "1", "2", "3"]
    assert names[1] == ["0/edge", "1", "0/blocks", "2", "3"]
    assert names[2] == ["0/edge", "1", "0/blocks", "3/blocks", "2", "3/edge"]
    assert [h.name for h in route(2, "first")] == ["0/edge", "1/blocks", "0/blocks", "1/edge"]
    assert [h.name for h in route(3, "last")] == ["0", "2/blocks", "1", "2/edge"]
    # Half of the micro-batches swap at 0.5; with 3 stages they alternate between the pairs.
    kinds = [swap_for(seq, 3, 0.5) for seq in range(100)]
    assert kinds.count("") == 50 and kinds.count("first") == kinds.count("last") == 25
    assert {swap_for(seq, 4, 0.0) for seq in range(50)} == {""}
    assert {swap_for(seq, 1, 1.0) for seq in range(50)} == {""}
    assert parse("3/edge") == Hop(3, "edge") and parse("0") == Hop(0)
    for bad in ("x", "1/head", "", "1234", "-1", "1/"):
        with pytest.raises(ValueError):
            parse(bad)


@pytest.mark.parametrize(("n", "swap"), [(2, "first"), (3, "first"), (3, "last"), (4, "both")])
def test_a_swapped_micro_batch_computes_the_swapped_model_exactly(n: int, swap: str) -> None:
    """The hops' layers composed in the route's order (e.g. stage 1's blocks where stage 0's
    would run and the other way round): the same loss and every gradient, and each stage
    counts the micro-batch once (its weight and mean loss are per micro-batch)."""
    torch.manual_seed(0)
    model = GPT(CFG if n != 4 else replace(CFG, n_layer=8), seed=1)
    stages, ref = trainers(copy.deepcopy(model), n), trainers(copy.deepcopy(model), n)
    hops = route(n, swap)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    loss = run(stages, hops, x, y)
    want = lm_loss(nn.Sequential(*[ref[h.stage].part(h.part) for h in hops])(x), y)
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-5)
    for t, r in zip(stages, ref, strict=True):
        for (name, p), q in zip(t.module.named_parameters(), r.module.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert [t.pending for t in stages] == [1] * n


def test_an_end_stage_without_parts_refuses_part_calls() -> None:
    model = GPT(CFG, seed=1)
    opt = StageOptConfig(lr=1e-2)
    plain = StageTrainer(model.stages(2)[0], 0, 2, opt, lm_loss)
    with pytest.raises(ValueError, match="no part"):
        plain.forward(torch.zeros(1, 4, dtype=torch.int64), part="edge")
    assert not plain.has_edge


@pytest.mark.parametrize("first", [True, False])
def test_a_lost_end_stage_takes_its_partners_blocks_and_the_edge_copy(first: bool) -> None:
    lost_model, live = GPT(CFG, seed=1), GPT(CFG, seed=2)
    stages, partner_of = trainers(lost_model, 3), trainers(live, 3)
    target = stages[0 if first else 2]
    partner = partner_of[1]
    edge_source = partner_of[0 if first else 2]
    copy_ = edge_source.edge_vector()
    recover_end(target.part("edge"), target.part("blocks"), partner.module, copy_)
    torch.testing.assert_close(
        flat_parameters(target.part("blocks")), flat_parameters(partner.module)
    )
    torch.testing.assert_close(target.edge_vector(), copy_)
    # A copy of the wrong size changes nothing.
    before = flat_parameters(target.module)
    with pytest.raises(LayoutMismatch):
        recover_end(
            target.part("edge"), target.part("blocks"), GPT(CFG, seed=3).stages(3)[1], copy_[:-1]
        )
    torch.testing.assert_close(flat_parameters(target.module), before)


def test_a_run_that_swaps_needs_end_stages_cut_like_their_neighbours() -> None:
    """5 blocks in 2 stages are cut 2 + 3: stage 1's blocks cannot stand in for stage 0's."""
    config = SimpleNamespace(inner_lr=1e-3, weight_decay=0.0, swarm_swap=0.5)
    peer = cast(PeerContext, SimpleNamespace(config=config))
    uneven = GPT(replace(CFG, n_layer=5), seed=1).stages(2)
    with pytest.raises(JoinError, match="cut like their neighbours"):
        build_all(peer, uneven)
    even = build_all(peer, GPT(CFG, seed=1).stages(3))
    assert even[0].has_edge and even[-1].has_edge and not even[1].has_edge
    # A stage's blocks rebuilt from a partner with fewer of them: refused, nothing changed.
    lost = build_all(peer, GPT(CFG, seed=1).stages(2))[1]  # 3 blocks; uneven[0] has 2
    before = flat_parameters(lost.module)
    with pytest.raises(LayoutMismatch):
        recover_end(lost.part("edge"), lost.part("blocks"), uneven[0], lost.edge_vector())
    torch.testing.assert_close(flat_parameters(lost.module), before)
    assert not build_all(replace_peer(config, 0.0), GPT(CFG, seed=1).stages(3))[0].has_edge


def replace_peer(config: SimpleNamespace, swap: float) -> PeerContext:
    return cast(
        PeerContext, SimpleNamespace(config=SimpleNamespace(**{**vars(config), "swarm_swap": swap}))
    )


def test_edge_copies_round_trip_and_bad_ones_are_refused() -> None:
    flat = torch.randn(5000)
    data = bytearray(b"".join(wire.encode([torch.tensor([7]), rows(flat)], "fp32")))
    rnd, back = decode(data, 5000)
    assert rnd == 7 and torch.equal(back, flat)
    with pytest.raises(wire.WireError):
        decode(data, 9000)  # another layer's size
    bad = bytearray(b"".join(wire.encode([torch.tensor([-1]), rows(flat)], "fp32")))
    with pytest.raises(wire.WireError):
        decode(bad, 5000)
    assert kept_by(1, 4) == ["0/edge"] and kept_by(2, 4) == ["3/edge"]
    assert kept_by(1, 3) == ["0/edge", "2/edge"] and kept_by(0, 2) == ["1/edge"]
    assert kept_by(0, 4) == [] and kept_by(0, 1) == []


def _pid(k: int) -> PeerId:
    return PeerId(bytes([k]) * 32)


def test_a_rebuild_installs_the_median_of_copies_and_names_the_odd_one() -> None:
    """Issue 47 item 5: one stage-1 server serving a poisoned embedding (here sign-flipped)
    among three is outvoted and named; honest copies a round apart agree."""
    torch.manual_seed(0)
    honest = torch.randn(1000)
    later = honest + 1e-3 * torch.randn(1000)  # fetched a round later
    got = {_pid(1): (7, honest), _pid(2): (8, later), _pid(3): (9, -honest)}
    agreed = copies.agree(got)
    assert agreed.refused == [_pid(3)]
    assert agreed.round == 8  # the newest of those that agree
    assert float(torch.linalg.vector_norm(agreed.values - honest)) < 1e-2 * 32
    assert copies.agree({_pid(1): (7, honest)}).values.equal(honest)  # one copy: its word


def test_two_copies_that_disagree_are_not_installed() -> None:
    honest = torch.ones(100)
    with pytest.raises(ValueError, match="no majority"):
        copies.agree({_pid(1): (3, honest), _pid(2): (3, -honest)})
    with pytest.raises(ValueError):
        copies.agree({})
